"""Training callbacks and sample logs.

Each part stands alone in its own section.
"""

from __future__ import annotations

import json
import math
import os

# ---------------------------------------------------------------- completions table (online trainers)

COMPLETIONS_FILE = "completions.jsonl"


class CompletionsTable:
    """Sampled completions: a rich table of prompt | completion | one score column per reward on
    the console, and every row appended to `<output_dir>/completions.jsonl` as
    {"step", "prompt", "completion", "<reward name>": score, ...}.

    The online trainers call `write` on the main process at their sampling points
    (`num_sample_generations` evenly spaced steps, or every logging step with `log_completions`).
    """

    def __init__(self, output_dir: str | None, num_to_print: int | None = None, max_chars: int = 200):
        self.path = os.path.join(output_dir, COMPLETIONS_FILE) if output_dir else None
        self.num_to_print, self.max_chars = num_to_print, max_chars
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
        return rows

    def print(self, step: int, rows: list[dict], names: list[str]):
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"completions at step {step}", show_lines=True)
        for heading in self.headings:
            table.add_column(heading, overflow="fold")
        for name in names:
            title = name if self.score_heading is None else \
                self.score_heading if len(names) == 1 else f"{self.score_heading} ({name})"
            table.add_column(Text(title), justify="right")
        for row in rows:
            # Text, not str: rich would read "[/INST]" or "[bold]" in user text as markup (and fail on a stray tag)
            cells = [Text(_clip(row["prompt"], self.max_chars)), Text(_clip(row["completion"], self.max_chars))]
            cells += ["-" if row[n] is None else f"{row[n]:.3f}" for n in names]
            table.add_row(*cells)
        Console().print(table)


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
