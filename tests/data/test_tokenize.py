"""Tokenisation rules shared by every trainer."""

import pytest

from posttrain.data.tokenize import TokenizeError, encode_prompt_completion, encode_text


@pytest.fixture(scope="module")
def tok():
    from posttrain.models.loading import load_tokenizer

    return load_tokenizer(None, model="posttrain/tiny-qwen2")


def test_standard_prompt_completion_ends_with_eos(tok):
    out = encode_prompt_completion(tok, "reverse 12 =", " 21")
    assert tok.decode(out["prompt_ids"]) == "reverse 12 ="
    assert tok.decode(out["completion_ids"]) == " 21<|im_end|>"
    assert not out["truncated"]


def test_conversational_completion_is_what_the_assistant_adds(tok):
    out = encode_prompt_completion(tok, [{"role": "user", "content": "hi"}], [{"role": "assistant", "content": "yo"}])
    assert tok.decode(out["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert tok.decode(out["completion_ids"]) == "yo<|im_end|>\n"


def test_max_length_truncates_completion_and_rejects_long_prompt(tok):
    out = encode_prompt_completion(tok, "reverse 12 =", " 1234567", max_length=10)
    assert len(out["prompt_ids"]) + len(out["completion_ids"]) == 10 and out["truncated"]
    with pytest.raises(TokenizeError, match=r"row 7: the prompt is \d+ tokens.*max_length=3"):
        encode_prompt_completion(tok, "reverse 1234 =", " 4321", max_length=3, row=7)


def test_assistant_only_mask(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    out = encode_text(tok, messages, assistant_only=True)
    kept = [i for i, m in zip(out["input_ids"], out["loss_mask"]) if m]
    assert tok.decode(kept) == "yo<|im_end|>"
    with pytest.raises(TokenizeError, match="no assistant tokens"):
        encode_text(tok, messages[:1], assistant_only=True)
    with pytest.raises(TokenizeError, match="conversational"):
        encode_text(tok, "plain text", assistant_only=True)
    plain = encode_text(tok, "Flat is better")
    assert plain["input_ids"][-1] == tok.eos_token_id and all(plain["loss_mask"])
