"""The demo's `vision` stage (`posttrain demo --stages vision`): the built-in tiny VLM on the visual task.

SFT from the untrained model on the task's training images, then each later row from the SFT
checkpoint: DPO (with RPO's NLL term on the chosen answers, `rpo_alpha=1`) on pairs of the right answer
and the SFT model's own wrong greedy answer (a wrong answer of the same kind where it was right); GRPO and
RLOO sampling 8 answers per image and rewarding the exact ones (`tasks.vision.vision_reward`; its reward has
variance within about 80% of the groups; GRPO without a KL term, RLOO with TRL's beta=0.05). Plain
DPO (no NLL term) or random wrong answers lowered the tiny model's accuracy in our runs: the rejected
answers' log-probs fall, and so do the chosen ones'. Every row reports
greedy exact-match accuracy on held-out images (never seen in training, `tasks.vision`).

A row is one function registered with `@vision_row(name)`: it takes the `VisionContext` (the plan,
the processor, the data, the SFT checkpoint and its accuracy) and returns (its model's folder,
(metric name, before, after)). Rows run in the order they are registered, SFT first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

VISION_MODEL = "posttrain/tiny-llava"
# measured on the tiny VLM (docs/vision.md): steps, learning rate, batch size
VISION_RECIPES = {"sft": dict(steps=300, lr=1e-3, batch=32),
                  "dpo": dict(steps=200, lr=5e-4, batch=16, beta=0.1, rpo_alpha=1.0),
                  # GRPO, RLOO: batch counts completions, 8 prompts x 8 samples of at most 4 tokens (an answer and
                  # EOS). Without a KL term RLOO (at lr 1e-4 and 2e-4) sometimes flipped the SFT model's one
                  # position answer to the other (0.44 -> 0.42, 0.45 -> 0.34: the tiny model cannot yet tell left
                  # from right, and nothing holds that coin toss); TRL's RLOO default beta=0.05 holds it
                  "grpo": dict(steps=300, lr=5e-4, batch=64, generations=8, temperature=1.0, beta=0.0),
                  "rloo": dict(steps=300, lr=1e-4, batch=64, generations=8, temperature=1.0, beta=0.05)}
VISION_TRAIN, VISION_EVAL = 2000, 200


@dataclass
class VisionContext:
    plan: object  # demo.DemoPlan: output_dir, seed, eval_size, verbose
    processor: object
    train: object  # vision_dataset("train")
    test: object  # held-out rows: images never seen in training
    start: str = VISION_MODEL  # the SFT checkpoint (the base model until SFT ran)
    start_acc: float = 0.0

    def folder(self, name: str) -> str:
        return str(Path(self.plan.output_dir) / f"vision_{name}")

    def args(self, name: str, **extra) -> dict:
        """Trainer fields of row `name` from VISION_RECIPES: constant learning rate, no checkpoints."""
        recipe = VISION_RECIPES[name]
        return dict(output_dir=self.folder(name), max_steps=recipe["steps"], learning_rate=recipe["lr"],
                    per_device_train_batch_size=recipe["batch"], logging_steps=max(1, recipe["steps"] // 10),
                    seed=self.plan.seed, save_strategy="no", report_to="none", lr_scheduler_type="constant",
                    disable_tqdm=not self.plan.verbose, **extra)

    def accuracy(self, model) -> float:
        from posttrain.eval import vision_accuracy
        from posttrain.models.loading import load_vision_lm

        return vision_accuracy(load_vision_lm(model), self.processor, self.test)


ROWS: list[tuple[str, object]] = []


def vision_row(name: str):
    """Register a row of the vision stage: `fn(ctx) -> (folder, (metric, before, after))`."""
    def register(fn):
        ROWS.append((name, fn))
        return fn
    return register


def _finish(trainer, ctx: VisionContext, name: str) -> str:
    import json

    trainer.save_model(ctx.folder(name))
    Path(ctx.folder(name), "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    return ctx.folder(name)


@vision_row("sft")
def run_vision_sft(ctx: VisionContext):
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    trainer = SFTTrainer(ctx.start, args=SFTConfig(**ctx.args("sft")), train_dataset=ctx.train,
                         processing_class=ctx.processor)
    trainer.train()
    path = _finish(trainer, ctx, "sft")
    return path, ("held-out accuracy", ctx.start_acc, ctx.accuracy(trainer.model))


def own_mistake_pairs(ctx: VisionContext):
    """Preference pairs on the training images: the right answer chosen; rejected, the SFT model's own greedy
    answer where it is wrong (the mistakes DPO should unlearn), else a wrong answer of the same kind."""
    import random

    from datasets import Dataset

    from posttrain.eval import vision_completions
    from posttrain.models.loading import load_vision_lm
    from posttrain.tasks.vision import ANSWERS, vision_check

    rows, rng = list(ctx.train), random.Random(f"vision-pairs-{ctx.plan.seed}")
    said = vision_completions(load_vision_lm(ctx.start), ctx.processor, [r["prompt"] for r in rows],
                              [r["images"] for r in rows], max_new_tokens=4)
    pairs = []
    for row, text in zip(rows, said):
        wrong = text.strip() if text.strip() and not vision_check(text, row["answer"]) else \
            rng.choice([a for a in ANSWERS[row["kind"]] if a != row["answer"]])
        pairs.append({"prompt": row["prompt"], "images": row["images"], "chosen": row["completion"],
                      "rejected": [{"role": "assistant", "content": wrong}]})
    return Dataset.from_list(pairs)


@vision_row("dpo")
def run_vision_dpo(ctx: VisionContext):
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    pairs = own_mistake_pairs(ctx)
    recipe = VISION_RECIPES["dpo"]
    args = DPOConfig(**ctx.args("dpo", beta=recipe["beta"], rpo_alpha=recipe["rpo_alpha"]))
    trainer = DPOTrainer(ctx.start, args=args, train_dataset=pairs, processing_class=ctx.processor)
    trainer.train()
    path = _finish(trainer, ctx, "dpo")
    return path, ("held-out accuracy", ctx.start_acc, ctx.accuracy(trainer.model))


def _online_row(ctx: VisionContext, name: str, trainer_cls, config_cls):
    """An online row (GRPO, RLOO) from the SFT checkpoint: `generations` sampled answers per training image,
    rewarded by exact match (`tasks.vision.vision_reward`)."""
    from posttrain.tasks.vision import vision_reward

    recipe = VISION_RECIPES[name]
    args = config_cls(**ctx.args(name, num_generations=recipe["generations"], max_completion_length=4,
                                 temperature=recipe["temperature"], beta=recipe["beta"], num_sample_generations=0))
    trainer = trainer_cls(ctx.start, vision_reward, args=args, train_dataset=ctx.train.remove_columns("completion"),
                          processing_class=ctx.processor)
    trainer.train()
    path = _finish(trainer, ctx, name)
    return path, ("held-out accuracy", ctx.start_acc, ctx.accuracy(trainer.model))


@vision_row("grpo")
def run_vision_grpo(ctx: VisionContext):
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    return _online_row(ctx, "grpo", GRPOTrainer, GRPOConfig)


@vision_row("rloo")
def run_vision_rloo(ctx: VisionContext):
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

    return _online_row(ctx, "rloo", RLOOTrainer, RLOOConfig)


def run_vision_stages(plan, record) -> None:
    """Every registered row, SFT first from the base model, the others from the SFT checkpoint; `record(stage,
    started, metric)` prints and keeps each row (demo._record)."""
    from transformers import set_seed

    from posttrain.models.loading import load_processor
    from posttrain.tasks.vision import vision_dataset

    processor = load_processor(None, VISION_MODEL)
    ctx = VisionContext(plan, processor, vision_dataset("train", VISION_TRAIN, seed=plan.seed),
                        vision_dataset("test", min(plan.eval_size, VISION_EVAL)))
    started = time.time()
    ctx.start_acc = ctx.accuracy(VISION_MODEL)
    record("vision base", started, ("held-out accuracy", ctx.start_acc, ctx.start_acc))
    for name, fn in ROWS:
        set_seed(plan.seed)
        started = time.time()
        path, metric = fn(ctx)
        record(f"vision {name}", started, metric)
        if name == "sft":
            ctx.start, ctx.start_acc = path, metric[2]
