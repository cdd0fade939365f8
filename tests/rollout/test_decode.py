"""The lean decoding step gives what the model's own forward gives: same tokens, same log-probs
(to float rounding), with rows stopping early; and it steps aside for what it does not cover."""

import pytest
import torch
from tests.helpers.rollout import varied

from posttrain.accel import few_rows
from posttrain.accel.decode import lean_decoder
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.rollout import cpu_backend
from posttrain.rollout.generate import SamplingConfig, generate

PROMPTS = ["reverse 1234 =", "Beautiful is better than ugly. Explicit is", "a"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("posttrain/tiny-qwen2")


def both_ways(model, tok, monkeypatch, sampling, decoders=None):
    decoders = [] if decoders is None else decoders
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    runs = []
    for lean in (True, False):
        seen = []

        def probe(net, real=lean_decoder):
            found = real(net) if lean else None
            seen.append(found is not None)
            decoders.append(found)
            return found

        monkeypatch.setattr(cpu_backend, "lean_decoder", probe)
        runs.append(generate(model, ids, sampling, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             generator=torch.Generator().manual_seed(3)))
        assert seen == [lean]  # the lean step was (not) taken
    return runs


@pytest.mark.parametrize("name", ["posttrain/tiny-llama", "posttrain/tiny-qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("do_sample", [False, True])
def test_same_tokens_and_logprobs_as_the_model_forward(name, do_sample, tok, monkeypatch):
    model = varied(name)
    assert lean_decoder(model) is not None
    decoders = []
    lean, plain = both_ways(model, tok, monkeypatch, SamplingConfig(max_new_tokens=12, num_generations=2,
                                                                  do_sample=do_sample, temperature=0.9), decoders)
    assert (decoders[0]._c is not None) == few_rows.available()  # the compiled step ran where it can
    assert torch.equal(lean.completion_ids, plain.completion_ids)
    assert torch.equal(lean.completion_mask, plain.completion_mask)
    torch.testing.assert_close(lean.logprobs, plain.logprobs, rtol=1e-4, atol=1e-5)


def _clear_kernel_caches():
    from posttrain.accel import decode

    few_rows.kernels.cache_clear(), few_rows.few_rows_kernel.cache_clear(), decode._c_step_function.cache_clear()


@pytest.mark.skipif(not few_rows.available(), reason="no compiled kernels here")
def test_the_avx2_build_steps_as_the_model_forward_too(tok, monkeypatch):
    """POSTTRAIN_KERNELS_ISA=avx2 on a CPU with AVX-512 (elsewhere the build the other tests run): the other build
    of the kernels, the same tokens and log-probs as the model's forward."""
    monkeypatch.setenv("POSTTRAIN_KERNELS_ISA", "avx2")
    _clear_kernel_caches()
    try:
        assert few_rows.variant() == "avx2" and few_rows.kernels() is few_rows.build("avx2")
        model, decoders = varied("posttrain/tiny-qwen2"), []
        lean, plain = both_ways(model, tok, monkeypatch, SamplingConfig(max_new_tokens=12, num_generations=2,
                                                                      temperature=0.9), decoders)
        assert decoders[0]._c is not None
        assert torch.equal(lean.completion_ids, plain.completion_ids)
        torch.testing.assert_close(lean.logprobs, plain.logprobs, rtol=1e-4, atol=1e-5)
    finally:
        monkeypatch.delenv("POSTTRAIN_KERNELS_ISA")
        _clear_kernel_caches()


@pytest.mark.parametrize("head_dim", [64, 20])  # 64: SmolLM2's; 20: not a multiple of 8, the torch-ops step
def test_wider_heads_and_a_long_down_projection(head_dim, tok, monkeypatch):
    """Head size 64 (the attention's widest vector path), an MLP of 700 (the down projection's 700
    columns are cut into two blocks), grouped queries (4 query heads per key head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tok), hidden_size=96, intermediate_size=700, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=head_dim, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)  # logits spread enough for varied samples
    decoders = []
    lean, plain = both_ways(model, tok, monkeypatch, SamplingConfig(max_new_tokens=10, num_generations=3),
                            decoders)
    assert (decoders[0]._c is not None) == (few_rows.available() and head_dim % 8 == 0)
    assert torch.equal(lean.completion_ids, plain.completion_ids)
    torch.testing.assert_close(lean.logprobs, plain.logprobs, rtol=1e-4, atol=1e-5)


def test_rows_that_stop_early_are_dropped_alike(tok, monkeypatch):
    model = varied("posttrain/tiny-llama")
    sampling = SamplingConfig(max_new_tokens=16, num_generations=4, temperature=1.5)
    greedy = generate(model, [tok(PROMPTS[0])["input_ids"]], SamplingConfig(max_new_tokens=16, do_sample=False),
                      pad_token_id=tok.pad_token_id, eos_token_id=None)
    frequent = torch.mode(greedy.completion_ids.flatten()).values.item()  # a token the model often produces
    sampling.stop_token_ids = (frequent,)
    lean, plain = both_ways(model, tok, monkeypatch, sampling)
    lengths = lean.completion_mask.sum(1)
    assert lengths.min() < lengths.max()  # rows did stop at different steps
    assert torch.equal(lean.completion_ids, plain.completion_ids)
    torch.testing.assert_close(lean.logprobs, plain.logprobs, rtol=1e-4, atol=1e-5)


def test_steps_aside_for_what_it_does_not_cover():
    model = load_causal_lm("posttrain/tiny-llama")
    assert lean_decoder(model) is not None
    model(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True)  # transformers installs its capture hooks
    assert any(m._forward_hooks for m in model.modules())
    assert lean_decoder(model) is not None  # ... which do nothing during decoding
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert lean_decoder(model) is None  # a user's hook must run
    handle.remove()
    model.config.hidden_act = "gelu"
    assert lean_decoder(model) is None
    model.config.hidden_act = "silu"
    model.config.layer_types = ["sliding_attention"] + ["full_attention"] * (model.config.num_hidden_layers - 1)
    assert lean_decoder(model) is None
    model.config.layer_types = None

    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(load_causal_lm("posttrain/tiny-llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    assert lean_decoder(peft_model) is None
    assert lean_decoder(load_causal_lm("posttrain/tiny-llama").double()) is None
