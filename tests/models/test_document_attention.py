"""Document attention: each packed sequence attends to itself only, exactly as in a row of its own (values and
gradients, float64), sdpa unchanged without boundaries, the boundaries by hand, and SFT switching to it."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.accel import document_attention
from posttrain.accel.document_attention import ATTENTION, boundaries, enable
from posttrain.forward.logprobs import attention_kind

SHAPE = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)  # grouped-query attention: 2 query heads per key/value head


def llama(dtype=torch.float64, attention="sdpa"):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE, attn_implementation=attention)).to(dtype)


def test_boundaries_by_hand():
    """Two rows of 6: [0 1 2 | 0 1 | 0] and [0 1 2 3 | padding continuing 4 5]: starts 0 3 5 6 and 12."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    kw = boundaries(positions)
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 12] and kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"] and kw["max_length_q"] == kw["max_length_k"] == 6
    # a row that does not start at position 0 still starts a sequence; so does any jump other than +1
    assert boundaries(torch.tensor([[3, 4, 7, 8, 0]]))["cu_seq_lens_q"].tolist() == [0, 2, 4, 5]


def test_each_sequence_is_computed_as_in_its_own_row_and_sdpa_is_unchanged_without_boundaries():
    """Three sequences in one row: with the boundaries, every position's logits and every parameter's gradient
    are those of the sequences run as separate rows (float64, to rounding); without them, sdpa's own logits
    bit for bit (its block mask from the restarting positions)."""
    lengths = [5, 1, 7]
    torch.manual_seed(1)
    seqs = [torch.randint(0, SHAPE["vocab_size"], (n,)) for n in lengths]
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    weights = torch.randn(1, sum(lengths), SHAPE["vocab_size"], dtype=torch.float64)

    reference = llama()
    sdpa_logits = reference(input_ids=ids, position_ids=positions, use_cache=False).logits.detach()
    per_row = torch.cat([reference(input_ids=s[None], use_cache=False).logits for s in seqs], 1)
    (per_row * weights).sum().backward()

    model = llama()
    assert enable(model) and model.config._attn_implementation == ATTENTION and attention_kind(model) == "sdpa"
    assert torch.equal(model(input_ids=ids, position_ids=positions, use_cache=False).logits.detach(), sdpa_logits)
    logits = model(input_ids=ids, position_ids=positions, use_cache=False, **boundaries(positions)).logits
    torch.testing.assert_close(logits, per_row, rtol=1e-12, atol=1e-12)
    (logits * weights).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_several_packed_rows_with_trailing_padding():
    """Two packed rows whose padding continues the last sequence's positions (SFT's packed collator): each real
    token's logits are those of its sequence alone."""
    model = llama()
    enable(model)
    torch.manual_seed(2)
    rows = [[4, 2], [3]]  # sequence lengths per row; both rows 6 wide
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 6))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]])
    logits = model(input_ids=ids, position_ids=positions, use_cache=False, **boundaries(positions)).logits
    for r, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            alone = model(input_ids=ids[r:r + 1, start:start + n], use_cache=False).logits
            torch.testing.assert_close(logits[r:r + 1, start:start + n], alone, rtol=1e-12, atol=1e-12)
            start += n


def test_the_sequences_gradients_are_joined_not_zero_filled_and_added():
    """Each sequence's query, key and value are split off their row (SplitBackward: one concatenation per row in
    the backward), not sliced (SliceBackward: a zero-filled full-size gradient per sequence, then summed)."""
    from posttrain.accel.document_attention import document_sdpa

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    for B, cu in ((1, [0, 3, 5, 8]), (2, [0, 3, 8, 10, 16])):
        q, k, v = (torch.randn(B, h, 8, 4, requires_grad=True) for h in (4, 2, 2))
        out = document_sdpa(module, q, k, v, None, cu_seq_lens_q=torch.tensor(cu), cu_seq_lens_k=torch.tensor(cu))[0]
        seen, stack = set(), [out.grad_fn]
        while stack:
            node = stack.pop()
            if node is not None and node not in seen:
                seen.add(node)
                stack.extend(f for f, _ in node.next_functions)
        names = {type(node).__name__ for node in seen}
        assert "SliceBackward0" not in names and any(n.startswith("SplitWithSizesBackward") for n in names), names


def test_only_sdpa_is_switched_and_bad_boundaries_are_refused():
    eager = llama(attention="eager")
    assert not enable(eager) and eager.config._attn_implementation == "eager"

    class OwnLlama(LlamaForCausalLM):  # user or remote code: it may read the attention's name itself
        pass

    torch.manual_seed(0)
    own = OwnLlama(LlamaConfig(**SHAPE, attn_implementation="sdpa"))
    assert not enable(own) and own.config._attn_implementation == "sdpa"
    model = llama()
    enable(model)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 6))
    bad = {"cu_seq_lens_q": torch.tensor([0, 3, 5], dtype=torch.int32)}
    with pytest.raises(ValueError, match="must run from 0 to 6"):
        model(input_ids=ids, use_cache=False, **bad)
    document_attention.disable(model)
    assert model.config._attn_implementation == "sdpa"


def test_a_saved_model_loads_with_plain_sdpa(tmp_path):
    model = llama(torch.float32)
    assert enable(model) and model.config._attn_implementation == ATTENTION
    model.save_pretrained(tmp_path)
    assert LlamaForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"


def test_sft_trains_packed_rows_with_document_attention(tmp_path):
    """SFTTrainer switches an sdpa model to document attention when rows can hold several sequences (packing,
    or flattened padded batches), and the packed run's first loss is the unpacked run's (same sequences)."""
    from datasets import Dataset

    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    torch.manual_seed(3)
    rows = [{"input_ids": torch.randint(3, SHAPE["vocab_size"], (n,)).tolist()} for n in (9, 4, 6, 3)]
    losses = {}
    for packing in (False, True):
        model = llama(torch.float32)
        args = SFTConfig(output_dir=str(tmp_path / str(packing)), max_steps=1, per_device_train_batch_size=4,
                         max_length=24, packing=packing, padding_free=False if not packing else None,
                         report_to="none", use_cpu=True, logging_steps=1, learning_rate=0.0)
        trainer = SFTTrainer(model, args=args, train_dataset=Dataset.from_list(rows), processing_class=_tokenizer())
        assert (model.config._attn_implementation == ATTENTION) == packing
        trainer.train()
        losses[packing] = next(log["loss"] for log in trainer.state.log_history if "loss" in log)
        if packing:  # a second trainer on the same (now switched) model still uses it
            again = SFTTrainer(model, args=args, train_dataset=Dataset.from_list(rows), processing_class=_tokenizer())
            assert again._documents and model.config._attn_implementation == ATTENTION
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def _tokenizer():
    from posttrain.models.loading import load_tokenizer

    return load_tokenizer("posttrain/tiny-llama")
