"""Training curves as a PNG: `plot_log_history`, which `callbacks.PlotCallback` calls when training ends.

Needs matplotlib (the optional extra `posttrain[plot]`). The figure is drawn with matplotlib's
object API on the Agg canvas, so the global pyplot backend of a notebook or script is left alone.
"""

from __future__ import annotations

import json
import math
import os
from typing import Sequence

__all__ = ["plot_log_history", "default_plot_keys", "PlotCallback", "DEFAULT_PLOT_KEYS"]


def __getattr__(name: str):
    # The old path `posttrain.plotting.PlotCallback`: callbacks.py imports this module, so the callback comes
    # through the package's lazy public names instead of an import here (which would make a cycle).
    if name == "PlotCallback":
        import posttrain

        return posttrain.PlotCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# What to show when no keys are given, in this order, for whichever appear in the log history:
# the loss and reward curves of every trainer, then the health signals of online RL.
DEFAULT_PLOT_KEYS = (
    "loss", "eval_loss", "reward", "objective/rlhf_reward", "objective/scores", "eval_win_rate",
    "rewards/accuracies", "rewards/margins", "accuracy", "eval_accuracy", "margin", "mean_token_accuracy",
    "objective/kl", "kl", "entropy", "objective/entropy", "completions/mean_length", "frac_reward_zero_std",
)
# bookkeeping values the Trainer logs that are not curves worth drawing
_NOT_CURVES = {"step", "epoch", "total_flos", "train_runtime", "train_samples_per_second",
               "train_steps_per_second", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}


def require_matplotlib():
    """(Figure, FigureCanvasAgg) from matplotlib, or an ImportError that says how to install it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("plotting training curves needs matplotlib: pip install 'posttrain[plot]'") from err
    return Figure, FigureCanvasAgg


def _rows(log_history) -> list[dict]:
    """Accept a list of log dicts, a TrainerState, or the path of a trainer_state.json."""
    if isinstance(log_history, (str, os.PathLike)):
        with open(log_history) as f:
            log_history = json.load(f)["log_history"]
    return list(getattr(log_history, "log_history", log_history))


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i, row in enumerate(rows):
        y = _number(row.get(key))
        if y is not None:
            xs.append(row.get("step", i))
            ys.append(y)
    return xs, ys


def default_plot_keys(log_history) -> list[str]:
    """The keys of DEFAULT_PLOT_KEYS that appear, plus every per-function reward mean (`rewards/<name>/mean`)."""
    present = {k for row in _rows(log_history) for k, v in row.items() if _number(v) is not None}
    keys = [k for k in DEFAULT_PLOT_KEYS if k in present]
    keys += sorted(k for k in present if k.startswith("rewards/") and k.endswith("/mean"))
    return keys


def plot_log_history(log_history, keys: Sequence[str] | None, path: str | os.PathLike,
                     title: str | None = None, smoothing: float = 0.0) -> list[str]:
    """Write a PNG with one subplot per key of `keys` that appears in `log_history` (x axis: step).

    `log_history` is `trainer.state.log_history`, a TrainerState or a trainer_state.json path;
    `keys=None` picks `default_plot_keys`. With `smoothing` in (0, 1) an exponential moving average
    (weight `smoothing` on the past) is drawn over the raw curve. Returns the keys plotted; raises
    ValueError naming the keys that can be plotted when none of `keys` appears.
    """
    Figure, FigureCanvasAgg = require_matplotlib()
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    rows = _rows(log_history)
    wanted = list(keys) if keys is not None else default_plot_keys(rows)
    series = {k: _series(rows, k) for k in dict.fromkeys(wanted)}
    series = {k: s for k, s in series.items() if s[1]}
    if not series:
        available = sorted({k for r in rows for k, v in r.items() if _number(v) is not None} - _NOT_CURVES)
        raise ValueError(f"none of the keys {wanted} has a finite value in the log history; "
                         f"keys that can be plotted: {available}")
    ncols = min(3, len(series))
    nrows = math.ceil(len(series) / ncols)
    fig = Figure(figsize=(4.2 * ncols, 3.0 * nrows + (0.4 if title else 0.0)), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (key, (xs, ys)) in zip(axes, series.items()):
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, linewidth=1.2,
                alpha=0.35 if smoothing else 1.0, color="tab:blue")
        if smoothing:
            smooth, ema = [], ys[0]
            for y in ys:
                ema = smoothing * ema + (1 - smoothing) * y
                smooth.append(ema)
            ax.plot(xs, smooth, linewidth=1.6, color="tab:blue")
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[len(series):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    folder = os.path.dirname(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)
    fig.savefig(path, format="png")
    return list(series)
