"""posttrain uses the supported transformers APIs of the installed version: no deprecation warnings from
the KV cache's name or the activation-checkpointing property (issue #34)."""

import warnings

import torch

from posttrain.models import compat
from posttrain.models.loading import load_causal_lm
from posttrain.models.value_head import AutoModelForCausalLMWithValueHead
from posttrain.rollout.generate import SamplingConfig, generate


def test_decoding_and_checkpointing_checks_warn_nothing():
    model = load_causal_lm("posttrain/tiny-qwen2")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = generate(model, [[5, 6, 7]], SamplingConfig(max_new_tokens=3, num_generations=2),
                       pad_token_id=0, eos_token_id=None, generator=torch.Generator().manual_seed(0))
        assert out.completion_ids.shape == (2, 3)
        assert compat.activation_checkpointing(model) is False
        compat.enable_activation_checkpointing(AutoModelForCausalLMWithValueHead(model))
        assert compat.activation_checkpointing(model) is True


def test_the_cache_goes_under_the_name_the_forward_takes():
    model = load_causal_lm("posttrain/tiny-qwen2")
    name = compat.cache_name(model)
    assert name in ("cache", "past_key_values")
    ids = torch.tensor([[5, 6, 7]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        first = model(input_ids=ids, use_cache=True)
        cache = compat.output_cache(model, first)
        step = model(input_ids=torch.tensor([[8]]), **compat.cache_kwargs(model, cache), use_cache=True)
        whole = model(input_ids=torch.tensor([[5, 6, 7, 8]]))
        torch.testing.assert_close(step.logits[:, -1], whole.logits[:, -1], atol=1e-5, rtol=1e-5)
        critic = AutoModelForCausalLMWithValueHead(model)
        *_, past = critic(input_ids=ids, return_past_key_values=True)
        assert past.get_seq_length() == 3
