"""Learning runs (slow) of DAPO's overlong reward shaping and of the importance-sampling correction modes, from
the partially SFT-trained tiny model on `reverse` (benchmarks/learning_modes.py runs every mode; its figures
are in benchmarks/README.md). The IS modes sample through a stand-in vLLM engine whose weights are the
policy's rounded to bfloat16 (tests/helpers/engine.py), so the correction weights real sampler/trainer gaps."""

import importlib.util
from pathlib import Path

import pytest
from tests.helpers.engine import engine_patches

from posttrain.rollout import vllm_engine

_spec = importlib.util.spec_from_file_location("learning_modes",
                                               Path(__file__).parents[2] / "benchmarks" / "learning_modes.py")
learning_modes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(learning_modes)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["overlong", "sequence_mask"])  # sequence_mask: TRL's default mode
def test_learns_with(sft_reverse_path, tmp_path, monkeypatch, mode):
    """60 steps of 64 samples (seconds per run on a quiet 2-core machine): the held-out sampled reward rises by
    more than 0.1 and the greedy accuracy does not fall (measured here: sampled reward 0.424 -> 0.564-0.615,
    greedy accuracy 0.15 -> 0.20-0.29, depending on the thread count; 12 minutes with the SFT fixture on a
    loaded machine)."""
    for name, value in engine_patches(seed=42).items():
        monkeypatch.setattr(vllm_engine, name, value)
    before, after, means = learning_modes.run(mode, sft_reverse_path, 60, str(tmp_path))
    print(learning_modes.line(mode, before, after, means))
    assert after[1] > before[1] + 0.1 and after[0] >= before[0], (before, after)
    if mode == "overlong":
        assert means["shaping/overlong"] < 0  # some completions ran into the buffer
    else:  # the correction ran on every step, with the stand-in's log-probs apart from the policy's
        assert means["sampling/sampling_logp_difference/mean"] > 0
