"""What every posttrain trainer shares: model and tokenizer loading, PEFT, reference models, metrics.

A trainer subclasses `BaseTrainer` and its config subclasses `BaseConfig`; the trainer file then
holds only its algorithm (batch preparation and `compute_loss`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from posttrain.models import loading


@dataclass
class BaseConfig(TrainingArguments):
    """Fields shared by every posttrain config, on top of `transformers.TrainingArguments`."""

    model_init_kwargs: dict[str, Any] | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `from_pretrained` when the model is given as a string "
                          "(e.g. {'dtype': 'bfloat16'}). Default: float32."})
    logging_steps: float = field(default=10, metadata={"help": "Log every this many optimizer steps."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: posttrain's collators pick the columns they need."})
    report_to: Any = field(default="none", metadata={"help": "Where to report metrics ('none', 'tensorboard', ...)."})
    save_strategy: str = field(default="no", metadata={"help": "Checkpoint saving strategy ('no', 'steps', 'epoch')."})
    keep_freed_memory: bool = field(
        default=True,
        metadata={"help": "Training on CPU under glibc (Linux): keep freed memory in the process heap (mallopt: "
                          "no mmap for large blocks, no trimming), so each step's large tensors reuse memory "
                          "instead of faulting in fresh pages from the OS; the backward pass runs ~9% faster. "
                          "An Adam/AdamW optimizer's state is then made at trainer creation, below the steps' "
                          "memory (same values as made lazily), so the second step does not fault in new pages. "
                          "The process keeps its peak memory reserved, as a GPU caching allocator does. False "
                          "leaves the C allocator untouched."})

    def __post_init__(self):
        super().__post_init__()
        # transformers turns "none" into an empty list; keep that behaviour
        self._check()

    def _check(self):
        """Subclasses raise ValueError here for invalid combinations of fields."""


def keep_freed_memory() -> bool:
    """Make glibc's malloc serve every block from its heap and never give freed memory back to the OS.

    By default glibc maps each block above 32 MiB (gradients, activations of a training step) fresh
    from the OS and unmaps it on free, so every step pays page faults to zero-fill them again.
    Returns True when the settings took effect (glibc found), False elsewhere.
    """
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def make_adam_state(optimizer) -> bool:
    """Create an Adam / AdamW optimizer's state (step 0, zero moments) now instead of in its first step.

    With `keep_freed_memory`, memory freed by a training step is reused by the next allocations.
    Moments created lazily in the first `optimizer.step()` take the space the first step's
    activations just left, so the second step's activations need new pages from the OS (SmolLM2-135M
    RLOO on CPU: 92k-121k page faults, 1.5-2 s, in the second step). Created before any step, the
    moments sit below the steps' memory: measured, 11k faults in the second step, 3% fewer in all to
    the third (894k -> 867k) and peak RSS 3454 -> 3429 MiB. Mostly a one-time cost moved from the
    second step to trainer creation, with a slightly smaller heap. The state is what the first step
    would have made: torch's own initialisation runs in one step with zero gradients and zero
    learning rates (the parameters do not change), after which every state tensor, the step count
    included, is zeroed. Returns True when the state was made; other optimizers, or one that already
    has state, are left alone.
    """
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or optimizer.state:
        return False
    if any(isinstance(group["lr"], torch.Tensor) for group in optimizer.param_groups):
        return False
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad and p.grad is None]
    if not params:
        return False
    rates = [group["lr"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, rates):
            group["lr"] = lr
        for p in params:
            p.grad = None
    with torch.no_grad():
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
    return True


class SyncRefModelCallback(TrainerCallback):
    """Every `ref_model_sync_steps` steps: ref <- alpha * policy + (1 - alpha) * ref (TR-DPO style)."""

    def __init__(self, ref_model, alpha: float, every: int):
        self.ref_model, self.alpha, self.every = ref_model, alpha, every

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is not None and state.global_step % self.every == 0:
            from posttrain.core.running import mix_into_

            mix_into_(self.ref_model, model, self.alpha)


class BaseTrainer(Trainer):
    """transformers.Trainer plus model-from-string loading, PEFT, reference models and a metric buffer."""

    _tag = "posttrain"

    def __init__(self, model, args: BaseConfig, *, processing_class=None, train_dataset=None,
                 eval_dataset=None, data_collator=None, peft_config=None, callbacks=None,
                 optimizers=(None, None), model_kind: str = "causal-lm", **trainer_kwargs):
        self._heap_kept = bool(args.keep_freed_memory and (args.use_cpu or not torch.cuda.is_available())
                               and keep_freed_memory())
        model_name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
        init_kwargs = dict(args.model_init_kwargs or {})
        if model_kind == "causal-lm":
            model = loading.load_causal_lm(model, **init_kwargs)
        else:
            model = loading.load_sequence_classifier(model, **init_kwargs)
        self.processing_class_ = processing_class = loading.load_tokenizer(processing_class, model=model_name or model)
        if model_kind != "causal-lm" and getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = processing_class.pad_token_id  # sequence scores read the last non-pad token
        if args.gradient_checkpointing and hasattr(model, "config"):
            model.config.use_cache = False
        model = loading.apply_peft(model, peft_config)
        self.model_name = model_name
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, **trainer_kwargs)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self._heap_kept:
            make_adam_state(optimizer)
        return optimizer

    # ------------------------------------------------------------------ reference policy
    def make_reference(self, ref_model, needed: bool = True):
        """The frozen reference policy: given, or a frozen copy; None when a PEFT model can disable its adapter."""
        if not needed:
            return None
        if ref_model is None and loading.is_peft_model(self.model):
            return None  # reference = the same weights with the adapter disabled: no second copy
        if ref_model is None:
            ref_model = loading.frozen_copy(self.accelerator.unwrap_model(self.model))
        else:
            ref_model = loading.load_causal_lm(ref_model, **(self.args.model_init_kwargs or {}))
            ref_model.requires_grad_(False).eval()
        return self.accelerator.prepare_model(ref_model, evaluation_mode=True)

    def reference_context(self, ref_model):
        """Context in which `self.model` acts as the reference (PEFT: adapter disabled), when ref_model is None."""
        import contextlib

        if ref_model is None and loading.is_peft_model(self.model):
            return self.accelerator.unwrap_model(self.model).disable_adapter()
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ metrics
    def record(self, metrics: dict[str, Any], mode: str | None = None):
        """Buffer metrics (floats or tensors); `log` averages them over the steps since the last log."""
        mode = mode or ("train" if self.model.training else "eval")
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().float()
                value = self.accelerator.gather_for_metrics(value.reshape(1) if value.dim() == 0 else value).mean().item()
            self._metrics[mode][name].append(float(value))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        prefix = "eval_" if mode == "eval" else ""
        for name, values in self._metrics[mode].items():
            if values:
                logs[prefix + name] = sum(values) / len(values)
        self._metrics[mode].clear()
        super().log(logs, start_time)
