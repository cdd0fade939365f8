"""The one-off passes over the dataset before training (DPO's precompute_ref_log_probs, BCO's prompt
embeddings) on 2 CPU processes (accelerate launch, gloo): each process scores only its share, and the gathered
columns equal a 1-process run's."""

import functools
import json
import os
import sys

import pytest
from tests.helpers.launch import accelerate_on_two, joined, run_launch

SCRIPT = os.path.join(os.path.dirname(__file__), "distributed_precompute.py")
_run = functools.partial(run_launch, timeout=480)


TRAINERS = ["dpo", "bco"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Both trainers in one 1-process run and one 2-process launch (worker_jobs.py)."""
    folder = tmp_path_factory.mktemp("precompute")
    _run([sys.executable, SCRIPT, *joined(*([folder / f"one_{t}.json", t] for t in TRAINERS))], folder)
    _run([*accelerate_on_two(SCRIPT), *joined(*([folder / f"two_{t}.json", t] for t in TRAINERS))], folder)
    return folder


@pytest.mark.parametrize("trainer", TRAINERS)
def test_each_process_scores_its_share_and_the_columns_match_one_process(folder, trainer):
    one, two = str(folder / f"one_{trainer}.json"), str(folder / f"two_{trainer}.json")
    single = json.load(open(one + ".0"))
    ranks = [json.load(open(f"{two}.{rank}")) for rank in (0, 1)]
    assert single["processes"] == 1 and all(r["processes"] == 2 for r in ranks)
    if trainer == "dpo":
        # 11 pairs: one process scores all 11; two score 6 each (the second share is rows 6-10 plus a repeat)
        assert single["scored"] == 11 and [r["scored"] for r in ranks] == [6, 6]
    else:
        # the 11 pairs become 22 labelled rows; 5 sampled prompts of each label, then the 11 distinct
        # undesirable prompts: 21 texts alone,
        # 3 + 3 + 6 per process (every share rounded up)
        assert single["scored"] == 21 and [r["scored"] for r in ranks] == [12, 12]
    for r in ranks:  # every process holds the whole columns, as one process computed them
        assert r["columns"].keys() == single["columns"].keys()
        for name, values in single["columns"].items():
            assert len(r["columns"][name]) == len(values) == {"dpo": 11, "bco": 22}[trainer]  # BCO: pairs unpaired
            assert r["columns"][name] == pytest.approx(values, rel=1e-5, abs=1e-5), name
    if trainer == "bco":
        assert len(set(single["columns"]["udm_weight"])) > 2  # the weights vary: the test compares something


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_the_precompute_shows_a_progress_bar_unless_disable_tqdm(tmp_path, capsys, disable_tqdm):
    from posttrain.tasks.builtin import task_preference_dataset
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path), precompute_ref_log_probs=True, per_device_eval_batch_size=4,
                     disable_tqdm=disable_tqdm, report_to="none", use_cpu=True)
    trainer = DPOTrainer("posttrain/tiny-qwen2", args=args, train_dataset=task_preference_dataset("reverse", size=10))
    assert len(trainer.train_dataset["ref_chosen_logps"]) == 10
    bar = "reference log-probs: 100%" in capsys.readouterr().err  # 3 batches of 4, 4, 2 pairs
    assert bar != disable_tqdm
