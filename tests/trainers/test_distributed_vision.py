"""SFT and GRPO on the tiny vision-language model over 2 CPU processes (accelerate launch, gloo) equal 1 process
with the same global batch: the same first-step loss (and GRPO's reward) and the same updated weights, the
vision tower's and the projector's included. The launch is test_distributed.py's."""

import functools
import json
import os
import sys

import pytest
from tests.helpers.launch import accelerate_on_two, joined, run_launch

SCRIPT = os.path.join(os.path.dirname(__file__), "distributed_vision.py")
_run = functools.partial(run_launch, timeout=600, path=os.path.dirname(__file__))


TRAINERS = ["sft", "grpo"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each trainer's result from 1 process and from 2, both trainers in one launch each (worker_jobs.py):
    1 process x 8 rows (GRPO: 8 completions, 2 prompts) vs 2 processes x 4 rows (GRPO: 1 prompt each)."""
    pytest.importorskip("accelerate")
    folder = tmp_path_factory.mktemp("vision")
    _run([sys.executable, SCRIPT, *joined(*([folder / f"one_{t}.json", t, 8] for t in TRAINERS))], folder)
    _run([*accelerate_on_two(SCRIPT), *joined(*([folder / f"two_{t}.json", t, 4] for t in TRAINERS))], folder)
    return {t: [json.load(open(folder / f"{n}_{t}.json")) for n in ("one", "two")] for t in TRAINERS}


@pytest.mark.parametrize("trainer", TRAINERS)
def test_two_processes_match_one_on_a_vision_language_model(runs, trainer):
    a, b = runs[trainer]
    assert (a["processes"], b["processes"]) == (1, 2)
    if trainer == "grpo":
        assert b["reward"] == pytest.approx(a["reward"], abs=1e-6)  # the same completions were sampled
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
    assert any(n.startswith("model.vision_tower") for n in a["weights"])
    # the vision tower's attention key bias gets no gradient in exact arithmetic (softmax does not see a shift
    # shared by every key), so Adam's first step moves it by lr times the sign of rounding noise: not comparable
    noise = [n for n in a["weights"] if n.startswith("model.vision_tower") and n.endswith("k_proj.bias")]
    differ = [n for n, v in a["weights"].items()
              if n not in noise and b["weights"][n] != pytest.approx(v, rel=1e-5, abs=1e-5)]
    assert not differ, differ
