"""Held-out accuracy rising on `reverse` (slow): SDFT and SDPO from a student that reads a demonstration in its prompt
(tests/helpers/self_distillation.py: a tiny model trained on plain prompts only cannot, so its self-teacher had
nothing to teach). Each prints its figures (before -> after, the teacher's accuracy); the thresholds sit well
below the measured gains.

SDPO's settings here, and why (measured on this student, 60 steps of 8 prompts x 8 samples, lr 1e-3):
- `distillation_mode="full_logits"` (the reverse KL over the vocabulary at each position) rather than TRL's default
  "sampled_token" (its single-sample estimate, log S(y) - log T(y) times the score of the sampled token: the same
  gradient in expectation, with one sample's noise): over 120 steps the sampled form gave 0.47 -> 0.59, 0.74 and
  0.34 -> 0.26 in three runs; the full one rose on every seed: 0.47 -> 0.68, 0.76, 0.64 (SDPO seeds 0, 1, 2 from
  this student), and from students SFT'd with other seeds 0.69 -> 0.99 and 0.99 -> 1.00 (one at the ceiling).
  The test runs on one thread (figures that do not follow the machine's load) for 100 steps: 0.34 -> 0.83 (at 60
  steps 0.34 -> 0.44, too close to its threshold).
  A successful peer is shown to 55-86% of the completions of every batch.
- `teacher_model_kind="base"` (the frozen initial model) rather than TRL's default EMA of the student: trained on
  plain prompts only, the tiny student forgets how to read a shown answer (held-out accuracy shown the answer 1.00
  -> about 0.75 in 60 steps) and an EMA teacher forgets with it (0.47 -> 0.52 at 60 steps, 0.14 at 120)."""

import pytest
from datasets import Dataset
from tests.helpers.self_distillation import SOLUTION, accuracies, sft_reverse_with_hints

from posttrain.tasks.builtin import exact_match_reward, task_dataset

# one thread: the float sums, so the student and the figures, do not follow the machine's load
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def hinted_student(tmp_path_factory):
    """The student that copies a shown answer (held-out 1.00 shown it) and partly reverses (0.34 without, on one
    thread; 0.47 from a 2-thread run)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # made before the tests' own one_thread fixture
    try:
        model, tok = sft_reverse_with_hints(steps=200)
    finally:
        torch.set_num_threads(threads)
    path = tmp_path_factory.mktemp("hinted_student")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def run_args(tmp_path, **more) -> dict:
    return {"output_dir": str(tmp_path), "per_device_train_batch_size": 64, "learning_rate": 1e-3,
            "lr_scheduler_type": "constant", "max_completion_length": 6, "logging_steps": 10, "report_to": "none",
            "disable_tqdm": True, "num_sample_generations": 0, "seed": 42, "save_strategy": "no", **more}


def test_sdft_learns_from_the_model_shown_the_answer(hinted_student, tmp_path):
    from posttrain import SDFTConfig, SDFTTrainer

    train = task_dataset("reverse", "train")
    data = Dataset.from_list([{"prompt": r["prompt"], "privileged_context": SOLUTION.format(
        successful_previous_attempt=" " + r["answer"])} for r in train])
    trainer = SDFTTrainer(hinted_student, train_dataset=data, args=SDFTConfig(**run_args(
        tmp_path, max_steps=60, num_generations=4,
        teacher_prompt_template="{prompt}{privileged_context}\n\nCorrectly solve the original question.\n")))
    (before, teacher) = accuracies(trainer.policy, trainer.processing_class)
    trainer.train()
    after, _ = accuracies(trainer.policy, trainer.processing_class)
    print(f"SDFT held-out greedy accuracy {before:.2f} -> {after:.2f} (the teacher, shown the answer: {teacher:.2f})")
    assert after > before + 0.15, (before, after)


def test_sdpo_learns_from_the_model_shown_a_successful_peer(hinted_student, tmp_path):
    from posttrain import SDPOConfig, SDPOTrainer

    train = task_dataset("reverse", "train").remove_columns("completion")
    args = SDPOConfig(**run_args(tmp_path, max_steps=100, num_generations=8, teacher_model_kind="base",
                                 distillation_mode="full_logits", seed=0))
    trainer = SDPOTrainer(hinted_student, exact_match_reward, train_dataset=train, args=args)
    before, teacher = accuracies(trainer.policy, trainer.processing_class)
    trainer.train()
    after, _ = accuracies(trainer.policy, trainer.processing_class)
    shown = [h["self_distillation/reprompt_sample_fraction"] for h in trainer.state.log_history
             if "self_distillation/reprompt_sample_fraction" in h]
    print(f"SDPO held-out greedy accuracy {before:.2f} -> {after:.2f} (the teacher, shown the answer: {teacher:.2f}); "
          f"completions with a successful peer shown: {min(shown):.2f}-{max(shown):.2f}")
    assert min(shown) > 0.3  # the demonstration is there: most groups hold a success
    assert after > before + 0.1, (before, after)
