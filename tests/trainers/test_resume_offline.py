"""The offline trainers (SFT, reward, DPO and its reference variants, BCO with and without UDM, KTO)
stopped after step 2 and resumed from checkpoint-2 end as the uninterrupted run: same weights (and
synced reference), same logged numbers, bit for bit on CPU. One run is killed for real (SIGKILL)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from tests.helpers.preference import TINY, config_kwargs
from tests.helpers.resume import assert_resumes_identically, logged_numbers, run_fields, trained_state

from posttrain.tasks.builtin import zen
from posttrain.trainers.bco import BCOConfig, BCOTrainer
from posttrain.trainers.dpo import DPOConfig, DPOTrainer
from posttrain.trainers.kto import KTOConfig, KTOTrainer
from posttrain.trainers.reward import RewardConfig, RewardTrainer
from posttrain.trainers.sft import SFTConfig, SFTTrainer


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def fields(run: dict, **overrides) -> dict:
    """The tests' usual tiny-run fields, then the resumable run's, then the test's own; dropout stays on
    where the trainer keeps it (SFT) so that the RNG state is part of what must be restored."""
    return {**config_kwargs(run["output_dir"], per_device_train_batch_size=2, learning_rate=1e-3,
                            lr_scheduler_type="linear", seed=3), **run, **overrides}


def test_sft_resumes_identically(tmp_path):
    assert_resumes_identically(lambda **run: SFTTrainer(TINY, args=SFTConfig(**fields(run)), train_dataset=zen()),
                               tmp_path)


def test_reward_resumes_identically(tmp_path):
    assert_resumes_identically(lambda **run: RewardTrainer(TINY, args=RewardConfig(**fields(run)),
                                                           train_dataset=zen("preference")), tmp_path)


@pytest.mark.parametrize("extra", [
    {},
    {"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5},
    {"precompute_ref_log_probs": True},
], ids=["sigmoid", "sync_ref_model", "precompute_ref_log_probs"])
def test_dpo_resumes_identically(tmp_path, extra):
    resumed = assert_resumes_identically(
        lambda **run: DPOTrainer(TINY, args=DPOConfig(**fields(run, **extra)), train_dataset=zen("preference")),
        tmp_path)
    if extra.get("sync_ref_model"):  # the reference moved, and its moved weights were compared too
        assert any(k.startswith("ref_model.") for k in trained_state(resumed))


def test_bco_resumes_identically(tmp_path):
    assert_resumes_identically(lambda **run: BCOTrainer(TINY, args=BCOConfig(**fields(run)),
                                                        train_dataset=zen("unpaired_preference")), tmp_path)


def bag_of_tokens(input_ids, attention_mask):
    """A tiny deterministic sentence embedding: counts of the first 64 token ids."""
    counts = torch.zeros(input_ids.shape[0], 64)
    counts.scatter_add_(1, input_ids % 64, attention_mask.float())
    return counts


def test_bco_with_udm_resumes_identically(tmp_path):
    from posttrain.models.loading import load_tokenizer

    tokenizer = load_tokenizer(TINY)
    resumed = assert_resumes_identically(
        lambda **run: BCOTrainer(TINY, args=BCOConfig(**fields(run, prompt_sample_size=8)),
                                 train_dataset=zen("unpaired_preference"), embedding_func=bag_of_tokens,
                                 embedding_tokenizer=tokenizer), tmp_path)
    weights = resumed.train_dataset["udm_weight"]
    assert any(w != 1.0 for w in weights)  # UDM did weigh the undesirable rows


def test_kto_resumes_identically(tmp_path):
    assert_resumes_identically(lambda **run: KTOTrainer(TINY, args=KTOConfig(**fields(run)),
                                                        train_dataset=zen("unpaired_preference")), tmp_path)


# ------------------------------------------------------------------ a real kill

KILLED_RUN = textwrap.dedent("""
    import os, sys
    import torch
    from transformers import TrainerCallback
    from posttrain.tasks.builtin import zen
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    torch.set_num_threads(1)

    class Kill(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.kill(os.getpid(), 9)  # SIGKILL: no cleanup, no atexit, as a preempted job dies

    args = DPOConfig(**{fields})
    trainer = DPOTrainer("posttrain/tiny-qwen2", args=args, train_dataset=zen("preference"))
    trainer.add_callback(Kill())
    trainer.train()
""")


def test_dpo_killed_by_sigkill_after_its_checkpoint_resumes_identically(tmp_path):
    def make(**run):
        return DPOTrainer(TINY, args=DPOConfig(**fields(run)), train_dataset=zen("preference"))

    full = make(**run_fields(tmp_path / "full", 4, 2))
    full.train()
    expected_state, expected_logs = trained_state(full), logged_numbers(full, 2)

    killed_fields = fields(run_fields(tmp_path / "killed", 4, 2))
    script = KILLED_RUN.replace("{fields}", repr(killed_fields))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "killed")) == ["checkpoint-2"]

    resumed = make(**run_fields(tmp_path / "killed", 4, 2))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    state = trained_state(resumed)
    assert [k for k in state if not torch.equal(state[k], expected_state[k])] == []
    assert logged_numbers(resumed, 2) == expected_logs
