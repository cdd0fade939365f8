"""Training callbacks and sample logs.

Each part stands alone in its own section: the completions table of the online trainers, the
reference-model sync, the training-curve plot and the win-rate evaluation. The modules they call
(`plotting`, `judges`, `eval`, `core.running`) are imported when a callback runs, so importing
this module stays light. Those modules never import this one (their old names `plotting.PlotCallback`
and `judges.WinRateCallback` come through `posttrain`'s lazy public names).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import TYPE_CHECKING, Any, Sequence

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

    def write(self, step: int, prompts: list, completions: list[str], scores: dict[str, list[float]]):
        rows = [{"step": step, "prompt": _text(p), "completion": c,
                 **{name: _number(values[i]) for name, values in scores.items()}}
                for i, (p, c) in enumerate(zip(prompts, completions))]
        if self.path and step not in self._steps_on_file:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.print(step, rows[: self.num_to_print] if self.num_to_print else rows, list(scores))
        self.report(rows, list(scores))
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
    """Every `ref_model_sync_steps` steps: ref <- alpha * policy + (1 - alpha) * ref (TR-DPO style)."""

    def __init__(self, ref_model, alpha: float, every: int):
        self.ref_model, self.alpha, self.every = ref_model, alpha, every

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is not None and state.global_step % self.every == 0:
            from posttrain.core.running import mix_into_
            from posttrain.models.loading import zero3_partitioned

            if not zero3_partitioned(self.ref_model):
                mix_into_(self.ref_model, model, self.alpha)
                return
            import deepspeed  # ZeRO-3: mix the whole weights, then the reference is partitioned again

            with deepspeed.zero.GatheredParameters(list(self.ref_model.parameters()), modifier_rank=0), \
                    deepspeed.zero.GatheredParameters(list(model.parameters())):
                mix_into_(self.ref_model, model, self.alpha)


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
