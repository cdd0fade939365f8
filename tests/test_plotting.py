"""Training-curve plots: the plotting function on a made-up log history, and PlotCallback on a tiny run."""

import json
import math

import pytest

from posttrain.plotting import PlotCallback, default_plot_keys, plot_log_history

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path, min_bytes=5_000):
    data = open(path, "rb").read()
    return data[:8] == PNG_MAGIC and len(data) > min_bytes


def _history(n=20):
    rows = []
    for step in range(1, n + 1):
        rows.append({"loss": 2.0 / step, "reward": 1 - 1 / step, "rewards/exact_match/mean": step / n,
                     "learning_rate": 1e-3, "epoch": step / n, "step": step})
        if step % 5 == 0:
            rows.append({"eval_loss": 2.5 / step, "eval_runtime": 0.1, "step": step})
    rows[3]["loss"] = math.nan  # non-finite points are skipped, not drawn
    return rows


def test_plot_log_history_writes_a_png_of_the_keys_present(tmp_path):
    path = tmp_path / "sub" / "curves.png"
    plotted = plot_log_history(_history(), ["loss", "eval_loss", "not_logged", "reward"], path, title="run")
    assert plotted == ["loss", "eval_loss", "reward"]
    assert _is_png(path)


def test_default_keys_smoothing_and_trainer_state_file(tmp_path):
    history = _history()
    assert default_plot_keys(history) == ["loss", "eval_loss", "reward", "rewards/exact_match/mean"]
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"log_history": history}))
    plotted = plot_log_history(str(state), None, tmp_path / "smooth.png", smoothing=0.6)
    assert plotted == default_plot_keys(history)
    assert _is_png(tmp_path / "smooth.png")


def test_plot_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match=r"keys that can be plotted: \['eval_loss', 'learning_rate', 'loss'"):
        plot_log_history(_history(), ["objective/kl"], tmp_path / "x.png")
    with pytest.raises(ValueError, match="smoothing"):
        plot_log_history(_history(), ["loss"], tmp_path / "x.png", smoothing=1.0)


def test_missing_matplotlib_message(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[plot\]'"):
        plot_log_history(_history(), ["loss"], tmp_path / "x.png")
    with pytest.raises(ImportError, match=r"posttrain\[plot\]"):
        PlotCallback()


def test_plot_callback_after_a_tiny_training_run(tmp_path):
    from posttrain import SFTConfig, SFTTrainer
    from posttrain.tasks.builtin import task_dataset

    callback = PlotCallback(keys=["loss", "mean_token_accuracy", "learning_rate"], title="tiny run")
    args = SFTConfig(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, logging_steps=1,
                     learning_rate=1e-3, use_cpu=True)
    trainer = SFTTrainer("posttrain/tiny-qwen2", args, train_dataset=task_dataset("reverse", size=24),
                         callbacks=[callback])
    trainer.train()
    assert callback.path == str(tmp_path / "training_curves.png")
    assert callback.plotted == ["loss", "mean_token_accuracy", "learning_rate"]
    assert _is_png(callback.path)
    # a run that logged none of the keys warns instead of failing at the very end
    quiet = PlotCallback(keys=["objective/kl"], filename="none.png")
    with pytest.warns(UserWarning, match="nothing plotted"):
        quiet.on_train_end(args, trainer.state, trainer.control)
    assert quiet.path is None and not (tmp_path / "none.png").exists()
