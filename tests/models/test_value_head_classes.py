"""The classic value-head classes: AutoModelForCausalLMWithValueHead as classic TRL code uses it, and the
seq2seq one refused with a message saying why."""

import pytest
import torch

MODEL = "posttrain/tiny-qwen2"


def test_importable_from_posttrain_and_posttrain_models():
    import posttrain
    import posttrain.models

    assert posttrain.AutoModelForCausalLMWithValueHead is posttrain.models.AutoModelForCausalLMWithValueHead
    assert posttrain.AutoModelForSeq2SeqLMWithValueHead is posttrain.models.AutoModelForSeq2SeqLMWithValueHead


def test_classic_forward_save_load_and_generate(tmp_path):
    from posttrain import AutoModelForCausalLMWithValueHead

    model = AutoModelForCausalLMWithValueHead.from_pretrained(MODEL)
    assert isinstance(model.v_head.summary, torch.nn.Linear) and model.v_head.summary.out_features == 1
    torch.nn.init.normal_(model.v_head.summary.weight)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    lm_logits, loss, value = model(input_ids=ids)
    assert lm_logits.shape[:2] == (2, 4) and loss is None and value.shape == (2, 4)
    _, loss, _ = model(input_ids=ids, labels=ids)
    assert loss is not None and torch.isfinite(loss)
    *_, past = model(input_ids=ids, return_past_key_values=True)
    assert past is not None
    model.save_pretrained(str(tmp_path))
    again = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    torch.testing.assert_close(again(input_ids=ids)[2], value)
    out = model.generate(ids[:1], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


def test_seq2seq_value_head_is_refused_clearly():
    from posttrain import AutoModelForSeq2SeqLMWithValueHead

    for make in (AutoModelForSeq2SeqLMWithValueHead.from_pretrained, AutoModelForSeq2SeqLMWithValueHead):
        with pytest.raises(NotImplementedError, match="no encoder-decoder \\(seq2seq\\) support"):
            make("t5-small")
