"""A LoRA adapter of a built-in model names its base by the built-in name (not this machine's cache folder),
and loading the adapter folder resolves that name."""

import json

import pytest
import torch

from posttrain.cache import cache_dir
from posttrain.models.loading import apply_peft, load_causal_lm, load_sequence_classifier

TINY = "posttrain/tiny-qwen2"


def test_builtin_models_record_their_name():
    assert load_causal_lm(TINY).config._name_or_path == TINY
    # the classifier records the name that resolves to a classifier again
    scorer = load_sequence_classifier(TINY)
    assert scorer.config._name_or_path == TINY + "-seqcls"
    again = load_sequence_classifier(scorer.config._name_or_path)
    assert all(torch.equal(a, b) for a, b in zip(scorer.state_dict().values(), again.state_dict().values()))


def test_adapter_records_the_builtin_name_and_loads_from_it(tmp_path):
    peft = pytest.importorskip("peft")
    model = apply_peft(load_causal_lm(TINY), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # LoRA's B starts at zero: give the adapter an effect to find after loading
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path)
    base = json.loads((tmp_path / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == TINY and str(cache_dir()) not in base

    ids = torch.tensor([[1, 5, 9, 12, 7]])
    loaded = load_causal_lm(str(tmp_path))
    with torch.no_grad():
        expected, got, plain = (m(input_ids=ids).logits for m in (model.eval(), loaded.eval(), load_causal_lm(TINY)))
    assert not torch.allclose(expected, plain, atol=1e-4)  # the adapter changes the outputs ...
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # ... and the loaded one changes them alike
