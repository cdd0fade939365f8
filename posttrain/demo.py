"""`posttrain demo`: the end-to-end pipeline on the embedded default, every method learning.

On the built-in `reverse` task (reverse a 4-digit string) and the deterministic tiny model:

  1. evaluate the base model (held-out greedy exact match);
  2. SFT a short while -> a partly trained policy;
  3. train a reward model on (correct, corrupted) answer pairs -> held-out pairwise accuracy;
  4. from the same SFT checkpoint: GRPO, RLOO, PPO, REINFORCE++ and Online DPO with the task's checker as
     reward (Online DPO ranks the two samples of each prompt with it);
  5. from the same SFT checkpoint: DPO, ORPO, CPO, BCO and KTO on pairs built from the SFT model's own samples
     (a correct sample is chosen, an incorrect one rejected);

then prints a table (stage, metric before -> after, wall time) and writes report.md, curves.png
and every trained model (loadable with from_pretrained) under the output directory (demo_output/
for the tiny model, demo_output_<model>/ for another), and says where.

A stage that starts from the SFT checkpoint (the reward model, the online and the preference stages)
gets one even when `--stages` leaves SFT out: an earlier run's SFT checkpoint in the output directory
when it was made with the same model, task, seed and SFT budget, else SFT runs first; the demo says
which. Output is compact (one line per stage, a progress bar on a terminal, the table); `--verbose`
adds the trainers' logs and sample completions, which always go to each stage's folder
(log_history.json, completions.jsonl).

`--stages tools` (opt-in, a few minutes of CPU) runs two tool environments instead, each SFT on
tool-call traces then GRPO with the environment: the calculator task (`CalculatorEnv`, 2-digit
products; it also reports the SFT model's accuracy with the tool results withheld) and
guess-the-number (`GuessNumberEnv`, its `get_reward` the reward); it reports the held-out
accuracy / reward before -> after GRPO and shows an episode of each.

`--model smollm2` runs GRPO on the real SmolLM2-135M-Instruct instead, on single-digit sums
("What is 8 + 7?") answered within 8 tokens: it knows the sums but starts explanations that the
budget cuts off, and GRPO teaches it to state the result ("8 + 7 = 15").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

STAGES = ("sft", "reward", "grpo", "rloo", "ppo", "reinforce_pp", "online_dpo", "dpo", "orpo", "cpo", "bco", "kto",
          "distill")
# Run only when asked (--stages tools): a few minutes of CPU, more than the default stages together; the other
# online methods learn as their namesakes above (--stages xpo,nash_md,gmpo,gspo_token,grpo_with_replay_buffer,a2po).
OPT_IN_STAGES = ("tools", "xpo", "nash_md", "gmpo", "gspo_token", "grpo_with_replay_buffer", "a2po", "vision")
# --stages vision: the tiny vision-language model on the visual task (demo_vision.py), its rows in the same table


ONLINE = ("grpo", "rloo", "ppo", "reinforce_pp", "online_dpo", "xpo", "nash_md", "gmpo", "gspo_token",
          "grpo_with_replay_buffer", "a2po")
PAIRED = ("online_dpo", "xpo", "nash_md")  # two completions per prompt, ranked against each other
PREFERENCE = ("dpo", "orpo", "cpo", "bco", "kto")
NEEDS_SFT = ("reward", *ONLINE, *PREFERENCE, "distill")  # stages that start from the SFT checkpoint
SFT_RECORD = "demo_stage.json"  # in the SFT folder: what made the checkpoint, and its held-out accuracy

# Budgets and learning rates per stage, measured on the tiny model (see the table in README.md).
# The online stages count rollouts of 8 prompts x 8 samples: RLOO and PPO take num_ppo_epochs (4)
# optimizer steps per rollout, so every online method sees the same 100 rollouts. Online DPO, XPO and Nash-MD
# rank 32 prompts x 2 samples per step.
# The distill stage: each distillation trainer (and SFT on the teacher's samples, with as many completion tokens)
# trains the SFT checkpoint for `distill` steps of distill_batch_size completions from the best online stage's
# policy.
STEPS = {"sft": 170, "reward": 200, "grpo": 100, "rloo": 100, "ppo": 100, "reinforce_pp": 100,
         "online_dpo": 40, "xpo": 40, "nash_md": 40, "gmpo": 100, "gspo_token": 100, "grpo_with_replay_buffer": 100,
         "a2po": 40, "dpo": 200, "orpo": 60, "cpo": 60, "bco": 100, "kto": 100, "distill": 25}
LEARNING_RATES = {"sft": 3e-3, "reward": 1e-3, "grpo": 1e-3, "rloo": 1e-3, "ppo": 1e-3, "reinforce_pp": 1e-3,
                  "online_dpo": 1e-3, "xpo": 1e-3, "nash_md": 1e-3, "gmpo": 1e-3, "gspo_token": 1e-3,
                  "grpo_with_replay_buffer": 1e-3, "a2po": 1e-3,
                  "dpo": 3e-4, "orpo": 3e-4, "cpo": 3e-4, "bco": 5e-4, "kto": 5e-4, "distill": 2e-3}


@dataclass
class DemoPlan:
    model: str = "posttrain/tiny-qwen2"
    task: str = "reverse"
    conversational: bool = False
    stages: tuple[str, ...] = STAGES
    output_dir: str = "demo_output"
    seed: int = 0
    steps: dict[str, int] = field(default_factory=lambda: dict(STEPS))
    learning_rates: dict[str, float] = field(default_factory=lambda: dict(LEARNING_RATES))
    rl_batch_size: int = 64  # completions per rollout (num_generations per prompt)
    num_generations: int = 8
    temperature: float = 1.0  # sampling temperature of the online stages
    eval_size: int = 100
    max_new_tokens: int = 8
    sft_first: bool = True  # the NEEDS_SFT stages start from the SFT checkpoint (else from the model itself)
    verbose: bool = False  # the trainers' logs and sample completions on the console too
    step_units: dict[str, tuple[int, str]] = field(default_factory=dict)  # stage -> (steps per x unit, x label)
    distill_batch_size: int = 16  # completions per step of each distillation trainer
    distill_tokens: int | None = None  # completion tokens the distillation trainer saw (the SFT baseline's budget)
    results: list[dict] = field(default_factory=list)

    def set_steps(self, group: str, n: int):
        """--sft_steps / --reward_steps / --rl_steps (every online stage) / --pref_steps (DPO, ORPO, CPO, BCO, KTO)."""
        names = {"sft": ("sft",), "reward": ("reward",), "rl": ONLINE, "pref": PREFERENCE,
                 "distill": ("distill",)}[group]
        self.steps.update({name: n for name in names})


def plan_for(model: str | None) -> DemoPlan:
    if model in ("smollm2", "posttrain/smollm2-135m-instruct"):
        plan = DemoPlan(model="posttrain/smollm2-135m-instruct", task="quick-add", conversational=True,
                        stages=("grpo",), eval_size=30, max_new_tokens=8, rl_batch_size=16, num_generations=8,
                        temperature=0.7, output_dir="demo_output_smollm2", sft_first=False)
        plan.steps["grpo"], plan.learning_rates["grpo"] = 40, 1e-5
        return plan
    plan = DemoPlan()
    if model:
        plan.model = model if "/" in model or os.path.isdir(model) else f"posttrain/{model}"
        if plan.model != DemoPlan.model:  # never mixed into the default run's folder
            plan.output_dir = f"demo_output_{Path(plan.model.rstrip('/')).name}"
    return plan


# ---------------------------------------------------------------- helpers

def _console():
    from rich.console import Console

    return Console(soft_wrap=True)  # a line longer than the console stays one line (greppable when redirected)


def _accuracy(model_or_path, tokenizer, test, plan: DemoPlan) -> float:
    from posttrain.eval import generation_accuracy
    from posttrain.models.loading import load_causal_lm
    from posttrain.tasks.builtin import TASK_CHECKERS

    model = load_causal_lm(model_or_path)
    return generation_accuracy(model, tokenizer, test, max_new_tokens=plan.max_new_tokens,
                               checker=TASK_CHECKERS.get(plan.task))


def _common_args(plan: DemoPlan, name: str, steps: int | None = None, **extra):
    steps = steps or plan.steps[name]
    args = dict(output_dir=str(Path(plan.output_dir) / name), max_steps=steps, learning_rate=plan.learning_rates[name],
                logging_steps=max(1, steps // 10), seed=plan.seed, save_strategy="no", report_to="none",
                lr_scheduler_type="constant", disable_tqdm=False)
    return {**args, **extra}


def _train(trainer, plan: DemoPlan):
    """trainer.train(), its console output as the plan asks: compact (transformers' progress bar without the
    metrics it prints at each logging step, on a terminal only) unless verbose. The metrics go to the
    stage's log_history.json either way."""
    import sys

    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    if not plan.verbose:
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        if sys.stdout.isatty():
            trainer.add_callback(type("BarOnly", (ProgressCallback,), {"on_log": lambda self, *a, **k: None})())
    return trainer.train()


def _quiet_libraries():
    """Compact output: no per-file progress bars or load reports from transformers and datasets."""
    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def _corrupt(answer: str, rng: random.Random) -> str:
    """A wrong answer of the same length: a digit changed, or two digits swapped."""
    digits = list(answer)
    while "".join(digits) == answer:
        i = rng.randrange(len(digits))
        if rng.random() < 0.5 and len(digits) > 1:
            j = rng.randrange(len(digits))
            digits[i], digits[j] = digits[j], digits[i]
        else:
            digits[i] = rng.choice("0123456789")
    return "".join(digits)


def _finish(trainer, plan: DemoPlan, name: str) -> str:
    path = str(Path(plan.output_dir) / name)
    trainer.save_model(path)
    trainer.processing_class.save_pretrained(path)
    with open(Path(path) / "log_history.json", "w") as f:
        json.dump(trainer.state.log_history, f)
    return path


# ---------------------------------------------------------------- stages

def run_sft(plan, tokenizer, train, test, base_acc):
    from posttrain import SFTConfig, SFTTrainer

    trainer = SFTTrainer(model=plan.model, processing_class=tokenizer, train_dataset=train,
                         args=SFTConfig(**_common_args(plan, "sft", per_device_train_batch_size=32, max_length=64,
                                                       lr_scheduler_type="constant_with_warmup", warmup_steps=10)))
    _train(trainer, plan)
    path = _finish(trainer, plan, "sft")
    metric = ("held-out accuracy", base_acc, _accuracy(trainer.model, tokenizer, test, plan))
    (Path(path) / SFT_RECORD).write_text(json.dumps({"made_by": _sft_recipe(plan), "metric": metric}))
    return path, metric


def _sft_recipe(plan: DemoPlan) -> dict:
    """What decides the SFT checkpoint: a checkpoint made with the same recipe can be reused."""
    return {"model": plan.model, "task": plan.task, "conversational": plan.conversational, "seed": plan.seed,
            "steps": plan.steps["sft"], "learning_rate": plan.learning_rates["sft"]}


def reusable_sft(plan: DemoPlan) -> tuple[str, tuple] | None:
    """(path, metric) of an earlier run's SFT checkpoint in the output directory made with this plan's
    recipe, or None."""
    folder = Path(plan.output_dir) / "sft"
    try:
        record = json.loads((folder / SFT_RECORD).read_text())
    except (OSError, ValueError):
        return None
    if record.get("made_by") != _sft_recipe(plan) or not (folder / "model.safetensors").exists():
        return None
    return str(folder), tuple(record["metric"])


def _answer_pairs(dataset, seed):
    rng = random.Random(seed)
    rows = []
    for r in dataset:
        wrong = _corrupt(r["answer"], rng)
        rows.append({"prompt": r["prompt"], "chosen": " " + r["answer"], "rejected": " " + wrong})
    from datasets import Dataset

    return Dataset.from_list(rows)


def run_reward(plan, tokenizer, train, test, start):
    from posttrain import RewardConfig, RewardTrainer

    pairs, held_out = _answer_pairs(train, plan.seed), _answer_pairs(test, plan.seed + 1)
    trainer = RewardTrainer(model=start, processing_class=tokenizer, train_dataset=pairs, eval_dataset=held_out,
                            args=RewardConfig(**_common_args(plan, "reward",
                                                             per_device_train_batch_size=32, max_length=64,
                                                             per_device_eval_batch_size=100)))
    before = trainer.evaluate()["eval_accuracy"]  # chosen scored above rejected, held-out pairs
    _train(trainer, plan)
    path = _finish(trainer, plan, "reward")
    return path, ("pairwise accuracy", before, trainer.evaluate()["eval_accuracy"])


def _online(plan, name, tokenizer, train, test, start, sft_acc):
    import posttrain
    from posttrain.tasks.builtin import digit_match_reward, final_answer_reward

    config_cls = getattr(posttrain, {"grpo": "GRPOConfig", "rloo": "RLOOConfig", "ppo": "PPOConfig",
                                     "reinforce_pp": "ReinforcePPConfig", "online_dpo": "OnlineDPOConfig",
                                     "xpo": "XPOConfig", "nash_md": "NashMDConfig", "gmpo": "GMPOConfig",
                                     "gspo_token": "GSPOTokenConfig",
                                     "grpo_with_replay_buffer": "GRPOWithReplayBufferConfig",
                                     "a2po": "A2POConfig"}[name])
    trainer_cls = getattr(posttrain, config_cls.__name__.replace("Config", "Trainer"))
    reward = final_answer_reward if plan.task == "quick-add" else digit_match_reward
    prompts = train.remove_columns("completion")
    extra = dict(per_device_train_batch_size=plan.rl_batch_size,
                 num_generations=2 if name in PAIRED else 1 if name == "a2po" else plan.num_generations,
                 max_completion_length=plan.max_new_tokens, temperature=plan.temperature, log_completions=True,
                 num_completions_to_print=4 if plan.verbose else 0)  # completions.jsonl holds them all
    passes = getattr(config_cls, "num_ppo_epochs", 1)  # RLOO and PPO: optimizer steps per rollout (default 4)
    plan.step_units[name] = (passes, "rollout")
    trainer = trainer_cls(model=start, reward_funcs=reward, processing_class=tokenizer, train_dataset=prompts,
                          args=config_cls(**_common_args(plan, name, plan.steps[name] * passes, **extra)))
    _train(trainer, plan)
    path = _finish(trainer, plan, name)
    return path, ("held-out accuracy", sft_acc, _accuracy(trainer.model, tokenizer, test, plan))


def _self_play_pairs(plan, tokenizer, train, start, k: int = 4, limit: int = 512):
    """Preference pairs from the SFT model's own samples: a correct one chosen, an incorrect one rejected.

    When no sample is correct the reference answer is the chosen completion.
    """
    import torch
    from datasets import Dataset

    from posttrain.data.tokenize import encode_prompt
    from posttrain.models.loading import load_causal_lm
    from posttrain.rollout.generate import SamplingConfig, generate
    from posttrain.tasks.builtin import check

    model = load_causal_lm(start).eval()
    rows = train.select(range(min(limit, len(train))))
    sampling = SamplingConfig(max_new_tokens=plan.max_new_tokens, temperature=1.0, num_generations=k)
    gen = torch.Generator().manual_seed(plan.seed)
    pairs = []
    for lo in range(0, len(rows), 64):
        batch = rows[lo:lo + 64]
        prompt_ids = [encode_prompt(tokenizer, p) for p in batch["prompt"]]
        out = generate(model, prompt_ids, sampling, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, generator=gen)
        texts = tokenizer.batch_decode(out.completion_ids * out.completion_mask, skip_special_tokens=True)
        for i, (prompt, answer) in enumerate(zip(batch["prompt"], batch["answer"])):
            samples = texts[i * k:(i + 1) * k]
            good = [s for s in samples if check(s, answer)]
            bad = [s for s in samples if not check(s, answer) and s.strip()]
            if bad:
                chosen = good[0] if good else " " + answer
                pairs.append({"prompt": prompt, "chosen": chosen, "rejected": bad[0]})
    return Dataset.from_list(pairs)


def _preference(plan, name, tokenizer, pairs, test, start, sft_acc):
    import posttrain

    config_cls = getattr(posttrain, f"{name.upper()}Config")
    trainer_cls = getattr(posttrain, f"{name.upper()}Trainer")
    args = config_cls(**_common_args(plan, name,
                                     per_device_train_batch_size=16, max_length=64))
    data = pairs
    if name in ("bco", "kto"):
        from posttrain.data.formats import preference_to_unpaired

        data = preference_to_unpaired(pairs)
    trainer = trainer_cls(model=start, processing_class=tokenizer, train_dataset=data, args=args)
    _train(trainer, plan)
    path = _finish(trainer, plan, name)
    return path, ("held-out accuracy", sft_acc, _accuracy(trainer.model, tokenizer, test, plan))


# ---------------------------------------------------------------- tools: a calculator and a multi-turn game

# Both measured on tiny-qwen2 (numbers in README.md), GRPO sampling at temperature 1 with no KL term.
# Calculator: A * B with A, B in 32..99, held-out pairs never trained on. The tiny model learns to copy
# digits in a few hundred SFT steps on the short traces without the tool listing, then in a few steps on
# the full ones; GRPO with calculator_reward (exact product) then makes the copies surer.
CALCULATOR = dict(short_sft_steps=220, short_sft_lr=3e-3, sft_steps=10, sft_lr=1e-3, rl_steps=20, rl_lr=3e-4,
                  temperature=1.0, eval_size=100)
# Guess-the-number on 1..4 (binary search needs at most 3 guesses; 6 are allowed): SFT on binary-search
# traces teaches the call format and the search half-way; GRPO with the environment's get_reward (1 when
# found within 3 guesses, less for more) as its only reward, length-cut episodes left out of the loss.
GUESS_NUMBER = dict(high=4, sft_steps=60, sft_lr=5e-3, rl_steps=30, rl_lr=5e-4, temperature=1.0, eval_size=50)


def _tools_common(plan: DemoPlan) -> dict:
    return dict(seed=plan.seed, save_strategy="no", report_to="none", lr_scheduler_type="constant",
                disable_tqdm=False)


def _episode(trainer, row) -> list[dict]:
    """One sampled episode of `row` (prompt messages, then the assistant turns and tool results)."""
    import dataclasses

    batch = trainer._collate([row])
    sampling = dataclasses.replace(trainer.sampling, num_generations=1)
    rollout, episodes = trainer.roll_out(batch, batch["prompt"], dict(batch["columns"]), sampling, mode="eval")
    return batch["prompt"][0] + episodes.completions(rollout)[0]


def run_calculator(plan: DemoPlan) -> tuple[tuple, float, list[dict]]:
    """SFT on calculator traces (short ones without the tool listing, then full ones), then GRPO with
    `CalculatorEnv`; returns ("held-out accuracy", before, after GRPO) over 2 sampled episodes per held-out
    row, the SFT model's accuracy on the same rows with the tool results withheld, and a held-out episode."""
    import functools

    from posttrain import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
    from posttrain.tasks.environments import CalculatorEnv, calculator_dataset, calculator_reward, calculator_traces

    cfg, out, common = CALCULATOR, Path(plan.output_dir), _tools_common(plan)
    model = plan.model
    for name, steps, lr, batch, data in (
            ("calculator_sft_short", cfg["short_sft_steps"], cfg["short_sft_lr"], 32,
             calculator_traces(list_tools=False)),
            ("calculator_sft", cfg["sft_steps"], cfg["sft_lr"], 16, calculator_traces())):
        schedule = dict(lr_scheduler_type="constant_with_warmup", warmup_steps=10) if steps > 10 else {}
        sft = SFTTrainer(model=model, train_dataset=data,
                         args=SFTConfig(output_dir=str(out / name), max_steps=steps, learning_rate=lr,
                                        per_device_train_batch_size=batch, assistant_only_loss=True,
                                        logging_steps=max(1, steps // 10), **{**common, **schedule}))
        _train(sft, plan)
        model = sft.model
    steps = cfg["rl_steps"]
    args = GRPOConfig(output_dir=str(out / "calculator"), max_steps=steps, learning_rate=cfg["rl_lr"],
                      per_device_train_batch_size=32, num_generations=8, max_completion_length=96, beta=0.0,
                      temperature=cfg["temperature"], max_tool_calling_iterations=2, num_generations_eval=2,
                      per_device_eval_batch_size=cfg["eval_size"], logging_steps=max(1, steps // 10), **common)
    test = calculator_dataset("test", cfg["eval_size"])

    def trainer(factory):
        return GRPOTrainer(model=model, processing_class=sft.processing_class, args=args,
                           reward_funcs=calculator_reward, train_dataset=calculator_dataset("train"),
                           environment_factory=factory)

    without_tool = trainer(functools.partial(CalculatorEnv, show_results=False)).evaluate(test)["eval_reward"]
    rl = trainer(CalculatorEnv)
    before = rl.evaluate(test)["eval_reward"]
    _train(rl, plan)
    after = rl.evaluate(test)["eval_reward"]
    _finish(rl, plan, "calculator")
    return ("held-out accuracy", before, after), without_tool, _episode(rl, test[0])


def run_guess_number(plan: DemoPlan) -> tuple[tuple, list[dict]]:
    """SFT on guess-the-number traces, then GRPO with `GuessNumberEnv` as the environment; returns the
    ("held-out reward", before, after) metric (before and after GRPO, the mean `get_reward` of 4 sampled
    episodes per held-out row) and one held-out episode as messages."""
    from posttrain import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
    from posttrain.tasks.environments import GuessNumberEnv, guess_number_dataset, guess_number_traces

    cfg, out, common = GUESS_NUMBER, Path(plan.output_dir), _tools_common(plan)
    high = cfg["high"]
    sft = SFTTrainer(model=plan.model, train_dataset=guess_number_traces("train", 200, high=high),
                     args=SFTConfig(output_dir=str(out / "guess_number_sft"), max_steps=cfg["sft_steps"],
                                    learning_rate=cfg["sft_lr"], per_device_train_batch_size=8,
                                    assistant_only_loss=True, logging_steps=10, **common))
    _train(sft, plan)
    steps = cfg["rl_steps"]
    args = GRPOConfig(output_dir=str(out / "guess_number"), max_steps=steps, learning_rate=cfg["rl_lr"],
                      per_device_train_batch_size=32, num_generations=8, max_completion_length=160, beta=0.0,
                      temperature=cfg["temperature"], max_tool_calling_iterations=4, num_generations_eval=4,
                      mask_truncated_completions=True, per_device_eval_batch_size=cfg["eval_size"],
                      logging_steps=max(1, steps // 10), **common)
    test = guess_number_dataset("test", cfg["eval_size"], high=high)
    trainer = GRPOTrainer(model=sft.model, processing_class=sft.processing_class, args=args,
                          train_dataset=guess_number_dataset("train", 200, high=high),
                          environment_factory=GuessNumberEnv)
    before = trainer.evaluate(test)["eval_reward"]
    _train(trainer, plan)
    after = trainer.evaluate(test)["eval_reward"]
    _finish(trainer, plan, "guess_number")
    return ("held-out reward", before, after), _episode(trainer, test[0])


DISTILLERS = ("distillation", "gkd", "minillm", "iw_opd", "sft on teacher samples")
# IW-OPD's signal is the sampled tokens' weighted log-ratio (a policy gradient on one token per position), noisier
# than the others' divergence over the vocabulary: from the SFT checkpoint (0.27) with the GRPO teacher (0.98),
# lr 2e-3 x 25 steps fell to 0.23; 1e-3 x 25 reached 0.38, 3e-4 x 50 0.47, 1e-3 x 50 0.70: its row gets its own
# learning rate and twice the stage's steps (about as long as the MiniLLM row: its steps are cheaper)
DISTILL_SETTINGS = {"iw_opd": {"learning_rate": 1e-3, "steps_factor": 2}}


def _teacher_samples(plan, tokenizer, prompts, teacher, rows: int):
    """`rows` prompt-completion rows: the teacher's samples (training temperature) of the first prompts, cycled."""
    import torch
    from datasets import Dataset

    from posttrain.data.tokenize import encode_prompt
    from posttrain.models.loading import load_causal_lm
    from posttrain.rollout.generate import SamplingConfig, generate

    model = load_causal_lm(teacher)
    texts = [prompts[i % len(prompts)] for i in range(rows)]
    out = generate(model, [encode_prompt(tokenizer, p) for p in texts],
                   SamplingConfig(max_new_tokens=plan.max_new_tokens, temperature=plan.temperature),
                   pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   generator=torch.Generator().manual_seed(plan.seed))
    lengths = out.completion_mask.sum(1).tolist()
    completions = tokenizer.batch_decode([ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)],
                                         skip_special_tokens=True)
    return Dataset.from_list([{"prompt": p, "completion": c} for p, c in zip(texts, completions)]), sum(lengths)


def run_distill(plan, name, tokenizer, train, test, start, start_acc, teacher):
    """One distillation trainer from the SFT checkpoint `start` with the online policy `teacher`; or, for "sft on
    teacher samples", SFT on the teacher's samples of as many completion tokens as the distillation run saw."""
    import posttrain

    own = dict(DISTILL_SETTINGS.get(name, {}))
    steps, batch = plan.steps["distill"] * own.pop("steps_factor", 1), plan.distill_batch_size
    common = _common_args(plan, "distill", steps, output_dir=str(Path(plan.output_dir) / name.replace(" ", "_")),
                          per_device_train_batch_size=batch, **own)
    if name == "sft on teacher samples":
        tokens = plan.distill_tokens or steps * batch * plan.max_new_tokens
        data, got = _teacher_samples(plan, tokenizer, train["prompt"], teacher, steps * batch)
        rows = max(batch, min(len(data), round(tokens / max(got / len(data), 1))))  # as many completion tokens
        trainer = posttrain.SFTTrainer(model=start, processing_class=tokenizer, train_dataset=data.select(range(rows)),
                                       args=posttrain.SFTConfig(**{**common, "max_steps": -1, "num_train_epochs": 1,
                                                                   "max_length": 64}))
    elif name == "minillm":
        trainer = posttrain.MiniLLMTrainer(
            model=start, teacher_model=teacher, processing_class=tokenizer,
            train_dataset=train.remove_columns("completion"),
            # one sample per prompt, as the other distillers: no reward function, so no group baseline is needed
            args=posttrain.MiniLLMConfig(**common, num_generations=1, max_completion_length=plan.max_new_tokens))
    else:
        config_cls, trainer_cls = {"distillation": (posttrain.DistillationConfig, posttrain.DistillationTrainer),
                                   "gkd": (posttrain.GKDConfig, posttrain.GKDTrainer),
                                   "iw_opd": (posttrain.IWOPDConfig, posttrain.IWOPDTrainer)}[name]
        support = {} if name == "iw_opd" else {"loss_top_k": 0}  # IW-OPD reads the sampled tokens only
        trainer = trainer_cls(model=start, teacher_model=teacher, processing_class=tokenizer, train_dataset=train,
                              args=config_cls(**common, **support, max_completion_length=plan.max_new_tokens))
    _train(trainer, plan)
    if name == "distillation":  # the completion tokens it trained on: the SFT baseline gets as many
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
        plan.distill_tokens = int(sum(lengths) / max(len(lengths), 1) * steps * batch)
    _finish(trainer, plan, name.replace(" ", "_"))
    return "held-out accuracy", start_acc, _accuracy(trainer.model, tokenizer, test, plan)


def _distill_stage(plan, console, record, tokenizer, train, test, start, start_acc, policies: dict):
    """Each distiller from the SFT checkpoint `start`, the teacher the best online policy (GRPO trained first
    when no online stage ran); `record(stage, started, metric)` adds each row."""
    from transformers import set_seed

    if not policies:
        console.rule("GRPO (the teacher)")
        set_seed(plan.seed)
        started = time.time()
        path, metric = _online(plan, "grpo", tokenizer, train, test, start, start_acc)
        policies["grpo"] = (path, metric[2])
        record("grpo", started, metric)
    teacher, teacher_acc = max(policies.values(), key=lambda p: p[1])
    for name in DISTILLERS:
        console.rule(f"{name} from the best online policy (held-out accuracy {teacher_acc:.2f})")
        set_seed(plan.seed)
        started = time.time()
        metric = run_distill(plan, name, tokenizer, train, test, start, start_acc, teacher)
        record(name, started, metric)


def _show_episode(console, messages):
    for m in messages:
        calls = [f"{c['function']['name']}({json.dumps(c['function']['arguments'])})"
                 for c in m.get("tool_calls") or []]
        console.print(f"  [dim]{m['role']}:[/] {' '.join([m.get('content') or '', *calls]).strip()}")


# ---------------------------------------------------------------- driver

def run(plan: DemoPlan) -> list[dict]:
    from posttrain.models.loading import load_tokenizer
    from posttrain.tasks.builtin import task_dataset

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not plan.verbose:
        _quiet_libraries()
    console = _console()
    Path(plan.output_dir).mkdir(parents=True, exist_ok=True)
    if set(plan.stages) <= {"vision", "tools"}:  # stages with models and tasks of their own: no text task to score
        if plan.stages == ("vision",):  # the report's title names what was trained
            plan.model, plan.task = "posttrain/tiny-llava", "the visual task"
        _opt_in_stages(plan, console)
        report(plan, console)
        return plan.results
    with console.status("building the model, tokenizer and task data"):
        tokenizer = load_tokenizer(None, model=plan.model)
        train = task_dataset(plan.task, "train", conversational=plan.conversational)
        test = task_dataset(plan.task, "test", conversational=plan.conversational)
        test = test.select(range(min(plan.eval_size, len(test))))
        t0 = time.time()
        base_acc = _accuracy(plan.model, tokenizer, test, plan)
    plan.results.append(dict(stage="base", metric="held-out accuracy", before=None, after=base_acc,
                             seconds=time.time() - t0))
    console.print(f"[bold]{plan.model}[/] on task [bold]{plan.task}[/]: base held-out accuracy {base_acc:.2f}")
    data = (tokenizer, train, test)
    start, start_acc = _sft_stage(plan, console, data, base_acc)
    _later_stages(plan, console, data, start, start_acc)
    _opt_in_stages(plan, console)
    report(plan, console)
    return plan.results


def _opt_in_stages(plan: DemoPlan, console):
    """The stages with their own models and data: tools (two tool environments), vision (the tiny VLM)."""
    if "tools" in plan.stages:
        _tools_stages(plan, console)
    if "vision" in plan.stages:
        from posttrain.demo_vision import run_vision_stages

        console.rule("vision: the tiny VLM on the visual task (SFT, then each row from the SFT checkpoint)")
        run_vision_stages(plan, lambda *row: _record(plan, console, *row))


def _record(plan: DemoPlan, console, stage: str, started: float, metric: tuple):
    name, before, after = metric
    seconds = time.time() - started
    plan.results.append(dict(stage=stage, metric=name, before=before, after=after, seconds=seconds))
    console.print(f"[bold]{stage}[/]: {name} {before:.2f} -> {after:.2f} ({seconds:.0f} s)")


def _rule(plan: DemoPlan, console, title: str):
    if plan.verbose:
        console.rule(title)


def _sft_stage(plan: DemoPlan, console, data, base_acc) -> tuple[str, float]:
    """(checkpoint, held-out accuracy) the later stages start from: this run's SFT stage; an earlier run's
    SFT checkpoint (same recipe) when --stages leaves SFT out but a later stage needs it; else SFT now."""
    from transformers import set_seed

    needing = [s for s in NEEDS_SFT if s in plan.stages] if plan.sft_first else []
    if "sft" not in plan.stages and not needing:
        return plan.model, base_acc
    if "sft" not in plan.stages:
        if (earlier := reusable_sft(plan)) is not None:
            path, metric = earlier
            console.print(f"{', '.join(needing)} start from the SFT checkpoint: reusing {path}/ from an earlier "
                          f"run (same model, task, seed and SFT steps; held-out accuracy {metric[2]:.2f})")
            plan.results.append(dict(stage="sft (reused)", metric=metric[0], before=metric[1], after=metric[2],
                                     seconds=0.0))
            return path, metric[2]
        console.print(f"{', '.join(needing)} start from the SFT checkpoint: running SFT first "
                      f"({plan.steps['sft']} steps)")
    _rule(plan, console, "SFT")
    set_seed(plan.seed)
    started = time.time()
    start, metric = run_sft(plan, *data, base_acc)
    _record(plan, console, "sft", started, metric)
    return start, metric[2]


def _later_stages(plan: DemoPlan, console, data, start: str, start_acc: float):
    """The reward model, the online stages and the preference stages, each from `start`."""
    from transformers import set_seed

    tokenizer, train, test = data
    stages = [s for s in STAGES if s in plan.stages]
    if "reward" in stages:
        _rule(plan, console, "reward model")
        set_seed(plan.seed)
        started = time.time()
        _, metric = run_reward(plan, tokenizer, train, test, start)
        _record(plan, console, "reward", started, metric)
    policies = {}  # online stage -> (its trained policy's path, held-out accuracy): the distill stage's teachers
    for name in (s for s in ONLINE if s in plan.stages):
        _rule(plan, console, name.upper())
        set_seed(plan.seed)
        started = time.time()
        path, metric = _online(plan, name, tokenizer, train, test, start, start_acc)
        policies[name] = (path, metric[2])
        _record(plan, console, name, started, metric)
    preference = [s for s in PREFERENCE if s in stages]
    if preference:
        _rule(plan, console, "preference pairs from the SFT model's own samples")
        set_seed(plan.seed)
        pairs = _self_play_pairs(plan, tokenizer, train, start)
        console.print(f"{len(pairs)} preference pairs from {start}'s own samples (correct chosen, incorrect rejected)")
        for name in preference:
            _rule(plan, console, name.upper())
            set_seed(plan.seed)
            started = time.time()
            _, metric = _preference(plan, name, tokenizer, pairs, test, start, start_acc)
            _record(plan, console, name, started, metric)
    if "distill" in stages:
        _distill_stage(plan, console, lambda *row: _record(plan, console, *row), tokenizer, train, test, start,
                       start_acc, policies)


def _tools_stages(plan: DemoPlan, console):
    from transformers import set_seed

    console.rule("tools: calculator (SFT on traces, then GRPO with CalculatorEnv)")
    set_seed(plan.seed)
    started = time.time()
    metric, without_tool, episode = run_calculator(plan)
    _record(plan, console, "calculator", started, metric)
    # the SFT model's score without the tool's help (its time is in the calculator row's)
    plan.results.append(dict(stage="calculator, results withheld", metric="held-out accuracy", before=None,
                             after=without_tool, seconds=0.0))
    console.print(f"the SFT model with the tool results withheld: held-out accuracy {without_tool:.2f}")
    console.print("a held-out episode after GRPO:")
    _show_episode(console, episode)
    console.rule("tools: guess the number (SFT on traces, then GRPO with GuessNumberEnv)")
    set_seed(plan.seed)
    started = time.time()
    metric, episode = run_guess_number(plan)
    _record(plan, console, "guess_number", started, metric)
    console.print("a held-out episode after GRPO:")
    _show_episode(console, episode)


def report(plan: DemoPlan, console=None):
    from rich.table import Table

    console = console or _console()
    table = Table(title=f"posttrain demo: {plan.model} on {plan.task}")
    for col in ("stage", "metric", "before -> after", "wall time"):
        table.add_column(col)
    lines = ["| stage | metric | before -> after | wall time |", "|---|---|---|---|"]
    for r in plan.results:
        change = f"{r['after']:.2f}" if r["before"] is None else f"{r['before']:.2f} -> {r['after']:.2f}"
        table.add_row(r["stage"], r["metric"], change, f"{r['seconds']:.0f} s")
        lines.append(f"| {r['stage']} | {r['metric']} | {change} | {r['seconds']:.0f} s |")
    console.print(table)
    out = Path(plan.output_dir)
    (out / "report.md").write_text(f"# posttrain demo: {plan.model} on {plan.task}\n\n" + "\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(plan.results, indent=1))
    _plot(plan, out)
    models = [_folder(r["stage"]) for r in plan.results if (out / _folder(r["stage"]) / "config.json").exists()]
    console.print(f"saved in {out}/: report.md, results.json, curves.png"
                  + (f"; the trained models (from_pretrained-loadable) in {', '.join(m + '/' for m in models)}"
                     if models else ""), highlight=False)


def _folder(stage: str) -> str:
    """The output folder of a table row's stage ("sft (reused)": sft/)."""
    return stage.split(" (")[0].replace(" ", "_")  # "vision sft": vision_sft/


def _plot(plan: DemoPlan, out: Path):
    """curves.png: one panel per stage that logged a reward / accuracy / loss curve, on a grid of at most three
    columns. The x axis says what a step is: online stages count rollouts (RLOO and PPO take several
    optimizer steps per rollout), the others optimizer steps."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    curves = {}
    for r in plan.results:
        log = out / _folder(r["stage"]) / "log_history.json"
        if not log.exists():
            continue
        history = json.loads(log.read_text())
        key = next((k for k in ("reward", "rewards/accuracies", "accuracy", "mean_token_accuracy", "loss")
                    if any(k in h for h in history)), None)
        if key is not None:
            per, unit = plan.step_units.get(r["stage"], (1, "optimizer step"))
            curves[r["stage"]] = (key, unit, [(h["step"] / per, h[key]) for h in history if key in h])
    if not curves:
        return
    cols = min(3, len(curves))
    rows = -(-len(curves) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (stage, (key, unit, points)) in zip(axes.flat, curves.items()):
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".")
        ax.set_title(f"{stage}: {key}", fontsize=10)
        ax.set_xlabel(unit)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(curves):]:
        ax.set_visible(False)
    fig.suptitle(f"posttrain demo: {plan.model} on {plan.task}", fontsize=11)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="posttrain demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="tiny-qwen2 (default), tiny-llama, small-qwen2, smollm2, or a model path")
    parser.add_argument("--stages", default=None, help=f"comma-separated subset of {','.join(STAGES)} (all by "
                        f"default), or the opt-in {','.join(OPT_IN_STAGES)} (tools: a multi-turn tool environment)")
    parser.add_argument("--output_dir", default=None,
                        help="where the models and report go (default: demo_output/, demo_output_<model>/ for "
                             "another --model)")
    parser.add_argument("--seed", type=int, default=None)
    for group in ("sft", "reward", "rl", "pref", "distill"):
        parser.add_argument(f"--{group}_steps", type=int, default=None,
                            help={"rl": "rollouts per online stage", "pref": "steps per DPO/ORPO/CPO/BCO/KTO stage",
                                  "distill": "steps per distillation trainer"}.get(group))
    parser.add_argument("--eval_size", type=int, default=None, help="held-out prompts evaluated")
    parser.add_argument("--verbose", action="store_true",
                        help="print the trainers' logs and sample completions too (they always go to each "
                             "stage's folder: log_history.json, completions.jsonl)")
    args = parser.parse_args(argv)
    plan = plan_for(args.model)
    plan.verbose = args.verbose
    if args.stages:
        wanted = tuple(s.strip() for s in args.stages.split(",") if s.strip())
        unknown = [s for s in wanted if s not in STAGES + OPT_IN_STAGES]
        if unknown:
            parser.error(f"unknown stage(s) {unknown}; choose from {','.join(STAGES + OPT_IN_STAGES)}")
        plan.stages = wanted
    for name in ("output_dir", "seed", "eval_size"):
        if getattr(args, name) is not None:
            setattr(plan, name, getattr(args, name))
    for group in ("sft", "reward", "rl", "pref", "distill"):
        if getattr(args, f"{group}_steps") is not None:
            plan.set_steps(group, getattr(args, f"{group}_steps"))
    run(plan)


if __name__ == "__main__":
    main()
