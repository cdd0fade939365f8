"""Held-out accuracy rising on `reverse` (slow): SDFT from a student that reads a demonstration in its prompt
(tests/helpers/self_distillation.py: a tiny model trained on plain prompts only cannot, so its self-teacher had
nothing to teach). It prints its figures (before -> after, the teacher's accuracy); the threshold sits well below
the measured gain.

SDPO has no learning test: from this student with the frozen initial model as teacher
(`teacher_model_kind="base"`) two runs of 120 steps rose (0.47 -> 0.59, 0.74) and the full suite's run fell
(0.34 -> 0.26); with TRL's default EMA teacher it fell too (0.47 -> 0.52 at 60 steps, 0.14 at 120). Its loss and
gradients are tested against float64 in test_self_distillation.py."""

import pytest
from datasets import Dataset
from tests.helpers.self_distillation import SOLUTION, accuracies, sft_reverse_with_hints

from posttrain.tasks.builtin import task_dataset

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hinted_student(tmp_path_factory):
    """The student that copies a shown answer (held-out 1.00 shown it) and half reverses (0.47 without)."""
    model, tok = sft_reverse_with_hints(steps=200)
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
