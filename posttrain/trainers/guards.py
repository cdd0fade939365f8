"""The guards every posttrain run has, whatever the trainer: numbers in configs checked, NaN or infinite
gradients and weights stopped, one run per output_dir, checkpoints checked before resuming, failed
writes explained.

* `check_training_numbers`, `check_finite_fields`: `BaseConfig.__post_init__` refuses a NaN, infinite
  or out-of-range number in any field (transformers' included), naming it.
* `FiniteGuard`: a callback that stops a run before a NaN/inf gradient reaches the optimizer step, or
  after an update that made a weight NaN/inf, so such weights are never saved or evaluated.
* `output_dir_lock` (trainers/dir_lock.py): an flock on the output folder itself for the run's lifetime; the
  kernel drops the lock of a dead process, so it is never stale.
* `write_manifest` / `check_checkpoint`: each checkpoint's last file lists every file's size and sha256
  (and the run's model and settings); resuming names a damaged or missing file and the newest intact
  checkpoint.
* `explained_write_errors`: a full disk while saving says so, naming the file.

Departures from transformers/TRL: all of these are posttrain's own (see docs/migrating.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import shutil

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from posttrain.trainers.dir_lock import OutputDirInUseError, output_dir_lock  # noqa: F401 (names of this module)

logger = logging.getLogger(__name__)

STATE_FILE = "posttrain_state.pt"  # the `checkpointed` attributes; posttrain_state_<rank>.pt with several processes
MANIFEST_FILE = "posttrain_manifest.json"  # every file's size and sha256, and the run's settings: written last
# settings that change what a resumed run computes; a resume that changes one says so (max_steps and
# num_train_epochs may change: a resumed run is often made longer)
RUN_SETTINGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type",
                "weight_decay", "max_grad_norm", "seed", "beta", "loss_type", "label_smoothing", "num_generations",
                "max_completion_length", "max_prompt_length", "max_length", "steps_per_generation", "num_iterations",
                "temperature", "epsilon", "packing", "completion_only_loss", "advantage_estimator", "scale_rewards")
STAGING_PREFIX = "tmp-"  # tmp-checkpoint-N/checkpoint-N: a checkpoint being written
TRAINER_STATE = "trainer_state.json"  # written last by transformers: a checkpoint without it is incomplete


# transformers' numeric fields that a run reads: name -> (lowest, highest, lowest allowed, highest allowed).
# NaN passes every comparison, so each rule is written as "inside the range" and NaN falls outside it.
TRAINING_RANGES: dict[str, tuple[float | None, float | None, bool, bool]] = {
    "learning_rate": (0, None, True, False), "weight_decay": (0, None, True, False),
    "adam_epsilon": (0, None, False, False), "adam_beta1": (0, 1, True, False), "adam_beta2": (0, 1, True, False),
    "max_grad_norm": (0, None, True, False), "num_train_epochs": (0, None, True, False),
    "warmup_steps": (0, None, True, False), "warmup_ratio": (0, 1, True, True),
    "per_device_train_batch_size": (1, None, True, False), "per_device_eval_batch_size": (1, None, True, False),
    "gradient_accumulation_steps": (1, None, True, False), "logging_steps": (0, None, False, False),
    "save_steps": (0, None, False, False), "eval_steps": (0, None, False, False), "eval_delay": (0, None, True, False),
    "label_smoothing_factor": (0, 1, True, False), "neftune_noise_alpha": (0, None, True, False),
    "dataloader_num_workers": (0, None, True, False), "seed": (0, 2**32 - 1, True, True),
    "data_seed": (0, 2**32 - 1, True, True), "save_total_limit": (0, None, True, False),
}


def _range_text(low, high, low_in: bool, high_in: bool) -> str:
    if high is None:
        return f"{'>=' if low_in else '>'} {low}"
    return f"in {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"


def _in_range(value, low, high, low_in: bool, high_in: bool) -> bool:
    above = value >= low if low_in else value > low
    below = high is None or (value <= high if high_in else value < high)
    return bool(above and below)


def check_training_numbers(config) -> None:
    """Refuse a transformers numeric field outside its range (NaN and infinities included), an output_dir
    that is a file, and a run that would train nothing; naming the field, before anything loads."""
    for name, (low, high, low_in, high_in) in TRAINING_RANGES.items():
        value = getattr(config, name, None)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value) or not _in_range(value, low, high, low_in, high_in):
            raise ValueError(f"{name} must be a finite number {_range_text(low, high, low_in, high_in)}, "
                             f"got {value!r}")
    if config.max_steps <= 0 and config.num_train_epochs <= 0:
        raise ValueError(f"max_steps={config.max_steps} and num_train_epochs={config.num_train_epochs}: the run "
                         "would train nothing and save the untrained model; set max_steps >= 1 or "
                         "num_train_epochs > 0")
    if config.output_dir is not None and os.path.isfile(config.output_dir):
        raise ValueError(f"output_dir {config.output_dir!r} is a file; give a folder (it is created if missing)")


def _non_finite(value) -> bool:
    """Whether a float, or any float of a list/tuple, is NaN or infinite."""
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, (list, tuple)) and any(_non_finite(v) for v in value)


def check_finite_fields(config) -> None:
    """Refuse NaN or infinity in any numeric field of any config (one that means "no limit" takes None)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name, None)
        if f.init and _non_finite(value):
            what = "every entry of " if isinstance(value, (list, tuple)) else ""
            none = " (or None)" if f.default is None else ""
            raise ValueError(f"{what}{f.name} must be a finite number{none}, got {value!r}")


def checkpoint_folders(folder: str) -> list[tuple[int, str, bool]]:
    """(step, path, complete) of every `checkpoint-N` folder in `folder`, by step; complete means that
    transformers' last file (trainer_state.json) is there."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        match = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", name)
        path = os.path.join(folder, name)
        if match and os.path.isdir(path):
            found.append((int(match.group(1)), path, os.path.isfile(os.path.join(path, TRAINER_STATE))))
    return sorted(found)


def latest_checkpoint(folder: str) -> str | None:
    """The newest complete checkpoint in `folder` (None if there is none); newer incomplete ones (a run
    killed while saving with an older posttrain, or a copy cut short) are skipped with a warning."""
    found = checkpoint_folders(folder)
    complete = [path for _, path, ok in found if ok]
    latest = complete[-1] if complete else None
    skipped = [os.path.basename(path) for step, path, ok in found
               if not ok and (latest is None or step > int(latest.rsplit("-", 1)[1]))]
    if skipped:
        logger.warning(f"skipping incomplete checkpoint(s) {skipped} in {folder} (no {TRAINER_STATE}: the run was "
                       f"stopped while saving); resuming from {latest and os.path.basename(latest)}")
    return latest


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: damaged, incomplete or another model's."""


def _sha256(path: str) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: str, run: dict) -> None:
    """Write `MANIFEST_FILE` into a checkpoint folder whose every other file is written: each file's size and
    sha256, and `run` (the model and the settings, see `BaseTrainer.run_identity`). Written to a temporary
    name and renamed, so a manifest is whole or absent."""
    import json

    files = {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel != MANIFEST_FILE:
                files[rel] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    staging = os.path.join(folder, MANIFEST_FILE + ".tmp")
    with open(staging, "w") as f:
        json.dump({"files": files, "run": run}, f, indent=1, sort_keys=True)
    os.replace(staging, os.path.join(folder, MANIFEST_FILE))


def read_manifest(folder: str) -> dict | None:
    import json

    path = os.path.join(folder, MANIFEST_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError:
        return {"files": {MANIFEST_FILE: {"size": -1, "sha256": ""}}, "run": {}}  # reported as damaged


def checkpoint_problem(folder: str) -> str | None:
    """What is wrong with a checkpoint folder, or None: no trainer_state.json, or a file its manifest lists that
    is missing, of another size (truncated) or with other bytes (checksum)."""
    if not os.path.isfile(os.path.join(folder, TRAINER_STATE)):
        return f"{TRAINER_STATE} is missing (the run was stopped while saving it?)"
    manifest = read_manifest(folder)
    for rel, want in (manifest or {"files": {}})["files"].items():
        path = os.path.join(folder, rel)
        if rel == MANIFEST_FILE:
            return f"{MANIFEST_FILE} cannot be read"
        if not os.path.isfile(path):
            return f"{rel} is missing"
        size = os.path.getsize(path)
        if size != want["size"]:
            return f"{rel} has {size} bytes where {want['size']} were written (truncated or overwritten)"
        if _sha256(path) != want["sha256"]:
            return f"{rel} differs from what was written (its sha256 does not match the manifest: damaged bytes)"
    return None


def check_checkpoint(folder: str) -> None:
    """Raise CheckpointError naming the bad file of `folder` and the newest intact checkpoint beside it. A
    checkpoint without a manifest (an older posttrain's) is only checked for its optimizer and posttrain state."""
    if read_manifest(folder) is None:
        names = os.listdir(folder)
        for stem in ("optimizer", STATE_FILE.removesuffix(".pt")):
            if not any(n.startswith(stem) or n.startswith("global_step") for n in names):
                logger.warning(f"{folder} has no {stem}*.pt (nor a {MANIFEST_FILE} to check it by): the resumed run "
                               "will not continue the interrupted one exactly")
    problem = checkpoint_problem(folder)
    if problem is None:
        return
    match = re.search(r"-(\d+)$", os.path.normpath(folder))
    step = int(match.group(1)) if match else None
    older = [path for s, path, ok in reversed(checkpoint_folders(os.path.dirname(os.path.normpath(folder))))
             if ok and (step is None or s < step)]
    good = next((path for path in older if checkpoint_problem(path) is None), None)
    offer = (f"The newest intact checkpoint is {good}: resume from it (resume_from_checkpoint={good!r})"
             if good else "No intact checkpoint is left beside it: start afresh (overwrite_output_dir=True)")
    raise CheckpointError(f"cannot resume from {folder}: {problem}. {offer}")


class SaveError(OSError):
    """Writing a checkpoint or the model failed (the disk full, most often): says which file and how much room."""


_WRITE_FAILURES = ("iostream error", "file write failed", "No space left", "Disk quota exceeded")


@contextlib.contextmanager
def explained_write_errors(folder: str):
    """Turn a failed write into `folder` (torch.save's C++ `basic_ios::clear: iostream error`, an OSError) into
    a SaveError saying whether the disk is full, which file was being written and how much room is left."""
    import errno

    try:
        yield
    except (OSError, RuntimeError) as err:
        codes = (errno.ENOSPC, errno.EDQUOT)
        if isinstance(err, SaveError) or not (getattr(err, "errno", None) in codes
                                              or any(s in str(err) for s in _WRITE_FAILURES)):
            raise
        files = [os.path.join(root, n) for root, _, names in os.walk(folder) for n in names]
        newest = max(files, key=os.path.getmtime, default=folder)
        free = shutil.disk_usage(folder if os.path.exists(folder) else os.path.dirname(folder) or ".").free
        full = getattr(err, "errno", None) in codes or free < 64 * 2**20
        what = "the disk is full" if full else f"writing failed ({err})"
        raise SaveError(errno.ENOSPC if full else errno.EIO,
                        f"{what} while writing {newest} ({free / 2**20:.0f} MiB free on that disk). Earlier "
                        "checkpoints are kept; make room (or lower save_total_limit) and resume") from err


class NonFiniteError(RuntimeError):
    """Gradients or weights became NaN or infinite: the run stopped instead of training on or saving them."""


def first_non_finite(named) -> str | None:
    """The name of the first tensor of (name, tensor) pairs holding a NaN or an infinity; None if all are finite.

    First the 2-norm of each tensor (a NaN or an infinity makes it non-finite; on CPU it costs about an eighth
    of the largest magnitude's pass, which is not vectorised there); only when one is not finite, the largest
    magnitude of each (NaN propagates, and unlike a 2-norm it cannot overflow on large finite values)."""
    # a DTensor (FSDP2) is checked by its local shard: no collective here; ZeRO-3's empty placeholders are skipped
    named = [(n, t.to_local() if hasattr(t, "to_local") else t) for n, t in named if t is not None]
    named = [(n, t.detach()) for n, t in named if t.numel() > 0]
    if not named:
        return None
    if _all_finite(torch._foreach_norm([t for _, t in named], 2)):
        return None
    peaks = torch._foreach_norm([t for _, t in named], float("inf"))
    if _all_finite(peaks):
        return None
    return next(name for (name, _), peak in zip(named, peaks) if not torch.isfinite(peak))


def clip_grad_norm_exact(parameters, max_norm: float):
    """`torch.nn.utils.clip_grad_norm_` (2-norm) without its pass over every gradient when nothing is clipped:
    torch multiplies the gradients by the clamped coefficient even when it is 1, a read and a write of every
    gradient for nothing. The same total norm, the same coefficient and the same gradients, bit for bit (a NaN
    or infinite norm still multiplies, so the gradients turn NaN as with torch, for `FiniteGuard` to stop).
    Returns the total norm (a 0-d tensor). None where this torch lacks `get_total_norm` (before 2.6)."""
    utils = torch.nn.utils
    if not (hasattr(utils, "get_total_norm") and hasattr(utils, "clip_grads_with_norm_")):
        return None
    parameters = [p for p in parameters if p.grad is not None]
    if not parameters:
        return torch.tensor(0.0)
    total = utils.get_total_norm([p.grad for p in parameters], 2.0)
    if not bool(max_norm / (total + 1e-6) >= 1.0):  # torch's coefficient, clamped at 1: a multiply only below
        utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def _all_finite(norms: list) -> bool:
    return bool(torch.stack([n.float().to(norms[0].device) for n in norms]).isfinite().all())


class FiniteGuard(TrainerCallback):
    """Stop a run whose gradients (before the optimizer step) or weights (after it) are NaN or infinite,
    with an error naming the parameter, the step and the newest checkpoint: transformers would log
    `grad_norm: nan`, go on and save a model whose every weight is NaN.

    The gradients are checked every step, by the clipping's total norm where the trainer computed it (no pass of
    the guard's own while it is finite). The weights are checked when something will read them as a result: before
    a checkpoint, an evaluation or the end of training (the step's `control`), and before naming a non-finite
    gradient (weights that an update made NaN give NaN gradients at the next step: the error then names the
    weight and the step that made it). So each step costs no pass over the weights of its own, and a NaN or
    infinite weight is still never saved or evaluated."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.grad_norm = None  # the step's total gradient 2-norm where the trainer's clipping computed it
        self.updated_at = None  # the step of the newest optimizer step whose weights are not checked yet

    def _trained(self):
        return [(n, p) for n, p in self.trainer.model.named_parameters() if p.requires_grad]

    def _newest(self, args) -> str:
        complete = [path for _, path, ok in checkpoint_folders(args.output_dir) if ok]
        return (f"The newest checkpoint, {complete[-1]}, holds weights from before it." if complete
                else "No checkpoint was saved.")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if getattr(self.trainer.accelerator, "scaler", None) is not None:
            return  # float16 loss scaling: an overflowing step is expected, and skipped by the scaler itself
        norm, self.grad_norm = self.grad_norm, None
        if norm is not None and bool(torch.isfinite(norm)):
            return  # the clipping's total 2-norm of these gradients is finite: so is each of them (no second pass)
        if name := first_non_finite((n, p.grad) for n, p in self._trained()):
            self.check_weights(args)  # the last update's weights first: NaN weights give NaN gradients
            raise NonFiniteError(
                f"step {state.global_step + 1}: the gradient of {name} is NaN or infinite (the loss or a reward "
                "was?): stopped before the optimizer step, so the weights stay finite and nothing of this step is "
                f"saved. {self._newest(args)} Check the data and rewards for extreme values, lower learning_rate, "
                "or train in float32")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.updated_at = state.global_step + 1  # checked when read (below), not by a pass at every step

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save or control.should_evaluate or control.should_training_stop:
            self.check_weights(args)

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_save or control.should_evaluate or control.should_training_stop:
            self.check_weights(args)

    def on_train_end(self, args, state, control, **kwargs):
        self.check_weights(args)

    def check_weights(self, args) -> None:
        """Raise NonFiniteError naming the first NaN or infinite trained weight, when an optimizer step changed
        them since they were last checked."""
        step, self.updated_at = self.updated_at, None
        if step is not None and (name := first_non_finite(self._trained())):
            raise NonFiniteError(
                f"step {step}: after the optimizer step, {name} holds NaN or infinite values (the "
                "update overflowed: learning rate or optimizer settings too large?): stopped, and the weights are "
                f"not saved. {self._newest(args)} Lower learning_rate or check the optimizer's settings")
