"""Training callbacks and sample logs.

Each part stands alone in its own section: the completions table of the online trainers, the
reference-model sync, the training-curve plot, the win-rate evaluation, and TRL's other public
callbacks with TRL's names and arguments, for any Trainer:

* `LogCompletionsCallback`: every `freq` steps, greedy completions of the eval prompts, written as
  the completions table (console, `<output_dir>/logged_completions.jsonl`, and a `completions`
  table in wandb / trackio when they are among `report_to`).
* `RichProgressCallback`: training and evaluation progress bars and metric lines drawn with rich.
* `BEMACallback`: bias-corrected EMA of the weights (Block & Zhang 2025, "EMA Without the Lag",
  arXiv 2508.00180), saved to `<output_dir>/bema` at the end of training.
* `MergeModelCallback` + `MergeConfig`: the trained model merged with another (by default the one
  training started from), saved to `<output_dir>/checkpoint-<step>/merged`.
* `WeaveCallback`: eval-prompt completions and scorer results logged to a W&B Weave evaluation;
  needs the `weave` package.

The modules they call (`plotting`, `judges`, `eval`, `core.running`, `models.loading`) are imported
when a callback runs, so importing this module stays light. Those modules never import this one
(their old names `plotting.PlotCallback` and `judges.WinRateCallback` come through `posttrain`'s
lazy public names).

Departures from TRL (also in docs/migrating.md):
* MergeModelCallback merges in torch itself (no mergekit): methods "linear" and "slerp"; TRL's "ties"
  and "dare_ties" (mergekit) are refused by MergeConfig. The policy side is the trained weights in
  memory at that step, so no checkpoint needs to exist on disk.
* BEMA's schedules count steps from `update_after` (the paper's t), where TRL counts from step 0; the
  two agree at TRL's default update_after=0. Parameters are matched by name, so frozen ones are skipped
  correctly.
* LogCompletionsCallback writes the completions table rather than a pandas table to wandb / Comet;
  Comet is not a posttrain tracker.
"""

from __future__ import annotations

import copy
import json
import math
import os
import warnings
from typing import TYPE_CHECKING, Any, Sequence

import torch
from transformers import TrainerCallback

if TYPE_CHECKING:
    from posttrain.judges import PairwiseJudge

# ---------------------------------------------------------------- completions table (online trainers)

COMPLETIONS_FILE = "completions.jsonl"


class CompletionsTable:
    """Sampled completions: a rich table of prompt | completion | one score column per reward on
    the console, and every row appended to `<output_dir>/completions.jsonl` as
    {"step", "prompt", "completion", "<reward name>": score, ...}.

    The online trainers call `write` on the main process at their sampling points
    (`num_sample_generations` evenly spaced steps, or every logging step with `log_completions`).
    With "wandb" or "trackio" among `report_to` (TrainingArguments' list), the rows also go to that
    tracker as a table named `completions`, as TRL logs them.
    """

    TRACKERS = ("wandb", "trackio")  # report_to targets that take tables: module.log({name: module.Table(...)})

    def __init__(self, output_dir: str | None, num_to_print: int | None = None, max_chars: int = 200,
                 report_to: str | Sequence[str] | None = None):
        self.path = os.path.join(output_dir, COMPLETIONS_FILE) if output_dir else None
        self.num_to_print, self.max_chars = num_to_print, max_chars
        targets = [report_to] if isinstance(report_to, str) else list(report_to or ())
        self.trackers = [t for t in self.TRACKERS if t in targets]
        # console headings: prompt and completion columns; score columns are the reward names, or with a
        # score_heading "score" (one reward) / "score (<name>)" (several), as the classic RLOO docs show them
        self.headings, self.score_heading = ("prompt", "completion"), None
        self._steps_on_file: set[int] = set()  # steps a resumed run finds already written: not written twice

    def start(self, resumed_step: int | None = None):
        """Begin a run, so that one file never mixes two runs.

        A fresh run (resumed_step None) moves an earlier run's file aside to `completions.<n>.jsonl`
        (the first free n). A run resumed from the checkpoint of step `resumed_step` keeps the rows up
        to that step and drops later ones, which the resumed run writes again; a sample of step k is
        taken during step k + 1, so rows of `resumed_step` itself may already be there (kept, not
        written twice) or not yet (written).
        """
        self._steps_on_file = set()
        if not self.path or not os.path.exists(self.path):
            return
        if resumed_step is None:
            stem, n = self.path[: -len(".jsonl")], 1
            while os.path.exists(f"{stem}.{n}.jsonl"):
                n += 1
            os.replace(self.path, f"{stem}.{n}.jsonl")
            return
        with open(self.path, encoding="utf-8") as f:
            kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= resumed_step]
        with open(self.path, "w", encoding="utf-8") as f:
            f.writelines(kept)
        self._steps_on_file = {json.loads(line).get("step", 0) for line in kept}

    def write(self, step: int, prompts: list, completions: list[str], scores: dict[str, list[float]],
              extra: dict[str, list] | None = None):
        """Append the rows to the file, print them and report them; `extra`: more columns, one value per row
        (what reward functions gave `log_extra`), in the file and the trackers' table."""
        extra = extra or {}
        rows = [{"step": step, "prompt": _text(p), "completion": c,
                 **{name: _number(values[i]) for name, values in scores.items()},
                 **{name: values[i] for name, values in extra.items()}}
                for i, (p, c) in enumerate(zip(prompts, completions))]
        if self.path and step not in self._steps_on_file:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        shown = rows if self.num_to_print is None else rows[: self.num_to_print]
        if shown:  # num_completions_to_print=0: the rows go to the file (and trackers) only
            self.print(step, shown, list(scores))
        self.report(rows, [*scores, *extra])
        return rows

    def report(self, rows: list[dict], names: list[str]):
        """Log the rows as a `completions` table to each tracker in report_to that has a run."""
        import importlib

        columns = ["step", "prompt", "completion", *names]
        for name in self.trackers:
            tracker = importlib.import_module(name)
            if name == "wandb" and tracker.run is None:  # no wandb.init (the run was set up elsewhere, or not)
                continue
            tracker.log({"completions": tracker.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])})

    def print(self, step: int, rows: list[dict], names: list[str]):
        scores = [name if self.score_heading is None else self.score_heading if len(names) == 1 else
                  f"{self.score_heading} ({name})" for name in names]
        cells = [[_clip(row["prompt"], self.max_chars), _clip(row["completion"], self.max_chars)]
                 + ["-" if row[n] is None else f"{row[n]:.3f}" for n in names] for row in rows]
        print_table(f"completions at step {step}", [*self.headings, *scores], cells, right=len(names))


def print_table(title: str, headings: list[str], rows: list[list[str]], right: int = 0) -> None:
    """A rich table of plain-text cells on the console (one line between rows; the last `right` columns
    right-justified, for numbers)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, show_lines=True)
    for i, heading in enumerate(headings):
        table.add_column(Text(heading), overflow="fold", justify="right" if i >= len(headings) - right else "left")
    for row in rows:
        # Text, not str: rich would read "[/INST]" or "[bold]" in user text as markup (and fail on a stray tag)
        table.add_row(*(Text(escape_controls(cell)) for cell in row))
    Console().print(table)


def escape_controls(text: str) -> str:
    """`text` with control characters other than newline and tab written as escapes (ESC -> '\\x1b'): sampled
    or user text printed to a terminal must not move the cursor, recolour, retitle or clear it."""
    import unicodedata

    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else repr(c)[1:-1] for c in text)


def _text(prompt) -> str:
    """A prompt as one string; chat prompts become 'role: content' lines."""
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt if isinstance(m, dict))
    return str(prompt)


def _number(value) -> float | None:
    value = float(value)
    return None if math.isnan(value) else value  # NaN = the reward function abstained


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------- reference-model sync (DPO family, online)

class SyncRefModelCallback(TrainerCallback):
    """Every `ref_model_sync_steps` optimizer steps: ref <- alpha * policy + (1 - alpha) * ref, alpha =
    `ref_model_mixup_alpha` (TR-DPO, Gorbatovski et al. 2024). TRL's signature: both numbers come from the
    training arguments (DPOConfig, the online configs), or from the keywords here for arguments that lack
    them (e.g. SFTConfig). `accelerator` unwraps the policy; DeepSpeed ZeRO-3 weights are gathered for the mix.
    """

    def __init__(self, ref_model, accelerator=None, *, ref_model_mixup_alpha: float | None = None,
                 ref_model_sync_steps: int | None = None):
        self.ref_model, self.accelerator = ref_model, accelerator
        self.alpha, self.every = ref_model_mixup_alpha, ref_model_sync_steps

    @staticmethod
    def sync_target_model(model, target_model, alpha: float) -> None:
        """target <- alpha * model + (1 - alpha) * target, parameter by parameter (TRL's static helper)."""
        import torch

        from posttrain.core.running import mix_into_

        with torch.no_grad():
            mix_into_(target_model, model, alpha)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        alpha = self.alpha if self.alpha is not None else getattr(args, "ref_model_mixup_alpha", None)
        every = self.every if self.every is not None else getattr(args, "ref_model_sync_steps", None)
        if alpha is None or every is None:
            raise ValueError(f"SyncRefModelCallback reads ref_model_mixup_alpha and ref_model_sync_steps from the "
                             f"training arguments, which {type(args).__name__} lacks; pass them to the callback")
        if model is None or state.global_step % every:
            return
        from posttrain.models.loading import zero3_partitioned

        if self.accelerator is not None:
            model = self.accelerator.unwrap_model(model)
        if not zero3_partitioned(self.ref_model):
            self.sync_target_model(model, self.ref_model, alpha)
            return
        import deepspeed  # ZeRO-3: mix the whole weights, then the reference is partitioned again

        with deepspeed.zero.GatheredParameters(list(self.ref_model.parameters()), modifier_rank=0), \
                deepspeed.zero.GatheredParameters(list(model.parameters())):
            self.sync_target_model(model, self.ref_model, alpha)


# ---------------------------------------------------------------- training curves (plotting.py draws them)

class PlotCallback(TrainerCallback):
    """At the end of training, draw the loss/reward curves to `<output_dir>/<filename>` (main process only).

    `keys=None` plots whichever of DEFAULT_PLOT_KEYS the run logged. A run that logged none of the
    keys gets a warning, not an error: plotting never fails a finished training run.
    """

    def __init__(self, keys: Sequence[str] | None = None, filename: str = "training_curves.png",
                 title: str | None = None, smoothing: float = 0.0):
        from posttrain.plotting import require_matplotlib

        require_matplotlib()  # fail now, not after hours of training
        self.keys, self.filename, self.title, self.smoothing = keys, filename, title, smoothing
        self.path: str | None = None
        self.plotted: list[str] = []

    def on_train_end(self, args, state, control, **kwargs: Any):
        if not state.is_world_process_zero:
            return
        from posttrain.plotting import plot_log_history

        path = os.path.join(args.output_dir, self.filename)
        try:
            self.plotted = plot_log_history(state.log_history, self.keys, path, self.title, self.smoothing)
        except ValueError as err:
            warnings.warn(f"PlotCallback: nothing plotted: {err}")
            return
        self.path = path


# ---------------------------------------------------------------- win rate at each evaluation (judges.py)

class WinRateCallback(TrainerCallback):
    """At each evaluation, greedy-generate completions for `eval_prompts` and log `eval_win_rate` against
    `reference_completions` (default: what the model generated for the same prompts when training began).

    The value goes into the evaluation's metrics dict (so `trainer.evaluate()` returns it) and into
    `trainer.state.log_history`: through `trainer.log` when the callback knows its trainer (pass
    `trainer=` or call `set_trainer`; then TensorBoard and other reporters see it too), else straight
    into the log history. A judge that fails on every item gives a warning, never a failed run.

    TRL-style calls work too: `WinRateCallback(judge, trainer, generation_config=None, num_prompts=None)`
    takes the prompts from the `prompt` column of `trainer.eval_dataset` (the first `num_prompts`).
    Generation runs on the main process only, with the unwrapped model, so it does not suit
    FSDP / ZeRO-3 sharded models.
    """

    def __init__(self, judge: PairwiseJudge, eval_prompts: Sequence[Any] | None = None,
                 reference_completions: Sequence[str] | None = None, max_new_tokens: int = 32, batch_size: int = 16,
                 generation_kwargs: dict | None = None, shuffle_order: bool = True, trainer=None,
                 generation_config=None, num_prompts: int | None = None):
        from transformers import Trainer

        if isinstance(eval_prompts, Trainer):  # TRL's positional order: (judge, trainer, ...)
            trainer, eval_prompts = eval_prompts, None
        if eval_prompts is None:
            dataset = getattr(trainer, "eval_dataset", None)
            if dataset is None or "prompt" not in getattr(dataset, "column_names", ()):
                raise ValueError("WinRateCallback needs eval_prompts=, or a trainer whose eval_dataset keeps a "
                                 "'prompt' column (posttrain trainers tokenise theirs: pass the prompts)")
            eval_prompts = dataset["prompt"]
        eval_prompts = list(eval_prompts)[:num_prompts]
        if reference_completions is not None and len(reference_completions) != len(eval_prompts):
            raise ValueError(f"WinRateCallback: {len(reference_completions)} reference completions for "
                             f"{len(eval_prompts)} eval prompts; pass one per prompt")
        self.judge, self.eval_prompts = judge, eval_prompts
        self.reference_completions = None if reference_completions is None else list(reference_completions)
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        self.generation_kwargs, self.shuffle_order = dict(generation_kwargs or {}), shuffle_order
        if generation_config is not None:
            self.generation_kwargs["generation_config"] = generation_config
            self.max_new_tokens = getattr(generation_config, "max_new_tokens", None) or max_new_tokens
        self.trainer = trainer

    def set_trainer(self, trainer) -> None:
        self.trainer = trainer

    def _generate(self, model, tokenizer) -> list[str]:
        from posttrain.eval import generate_completions

        if tokenizer is None:
            raise ValueError("WinRateCallback needs the trainer's tokenizer (processing_class) to generate")
        return generate_completions(model, tokenizer, self.eval_prompts, self.max_new_tokens, self.batch_size,
                                    **self.generation_kwargs)

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.reference_completions is None and state.is_world_process_zero:
            self.reference_completions = self._generate(model, processing_class or kwargs.get("tokenizer"))

    def on_evaluate(self, args, state, control, model=None, processing_class=None, metrics=None, **kwargs):
        if not state.is_world_process_zero:
            return
        from posttrain.judges import JudgeError, win_rate

        completions = self._generate(model, processing_class or kwargs.get("tokenizer"))
        if self.reference_completions is None:  # evaluate() before any training: the model is its own reference
            self.reference_completions = completions
        try:
            result = win_rate(self.judge, self.eval_prompts, completions, self.reference_completions,
                              self.shuffle_order)
        except JudgeError as err:
            warnings.warn(f"WinRateCallback: no win rate at step {state.global_step}: {err}")
            return
        value = result["win_rate"]
        if metrics is not None:
            metrics["eval_win_rate"] = value
        if self.trainer is not None:
            self.trainer.log({"eval_win_rate": value})
            return
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and any(k.startswith("eval_") for k in last):
            last["eval_win_rate"] = value  # the row this evaluation just logged
        else:
            state.log_history.append({"eval_win_rate": value, "step": state.global_step})


# ---------------------------------------------------------------- TRL's public callbacks (any Trainer)

def _eval_prompts(trainer, num_prompts: int | None, who: str) -> list:
    """The eval dataset's prompts: its "prompt" column, or, where the trainer has tokenised it (posttrain's
    preference trainers keep `prompt_ids` only), those ids decoded back to text."""
    dataset = getattr(trainer, "eval_dataset", None)
    if dataset is None:
        raise ValueError(f"Trainer must have an evaluation dataset to use the {who}.")
    columns = getattr(dataset, "column_names", None) or ()
    rows = range(len(dataset) if num_prompts is None else min(num_prompts, len(dataset)))
    if "prompt" in columns:
        return [dataset[i]["prompt"] for i in rows]
    ids = next((c for c in ("prompt_ids", "prompt_input_ids") if c in columns), None)
    if ids is None:
        raise ValueError(f"{who} reads the 'prompt' (or 'prompt_ids') column of trainer.eval_dataset, which has the "
                         f"columns {list(columns)}")
    return [trainer.processing_class.decode(dataset[i][ids]) for i in rows]


def _generate(trainer, prompts: list, generation_config, batch_size: int) -> list[str]:
    from posttrain.eval import generate_completions

    kwargs = {"generation_config": generation_config} if generation_config is not None else {}
    model = trainer.accelerator.unwrap_model(trainer.model)
    return generate_completions(model, trainer.processing_class, prompts, batch_size=batch_size, **kwargs)


class LogCompletionsCallback(TrainerCallback):
    """Every `freq` optimizer steps (default: `args.eval_steps`), greedy-generate completions for the first
    `num_prompts` prompts of `trainer.eval_dataset["prompt"]` (all by default) and log them as rows
    {"step", "prompt", "completion"}. Generation runs on the main process with the unwrapped model."""

    FILE = "logged_completions.jsonl"

    def __init__(self, trainer, generation_config=None, num_prompts: int | None = None, freq: int | None = None):
        self.trainer, self.generation_config, self.freq = trainer, generation_config, freq
        self.prompts = _eval_prompts(trainer, num_prompts, "LogCompletionsCallback")
        self._last_logged_step = -1
        self.table: CompletionsTable | None = None

    def on_step_end(self, args, state, control, **kwargs):
        freq = self.freq or args.eval_steps or state.eval_steps
        if state.global_step == self._last_logged_step or not freq or state.global_step % freq:
            return
        self._last_logged_step = state.global_step
        if not state.is_world_process_zero:
            return
        if self.table is None:
            self.table = CompletionsTable(args.output_dir, report_to=args.report_to)
            self.table.path = os.path.join(args.output_dir, self.FILE)  # apart from the online trainers' own table
        completions = _generate(self.trainer, self.prompts, self.generation_config, args.per_device_eval_batch_size)
        self.table.write(state.global_step, self.prompts, completions, {})


class RichProgressCallback(TrainerCallback):
    """Progress bars for training and evaluation drawn with rich, and each log printed as a line; use it in place
    of transformers' tqdm ProgressCallback (`trainer.remove_callback(ProgressCallback)`). `console`: a
    rich Console to draw on (default: a new one on stdout)."""

    def __init__(self, console=None):
        self.console = console
        self.progress = self.train_task = self.eval_task = None

    def on_train_begin(self, args, state, control, **kwargs):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        if not state.is_world_process_zero:
            return
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), console=self.console or Console(), transient=False)
        self.progress.start()
        self.train_task = self.progress.add_task("training", total=state.max_steps)

    def on_step_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.update(self.train_task, completed=state.global_step)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if self.progress is None:
            return
        if self.eval_task is None:
            total = len(eval_dataloader) if eval_dataloader is not None and hasattr(eval_dataloader, "__len__") else None
            self.eval_task = self.progress.add_task("evaluation", total=total)
        self.progress.advance(self.eval_task)

    def on_evaluate(self, args, state, control, **kwargs):
        if self.progress is not None and self.eval_task is not None:
            self.progress.remove_task(self.eval_task)
            self.eval_task = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.progress is not None and logs:
            line = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in logs.items())
            self.progress.console.print(f"step {state.global_step}: {line}", markup=False, highlight=False)

    def on_train_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class BEMACallback(TrainerCallback):
    """Bias-corrected EMA of the trainable weights (BEMA), saved to `<output_dir>/bema` when training ends.

    With t = step - update_after: EMA_t = (1 - beta_t) EMA_{t-1} + beta_t theta_t, beta_t = max((lag + multiplier
    t)^-ema_power, min_ema_multiplier), and BEMA_t = EMA_t + alpha_t (theta_t - theta_0), alpha_t = (lag +
    multiplier t)^-bias_power, theta_0 the weights at step `update_after`; updated every `update_freq` steps
    after it. ema_power=0 turns the EMA off (BEMA = theta_t + ...), bias_power=0 the correction. The buffers and
    the averaged copy of the model live on `device`.
    """

    def __init__(self, update_freq: int = 400, ema_power: float = 0.5, bias_power: float = 0.2, lag: int = 10,
                 update_after: int = 0, multiplier: float = 1.0, min_ema_multiplier: float = 0.0, device: str = "cpu"):
        if update_freq < 1:
            raise ValueError(f"update_freq must be >= 1, got {update_freq}")
        self.update_freq, self.ema_power, self.bias_power, self.lag = update_freq, ema_power, bias_power, lag
        self.update_after, self.multiplier, self.min_ema_multiplier = update_after, multiplier, min_ema_multiplier
        self.device = device
        self.params: dict[str, torch.nn.Parameter] = {}  # the training model's trainable parameters, by name
        self.theta0: dict[str, torch.Tensor] = {}
        self.ema: dict[str, torch.Tensor] = {}
        self.running_model = None  # the averaged copy that is saved

    @staticmethod
    def _unwrap(model):
        while hasattr(model, "module"):  # DDP / DeepSpeed wrappers
            model = model.module
        return model

    @torch.no_grad()
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model = self._unwrap(model)
        self.running_model = copy.deepcopy(model).to(self.device)
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.theta0 = {n: p.detach().to(self.device, copy=True) for n, p in self.params.items()}
        self.ema = {n: t.clone() for n, t in self.theta0.items()}

    def _rate(self, t: int, power: float) -> float:
        return (self.lag + self.multiplier * t) ** (-power)

    @torch.no_grad()
    def on_step_end(self, args, state, control, **kwargs):
        t = state.global_step - self.update_after
        if t < 0:
            return
        if t == 0:  # the burn-in ends: restart from the current weights
            for name, param in self.params.items():
                self.theta0[name].copy_(param)
                self.ema[name].copy_(param)
            return
        if t % self.update_freq:
            return
        beta = max(self._rate(t, self.ema_power), self.min_ema_multiplier)
        alpha = self._rate(t, self.bias_power)
        running = dict(self.running_model.named_parameters())
        for name, param in self.params.items():
            theta = param.detach().to(self.device)
            self.ema[name].mul_(1 - beta).add_(theta, alpha=beta)
            running[name].copy_(self.ema[name] + alpha * (theta - self.theta0[name]))

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.running_model is not None:
            self.running_model.save_pretrained(os.path.join(args.output_dir, "bema"))


# ---------------------------------------------------------------- model merging

class MergeConfig:
    """How MergeModelCallback merges: `method` "linear" (policy_model_weight * policy + target_model_weight *
    target, divided by the weights' sum) or "slerp" (spherical interpolation from the policy, t_values=0, to the
    target, 1, per tensor). policy_model_path / target_model_path: the callback fills the policy; the target
    defaults to the model training started from. dtype: the merged weights' dtype."""

    METHODS = ("linear", "slerp")

    def __init__(self, method: str = "linear"):
        if method not in self.METHODS:
            raise ValueError(f"Unsupported merge method: {method!r}. posttrain merges with {self.METHODS}; TRL's "
                             f"'ties' and 'dare_ties' need mergekit, which posttrain does not use")
        self.method = method
        self.policy_model_path: str | None = None
        self.target_model_path: str | None = None
        self.policy_model_weight, self.target_model_weight = 0.5, 0.5
        self.t_values = 0.5
        self.dtype = "float16"

    def merge(self, policy: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One tensor of the merged model, in float32 (cast later)."""
        p, q = policy.float(), target.float()
        if self.method == "linear":
            w1, w2 = self.policy_model_weight, self.target_model_weight
            return (w1 * p + w2 * q) / (w1 + w2)
        return slerp(p, q, self.t_values)


def slerp(p: torch.Tensor, q: torch.Tensor, t: float, eps: float = 1e-8) -> torch.Tensor:
    """Spherical interpolation between two tensors seen as vectors: the angle between their directions is
    split t : (1 - t); nearly parallel (or zero) vectors are interpolated linearly."""
    a, b = p.flatten(), q.flatten()
    na, nb = a.norm(), b.norm()
    if na < eps or nb < eps:
        return torch.lerp(p, q, t)
    cos = torch.clamp((a / na) @ (b / nb), -1.0, 1.0)
    theta = torch.arccos(cos)
    if theta.abs() < 1e-4:
        return torch.lerp(p, q, t)
    s = torch.sin(theta)
    return (torch.sin((1 - t) * theta) / s) * p + (torch.sin(t * theta) / s) * q


class MergeModelCallback(TrainerCallback):
    """Merge the trained model with `merge_config.target_model_path` (default: the model training started from)
    and save the result with the tokenizer to `<output_dir>/checkpoint-<step>/merged`: at the end of training, or
    at every checkpoint with merge_at_every_checkpoint. push_to_hub uploads it as `<output_dir>_checkpoint-<step>
    _merged`."""

    def __init__(self, merge_config: MergeConfig | None = None, merge_at_every_checkpoint: bool = False,
                 push_to_hub: bool = False):
        self.merge_config = merge_config or MergeConfig()
        self.merge_at_every_checkpoint, self.push_to_hub = merge_at_every_checkpoint, push_to_hub

    def _merge(self, args, state, model, processing_class=None):
        from posttrain.models.loading import load_causal_lm

        cfg = self.merge_config
        checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        cfg.policy_model_path = checkpoint
        if cfg.target_model_path is None:
            cfg.target_model_path = model.config._name_or_path
        target = load_causal_lm(cfg.target_model_path).state_dict()
        merged = copy.deepcopy(model).to("cpu")
        dtype = getattr(torch, cfg.dtype)
        done = set()  # tied weights (embeddings and output layer) share storage: merge it once
        with torch.no_grad():
            for name, tensor in merged.state_dict().items():
                if tensor.data_ptr() in done:
                    continue
                done.add(tensor.data_ptr())
                if name not in target or target[name].shape != tensor.shape:
                    raise ValueError(f"cannot merge with {cfg.target_model_path!r}: its weight {name!r} is "
                                     f"{'missing' if name not in target else tuple(target[name].shape)}, the "
                                     f"trained model's is {tuple(tensor.shape)}")
                if tensor.is_floating_point():
                    tensor.copy_(cfg.merge(tensor, target[name]))
        path = os.path.join(checkpoint, "merged")
        merged.to(dtype).save_pretrained(path)
        if processing_class is not None:
            processing_class.save_pretrained(path)
        if self.push_to_hub:
            from huggingface_hub import HfApi

            repo = HfApi().create_repo(f"{args.output_dir}_checkpoint-{state.global_step}_merged", exist_ok=True)
            HfApi().upload_folder(repo_id=repo.repo_id, folder_path=path)
        return path

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.merge_at_every_checkpoint and state.is_world_process_zero:
            self._merge(args, state, model, processing_class)

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if not self.merge_at_every_checkpoint and state.is_world_process_zero:
            self._merge(args, state, model, processing_class)


# ---------------------------------------------------------------- Weave

class WeaveCallback(TrainerCallback):
    """At each evaluation, greedy completions of the eval prompts logged to a W&B Weave evaluation named
    `dataset_name` under `model_name` (default: the model's name), each scored by `scorers` ({name: fn(prompt,
    completion) -> number}); `project_name` starts Weave (`weave.init`) at the first evaluation. Needs the
    `weave` package."""

    def __init__(self, trainer, project_name: str | None = None, scorers: dict | None = None,
                 generation_config=None, num_prompts: int | None = None, dataset_name: str = "eval_dataset",
                 model_name: str | None = None):
        try:
            import weave  # noqa: F401
        except ImportError as err:
            raise ImportError("WeaveCallback needs the `weave` package (pip install weave); it logs evaluations to "
                              "W&B Weave") from err
        self.trainer, self.project_name, self.scorers = trainer, project_name, dict(scorers or {})
        self.generation_config, self.dataset_name, self.model_name = generation_config, dataset_name, model_name
        self.prompts = _eval_prompts(trainer, num_prompts, "WeaveCallback")
        self._started = False

    def on_evaluate(self, args, state, control, **kwargs):
        import weave

        if not state.is_world_process_zero:
            return
        if self.project_name and not self._started:  # once; without a project, Weave must be running already
            weave.init(self.project_name)
            self._started = True
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        name = self.model_name or os.path.basename(str(model.config._name_or_path)) or "model"
        completions = _generate(self.trainer, self.prompts, self.generation_config, args.per_device_eval_batch_size)
        evaluation = weave.EvaluationLogger(model=name, dataset=self.dataset_name)
        totals: dict[str, list[float]] = {k: [] for k in self.scorers}
        for prompt, completion in zip(self.prompts, completions):
            prediction = evaluation.log_prediction(inputs={"prompt": prompt}, output=completion)
            for scorer, fn in self.scorers.items():
                score = fn(prompt, completion)
                totals[scorer].append(float(score))
                prediction.log_score(scorer=scorer, score=score)
            prediction.finish()
        summary = {k: sum(v) / len(v) for k, v in totals.items() if v and not any(map(math.isnan, v))}
        evaluation.log_summary({"step": state.global_step, **summary})
