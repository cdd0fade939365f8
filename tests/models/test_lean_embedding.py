"""make_lean_embedding: a tied input embedding's weight gradient as its used rows, added into the output layer's
dense gradient: the plain model's gradients (torch.equal), padding rows left out, a dense gradient where the
output layer takes no part in the loss, an untied or odd embedding left alone, deepcopy, pickle and undo."""

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers.copies import copied_and_reloaded
from posttrain.accel.lean import TiedEmbeddingFunction, is_lean, make_lean, make_lean_embedding, undo_lean

SHAPE = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=3)


def tied_llama(tie=True):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=tie)).train()


def ids_with_repeats():
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    ids[0, :5] = 7  # one token many times: its rows are summed in token order
    ids[1, -3:] = 3  # the padding token: no gradient for its row
    return ids


def grads(model, ids, through_head=True):
    model.zero_grad(set_to_none=True)
    if through_head:
        model(ids, labels=ids).loss.backward()
    else:  # a loss on the hidden states only: the output layer takes no part
        model.model(ids).last_hidden_state.square().mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_gradients_equal_the_plain_models_and_padding_rows_get_none():
    plain = tied_llama()
    lean = copy.deepcopy(plain)
    assert make_lean(lean) == 7 and make_lean_embedding(lean) == 1  # 2 norms + MLP per layer, final norm
    assert is_lean(lean.model.embed_tokens)
    ids = ids_with_repeats()
    for _ in range(2):  # the second time through the weight's hook registered on the first
        want, got = grads(plain, ids), grads(lean, ids)
        assert want.keys() == got.keys()
        for name in want:
            assert not got[name].is_sparse and torch.equal(want[name], got[name]), name
    # the embedding's own part: each used row's sum, the padding row's none
    weight = lean.model.embed_tokens.weight
    rows = torch.randn(*ids.shape, 48, dtype=torch.float64)
    w = weight.double().detach().requires_grad_()
    (grad,) = torch.autograd.grad((TiedEmbeddingFunction.apply(w, ids, 3) * rows).sum(), w)
    assert grad.is_sparse
    expect = torch.zeros(97, 48, dtype=torch.float64).index_add_(0, ids.reshape(-1), rows.reshape(-1, 48))
    expect[3] = 0
    assert torch.allclose(grad.to_dense(), expect, rtol=0, atol=1e-12)


def test_a_loss_without_the_output_layer_still_gets_a_dense_gradient():
    plain, lean = tied_llama(), tied_llama()
    make_lean_embedding(lean)
    ids = ids_with_repeats()
    want, got = grads(plain, ids, through_head=False), grads(lean, ids, through_head=False)
    weight = "model.embed_tokens.weight"
    assert not got[weight].is_sparse and torch.equal(want[weight], got[weight])
    torch.optim.AdamW(lean.parameters()).step()  # optimizers refuse sparse gradients


def test_untied_and_frozen_are_left_as_they_were():
    untied = tied_llama(tie=False)
    assert make_lean_embedding(untied) == 0 and not is_lean(untied.model.embed_tokens)
    frozen = tied_llama()
    make_lean_embedding(frozen)
    frozen.model.embed_tokens.weight.requires_grad_(False)
    ids = ids_with_repeats()
    frozen(ids, labels=ids).loss.backward()
    assert frozen.model.embed_tokens.weight.grad is None


def test_deepcopy_pickle_and_undo():
    model = tied_llama()
    make_lean_embedding(model)
    ids = ids_with_repeats()
    want = grads(model, ids)
    for other in copied_and_reloaded(model):
        assert is_lean(other.model.embed_tokens)
        got = grads(other, ids)
        assert all(not got[n].is_sparse and torch.equal(want[n], got[n]) for n in want)
    assert undo_lean(model) == 1 and type(model.model.embed_tokens) is torch.nn.Embedding
