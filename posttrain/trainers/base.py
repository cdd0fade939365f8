"""What every posttrain trainer shares: model and tokenizer loading, PEFT, reference models, metrics,
seeding, and checkpoints a run can always resume from.

A trainer subclasses `BaseTrainer` and its config subclasses `BaseConfig`; the trainer file then
holds only its algorithm (batch preparation and `compute_loss`).

Checkpoints: on top of what transformers saves (weights, optimizer, scheduler, RNG, trainer state,
data position), every checkpoint holds the trainer attributes named in `checkpointed` (counters,
generators, running statistics: `posttrain_state.pt`, one per process) and, when a
`SyncRefModelCallback` moves the reference, the reference's weights (`ref_model.safetensors`).
A checkpoint is written under `tmp-checkpoint-N/` and renamed to `checkpoint-N` once complete, so
a run killed mid-save never leaves a `checkpoint-N` that resuming would pick and fail on. A fresh
run refuses an output_dir that holds an earlier run's checkpoints unless `overwrite_output_dir`.
The guards of `guards.py` apply to every trainer from here: config numbers checked, NaN/inf
gradients and weights stopped (`FiniteGuard`), output_dir locked for the run, each checkpoint's
manifest written last and checked before resuming, failed writes explained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import shutil
import warnings
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, enable_full_determinism, set_seed

from posttrain.accel import lean, products, threads
from posttrain.accel.memory import keep_freed_memory, make_adam_state, own_file_backed
from posttrain.callbacks import SyncRefModelCallback
from posttrain.data import multimodal
from posttrain.models import compat, loading
from posttrain.trainers.guards import (MANIFEST_FILE, RUN_SETTINGS, STAGING_PREFIX, STATE_FILE,  # noqa: F401
                                       TRAINER_STATE, CheckpointError, FiniteGuard, NonFiniteError,
                                       OutputDirInUseError, SaveError, check_checkpoint, check_finite_fields,
                                       check_training_numbers, checkpoint_folders, clip_grad_norm_exact, explained_write_errors,
                                       latest_checkpoint, output_dir_lock, read_manifest, write_manifest)

logger = logging.getLogger(__name__)

REF_MODEL_FILE = "ref_model.safetensors"  # a reference that training moves (sync_ref_model)
SECRET_FIELDS = {"hub_token", "push_to_hub_token"}  # config fields never written to disk


@dataclass
class BaseConfig(TrainingArguments):
    """Fields shared by every posttrain config, on top of `transformers.TrainingArguments`."""

    model_init_kwargs: dict[str, Any] | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `from_pretrained` when the model is given as a string "
                          "(e.g. {'dtype': 'bfloat16'}). Default: float32."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run the modelling and tokenizer code a model folder ships (auto_map) when "
                                         "the model or tokenizer is given as a string; the same as "
                                         "model_init_kwargs={'trust_remote_code': True}. That code runs in this "
                                         "process with your permissions: only for folders you trust."})
    logging_steps: float = field(default=10, metadata={"help": "Log every this many optimizer steps."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: posttrain's collators pick the columns they need."})
    report_to: Any = field(default="none", metadata={"help": "Where to report metrics ('none', 'tensorboard', ...)."})
    save_strategy: str = field(default="no", metadata={"help": "Checkpoint saving strategy ('no', 'steps', 'epoch')."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "A new run (not resumed) in an output_dir that holds `checkpoint-N` folders of an earlier "
                          "run is refused, since a later `resume_from_checkpoint=True` could pick the earlier run's "
                          "latest checkpoint. True deletes those checkpoints (with a warning naming them) and "
                          "starts afresh. To continue the earlier run instead, pass resume_from_checkpoint."})
    keep_freed_memory: bool = field(
        default=True,
        metadata={"help": "Training on CPU under glibc (Linux): keep freed memory in the process heap (mallopt: "
                          "no mmap for large blocks, no trimming), so each step's large tensors reuse memory "
                          "instead of faulting in fresh pages from the OS (what it saves: benchmarks/README.md). "
                          "An Adam/AdamW optimizer's state is then made with the optimizer, before the first step "
                          "and below the steps' memory (same values as made lazily), so the second step does not "
                          "fault in new pages. "
                          "The process keeps its peak memory reserved, as a GPU caching allocator does. False "
                          "(or POSTTRAIN_KEEP_FREED_MEMORY=0 in the environment) leaves the C allocator untouched."})
    freeze_vision_tower: bool = field(
        default=False, metadata={"help": "Vision-language models: do not train the vision tower (image encoder: "
                                         "`vision_tower`, `vision_model` or `visual`); its projector is left to "
                                         "freeze_multi_modal_projector. An error for a text-only model."})
    freeze_multi_modal_projector: bool = field(
        default=False, metadata={"help": "Vision-language models: do not train the projector that maps image "
                                         "features into the language model (`multi_modal_projector`, `connector` "
                                         "or Qwen2-VL's `merger`). An error for a text-only model."})
    lean_activations: bool = field(
        default=True,
        metadata={"help": "Compute the model's Llama-style RMSNorms and SwiGLU MLPs (Llama, Mistral, Qwen2/3, SmolLM, "
                          "... as transformers writes them) with autograd functions that keep only the norm's input "
                          "and the gate's and up projection's outputs for the backward, recomputing the rest there: "
                          "about a quarter less activation memory, with the same values and gradients bit for bit. "
                          "The model object is patched in place (posttrain.accel.lean.make_lean); "
                          "other architectures are left as they are, and so is everything under torch_compile. "
                          "False: the plain transformers modules (an earlier trainer's patch is undone)."})

    def __post_init__(self):
        check_training_numbers(self)  # before transformers derives anything from them
        super().__post_init__()
        # transformers turns "none" into an empty list; keep that behaviour
        if self.trust_remote_code:  # every loader reads it from model_init_kwargs
            if (self.model_init_kwargs or {}).get("trust_remote_code", True) is not True:
                raise ValueError("trust_remote_code=True contradicts model_init_kwargs {'trust_remote_code': False}; "
                                 "give one of them")
            self.model_init_kwargs = {**(self.model_init_kwargs or {}), "trust_remote_code": True}
        self._check()
        check_finite_fields(self)  # after `_check`, whose messages are more specific where it has one

    def _check(self):
        """Subclasses raise ValueError here for invalid combinations of fields."""

    def __getstate__(self):
        """Pickled (transformers' `training_args.bin` in every checkpoint and output_dir) without the hub
        token: whoever receives the folder must not receive the token. Copies keep it (`__copy__`)."""
        state = dict(self.__dict__)
        for name in SECRET_FIELDS & state.keys():
            state[name] = None
        return state

    def __copy__(self):
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        return twin

    def __deepcopy__(self, memo):
        import copy

        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return twin

    def derive(self, name: str, value) -> None:
        """Set field `name`, left None by the user, to a value derived from other fields, and remember it: a
        copy of the config with other fields (a config field given to a trainer) derives it again."""
        setattr(self, name, value)
        self.__dict__.setdefault("_derived_fields", {})[name] = value



def seed_run(args: TrainingArguments) -> None:
    """Seed python, numpy and torch from `args.seed` (fully deterministic kernels with `full_determinism`).

    Trainers call it before they load or build any model, so that fresh weights (a reward model's
    score head, a value head) are the same for the same seed; transformers.Trainer seeds only
    after the model exists.
    """
    enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)


def check_train_dataset(dataset) -> None:
    """Refuse an empty train_dataset at construction, not at the first step."""
    if dataset is not None and hasattr(dataset, "__len__") and len(dataset) == 0:
        raise ValueError("train_dataset is empty (0 rows): give a dataset with at least one training row")


def classic_arguments(trainer: str, config_class, args, processing_class, kwargs: dict[str, Any]):
    """(args, processing_class) from the older TRL calling conventions a trainer's `**kwargs` caught.

    `tokenizer=` is the old name of `processing_class`. A config field given to the trainer
    (classic `SFTTrainer(..., packing=True)`, `DPOTrainer(..., beta=0.1)`) is set on a copy of
    `args` with a FutureWarning naming the field; any other keyword is a TypeError, as Python
    would raise for an unknown argument.
    """
    kwargs = dict(kwargs)
    tokenizer = kwargs.pop("tokenizer", None)
    if tokenizer is not None:
        if processing_class is not None and processing_class is not tokenizer:
            raise ValueError(f"{trainer}: give processing_class= or its old name tokenizer=, not both")
        processing_class = tokenizer
    fields = {f.name for f in dataclasses.fields(config_class) if f.init}
    if unknown := sorted(set(kwargs) - fields):
        raise TypeError(f"{trainer}.__init__() got unexpected keyword argument(s) {unknown} (neither a trainer "
                        f"argument nor a {config_class.__name__} field)")
    args = args if args is not None else config_class()
    if kwargs:
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        warnings.warn(f"passing {sorted(kwargs)} to {trainer} is deprecated: they are {config_class.__name__} "
                      f"fields; set them there ({config_class.__name__}(..., {given})). Applied to a copy of args",
                      FutureWarning, stacklevel=3)
        for classic, other in getattr(config_class, "_aliases", ()):  # RLOO/PPO: one name of a pair sets both
            if (classic in kwargs) != (other in kwargs):
                kwargs[classic] = kwargs[other] = kwargs.get(classic, kwargs.get(other))
        # reruns __post_init__: the fields are checked as usual, and those derived from others derived again
        rederive = {name: None for name, value in getattr(args, "_derived_fields", {}).items()
                    if name not in kwargs and getattr(args, name) == value}
        args = dataclasses.replace(args, **rederive, **kwargs)
    return args, processing_class


def _value_kind(value) -> str:
    """The type of a row value as a dataset column stores it ('number' covers int and float)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, (list, tuple)):
        inner = next((_value_kind(v) for v in value if v is not None), None)
        return f"list of {inner}" if inner else "list"
    if isinstance(value, Mapping):
        return "dict"
    return type(value).__name__


def map_datasets(fn, data, name: str | None = None):
    """`fn(dataset)` for a dataset, or for each dataset of a dict of them (an eval_dataset may be one); None
    stays None. With `name`, fn also gets the dataset's name for its messages: `name`, or `name[key]`."""
    if data is None:
        return None
    if isinstance(data, dict):
        return {k: fn(v) if name is None else fn(v, f"{name}[{k}]") for k, v in data.items()}
    return fn(data) if name is None else fn(data, name)


EVAL_SET = "evaluation set (eval_dataset)"


@contextlib.contextmanager
def errors_named(what: str):
    """Prefix the row errors (FormatError, TokenizeError) raised in the block with `what`, e.g. `EVAL_SET`, so a
    bad row of the evaluation data is not taken for one of the training data."""
    from posttrain.data.formats import FormatError
    from posttrain.data.tokenize import TokenizeError

    try:
        yield
    except (FormatError, TokenizeError) as err:
        if str(err).startswith(what):
            raise
        raise type(err)(f"{what}: {err}") from None


def as_dataset(data, name: str = "train_dataset"):
    """A plain Python list of row dicts -> `datasets.Dataset` (a dict of them for a dict of lists); other
    data is returned as it is.

    Rows are checked first, so that a column whose values change type names the rows instead of
    failing inside pyarrow. Columns are the union of every row's keys (absent values are None).
    """
    from datasets import Dataset

    from posttrain.data import formats

    if isinstance(data, Mapping) and any(isinstance(v, (list, tuple)) and v and isinstance(v[0], Mapping)
                                         for v in data.values()):
        return {k: as_dataset(v, f"{name}[{k!r}]") for k, v in data.items()}
    if not isinstance(data, (list, tuple)):
        return data
    seen: dict[str, tuple[int, str]] = {}  # column -> (first row, kind) of its first non-None value
    for i, row in enumerate(data):
        if not isinstance(row, Mapping):
            raise TypeError(f"{name} row {i} is a {type(row).__name__}; a list dataset holds one dict per row "
                            "(column name -> value)")
        for column, value in row.items():
            if value is None:
                continue
            try:
                formats.check_encodable(value)
            except ValueError as err:  # pyarrow would fail on it naming no row
                raise formats.FormatError(f"{name}: row {i}, column {column!r}: {err}") from None
            kind = _value_kind(value)
            first = seen.setdefault(column, (i, kind))
            if first[1] != kind and "list" not in (first[1], kind):  # "list": empty, type unknown
                raise ValueError(f"{name}: column {column!r} is a {first[1]} in row {first[0]} but a {kind} in "
                                 f"row {i}; give the column one type in every row")
    columns = list(dict.fromkeys(c for row in data for c in row))
    return Dataset.from_dict({c: [row.get(c) for row in data] for c in columns})


def is_streamed(data) -> bool:
    """Whether `data` (or any dataset of a dict of them) is a `datasets.IterableDataset`."""
    from datasets import IterableDataset

    values = data.values() if isinstance(data, Mapping) else [data]
    return any(isinstance(v, IterableDataset) for v in values)


def check_datasets(args: TrainingArguments, train_dataset, eval_dataset=None) -> None:
    """Refuse at construction what TRL refuses: no train_dataset, a streamed one without max_steps (an
    online trainer's total_episodes sets max_steps too),
    and `with_transform()` datasets (posttrain tokenises rows once before training and would read them
    without the transform)."""
    if train_dataset is None:
        raise ValueError("train_dataset is required (got None): pass the training rows, e.g. a datasets.Dataset, "
                         "an IterableDataset or a list of dicts")
    check_train_dataset(train_dataset)
    if is_streamed(train_dataset) and args.max_steps <= 0 and not getattr(args, "total_episodes", None):
        raise ValueError("a streamed train_dataset (IterableDataset) has no length, so the number of steps is "
                         "unknown: set max_steps in the config (or total_episodes, for the online trainers)")
    refuse_transforms(train_dataset, eval_dataset)


def refuse_transforms(*datasets) -> None:
    """Refuse `with_transform()` / `set_transform()` datasets (or dicts of them): see `check_datasets`."""
    for data in datasets:
        if isinstance(data, Mapping):
            refuse_transforms(*data.values())
        elif getattr(data, "format", None) and data.format.get("type") == "custom":
            raise ValueError("a dataset with a with_transform()/set_transform() transform cannot be prepared: "
                             "posttrain tokenises the rows once before training and would read them without the "
                             "transform; apply it first with dataset.map(transform, batched=True)")


def check_liger(args: TrainingArguments, model=None) -> None:
    """`use_liger_kernel` with a PEFT set-up TRL refuses, or without the liger-kernel package, is refused.

    TRL refuses two PEFT set-ups with liger: an adapter on the output layer (liger's fused linear
    cross-entropy multiplies the hidden states by the base `lm_head.weight` directly, so the adapter
    would get no gradient) and prompt learning (prompt/prefix/p-tuning add virtual tokens in
    `PeftModel.forward`, which liger's fused paths skip). `model`: the model after PEFT wrapping.
    """
    if not getattr(args, "use_liger_kernel", False):
        return
    for peft_model in [m for m in (model.modules() if model is not None else ()) if loading.is_peft_model(m)]:
        configs = peft_model.peft_config.values()
        if any(getattr(c, "is_prompt_learning", False) for c in configs):
            kinds = sorted({str(getattr(c.peft_type, "value", c.peft_type)) for c in configs if c.is_prompt_learning})
            raise ValueError(f"use_liger_kernel=True cannot be combined with a prompt-learning PEFT adapter ({kinds}): "
                             "its virtual tokens are added by PeftModel.forward, which liger-kernel's fused loss paths "
                             "skip (TRL refuses it too). Use a weight adapter such as LoRA, or set "
                             "use_liger_kernel=False")
        head = peft_model.get_output_embeddings()
        if hasattr(head, "base_layer") or hasattr(head, "original_module"):  # a LoRA layer or modules_to_save copy
            raise ValueError("use_liger_kernel=True cannot be combined with a PEFT adapter on the output layer "
                             "(lm_head in target_modules or modules_to_save): liger-kernel's fused linear "
                             "cross-entropy multiplies the hidden states by the base lm_head.weight directly, so the "
                             "adapter would get no gradient (TRL refuses it too). Leave lm_head out of the PEFT "
                             "config, or set use_liger_kernel=False")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ValueError("use_liger_kernel=True, but liger-kernel is not installed (pip install liger-kernel). "
                         "posttrain does not need it to save memory: its losses fuse the output layer into a "
                         "chunked log-softmax, so the full (tokens x vocabulary) logits are never built. Unset "
                         "use_liger_kernel, or install liger-kernel to have transformers patch the model's kernels")


def warn_still_running() -> None:
    """Say which tool calls or reward functions given up on at their timeout still run (daemon threads that
    Python cannot stop), so that a CPU kept busy after `train()` returns is explained."""
    from posttrain.rollout.tools import still_running

    if names := still_running():
        logger.warning(f"{len(names)} tool call(s) or reward function(s) given up on at their timeout are still "
                       f"running ({', '.join(names)}): Python cannot stop a thread, so they run until they return "
                       "or the process ends. Make such functions return in time (or async, which is cancelled)")


class FitThreadsCallback(TrainerCallback):
    """When training starts, torch's thread count fitted to the CPUs other processes leave free
    (accel/threads.py; what a busy machine costs: benchmarks/README.md); a resumed run takes the
    count its checkpoint saved (`run_threads`), so that it sums as the run it continues."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        count = self.trainer.run_threads or threads.fitted_threads()
        if count is not None and count != torch.get_num_threads():
            torch.set_num_threads(count)
        self.trainer.run_threads = torch.get_num_threads()


class BaseTrainer(Trainer):
    """transformers.Trainer plus model-from-string loading, PEFT, reference models and a metric buffer."""

    _tag = "posttrain"
    _name = "posttrain"  # the method as the model card names it ("DPO", "Reward modelling", ...)
    _citation: str | None = None  # BibTeX of the method's paper, for the model card
    aux_loss_enabled = False  # the loss adds the model's auxiliary (MoE router) loss; SFT sets it from the config
    # attributes that the next steps depend on and transformers does not save: ints, floats, lists or dicts of
    # them, torch.Generators and objects with state_dict/load_state_dict; absent ones are skipped
    checkpointed: tuple[str, ...] = ("_num_tokens", "run_threads")

    def __init__(self, model, args: BaseConfig, *, processing_class=None, train_dataset=None,
                 eval_dataset=None, data_collator=None, peft_config=None, callbacks=None,
                 optimizers=(None, None), model_kind: str = "causal-lm", **trainer_kwargs):
        train_dataset, eval_dataset = as_dataset(train_dataset), as_dataset(eval_dataset, "eval_dataset")
        check_train_dataset(train_dataset)
        seed_run(args)
        self._staging_dir = None  # set while a checkpoint is written (see _save_checkpoint)
        self._heap_kept = bool(args.keep_freed_memory and (args.use_cpu or not torch.cuda.is_available())
                               and keep_freed_memory())
        model_name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
        init_kwargs = dict(args.model_init_kwargs or {})
        if model_kind == "causal-lm":
            model = loading.load_causal_lm(model, **init_kwargs)
        elif model_kind == "token-cls":
            model = loading.load_token_classifier(model, **init_kwargs)
        else:
            model = loading.load_sequence_classifier(model, convert_causal_lm=True, **init_kwargs)
        self.processing_class_ = processing_class = loading.load_tokenizer(
            processing_class, model=model_name or model, trust_remote_code=init_kwargs.get("trust_remote_code", False))
        if model_kind != "causal-lm" and getattr(model.config, "pad_token_id", None) is None:
            # sequence scores read the last non-pad token (a processor's tokenizer has the pad token)
            model.config.pad_token_id = getattr(processing_class, "tokenizer", processing_class).pad_token_id
        if args.gradient_checkpointing and hasattr(model, "config"):
            model.config.use_cache = False
        self.tag_model(model)
        peft_config = self.vision_parts(model, args, peft_config)
        model = loading.apply_peft(model, peft_config, args.gradient_checkpointing)
        check_liger(args, model)  # after PEFT: some adapters are refused with liger
        if args.lean_activations and not args.torch_compile:
            lean.make_lean(model)  # every trained module (a PPO critic's too); frozen copies made later inherit it
        else:
            lean.undo_lean(model)
        if args.torch_compile:
            products.disable(model)
        else:  # float32 CPU products through oneDNN where MKL's sgemm runs narrower (products.backend())
            products.enable(model)
        self.model_name = model_name
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        if args.dataloader_pin_memory and (args.use_cpu or not _accelerator_available()):
            args.dataloader_pin_memory = False  # pinned pages serve copies to an accelerator; torch warns without one
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, **trainer_kwargs)
        self.finite_guard = FiniteGuard(self)
        self.add_callback(self.finite_guard)
        self.run_threads = None  # the thread count of this run, when fitted to the machine's load
        if threads.fit_wanted() and (args.use_cpu or not _accelerator_available()):
            self.add_callback(FitThreadsCallback(self))

    def _clip_grad_norm(self, model):
        """transformers' clipping (max_grad_norm), through `guards.clip_grad_norm_exact` on one process or DDP
        without a loss scaler: the same gradients and norm without a pass over the gradients when none is clipped,
        and the norm handed to `FiniteGuard`, which then needs no pass of its own. Elsewhere (DeepSpeed, FSDP,
        float16 scaling, torch < 2.6) transformers' own."""
        from accelerate.utils import DistributedType

        plain = (self.accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU,
                                                       DistributedType.MULTI_GPU)
                 and getattr(self.accelerator, "scaler", None) is None
                 and not getattr(self, "_has_mixed_mesh_grads", lambda m: False)(model))
        norm = clip_grad_norm_exact(model.parameters(), self.args.max_grad_norm) if plain else None
        if norm is None:
            return super()._clip_grad_norm(model)
        self.finite_guard.grad_norm = norm
        return norm

    @staticmethod
    def vision_parts(model, args, peft_config):
        """A vision-language model's parts frozen as asked (freeze_vision_tower, freeze_multi_modal_projector),
        and `peft_config` kept to its language model (`models.vision.language_model_only_lora`)."""
        from posttrain.models import vision

        wanted = [n for n in ("freeze_vision_tower", "freeze_multi_modal_projector") if getattr(args, n, False)]
        if not multimodal.is_vision_model(model):
            if wanted:
                raise ValueError(f"{wanted[0]}=True, but {type(model).__name__} is a text-only model (no vision "
                                 f"tower); unset it")
            return peft_config
        vision.freeze_vision_parts(model, args.freeze_vision_tower, args.freeze_multi_modal_projector)
        return vision.language_model_only_lora(peft_config, model)

    def tag_model(self, model) -> None:
        """Tag the model `posttrain` and the trainer's own tag (`dpo`, `sft`, ...), as TRL tags its models, so that
        `save_model`'s model card and `push_to_hub` carry them."""
        if hasattr(model, "add_model_tags"):
            model.add_model_tags([tag for tag in dict.fromkeys(("posttrain", self._tag))])

    def create_optimizer(self, model=None):
        # transformers 5.0's create_optimizer takes no model (later 5.x releases: an optional one)
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        own_file_backed(p for group in optimizer.param_groups for p in group["params"])  # before the first write
        if self._heap_kept:
            make_adam_state(optimizer)
        return optimizer

    # ------------------------------------------------------------------ checkpoints and resuming
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """transformers' train, plus: output_dir is locked for the run (`output_dir_lock`); `True` resumes from
        the newest *complete* checkpoint; a fresh run refuses (or with overwrite_output_dir clears) an earlier
        run's checkpoints; posttrain's own state is restored."""
        with self.output_dir_lock():
            try:
                return self._train(resume_from_checkpoint, *args, **kwargs)
            finally:
                warn_still_running()

    def output_dir_lock(self):
        """`output_dir_lock(output_dir)` on the process that saves; nothing on the others."""
        return output_dir_lock(self.args.output_dir) if self.args.should_save else contextlib.nullcontext()

    def _train(self, resume_from_checkpoint=None, *args, **kwargs):
        folder = self.args.output_dir
        if resume_from_checkpoint is True:
            resume_from_checkpoint = latest_checkpoint(folder)
            if resume_from_checkpoint is None:
                raise ValueError(f"resume_from_checkpoint=True, but {folder} holds no complete checkpoint-N folder")
        if resume_from_checkpoint:
            if not os.path.isfile(os.path.join(resume_from_checkpoint, TRAINER_STATE)):
                raise ValueError(f"cannot resume from {resume_from_checkpoint}: it has no {TRAINER_STATE}, so it is "
                                 "not a complete checkpoint (the run was stopped while saving it?)")
            self.check_resume(resume_from_checkpoint)
            self.load_checkpoint_extras(resume_from_checkpoint)
        else:
            self._clear_earlier_run(folder)
        table = getattr(self, "completions_table", None)  # online trainers' sample log
        if table is not None and self.args.should_save:
            step = TrainerState.load_from_json(os.path.join(resume_from_checkpoint, TRAINER_STATE)).global_step \
                if resume_from_checkpoint else None
            table.start(resumed_step=step)
        return super().train(resume_from_checkpoint or None, *args, **kwargs)

    def _clear_earlier_run(self, folder: str):
        """A fresh run: never leave an earlier run's checkpoints where resume_from_checkpoint=True would find them."""
        earlier = [os.path.basename(path) for _, path, _ in checkpoint_folders(folder)]
        if earlier and not self.args.overwrite_output_dir:
            raise ValueError(f"output_dir {folder} holds checkpoints of an earlier run: {earlier}. Continue that run "
                             "with resume_from_checkpoint=True (or a checkpoint path), set overwrite_output_dir=True "
                             "to delete them and start afresh, or choose another output_dir")
        if self.args.should_save:
            if earlier:
                logger.warning(f"overwrite_output_dir=True: deleting the earlier run's checkpoints {earlier} "
                               f"in {folder}")
            for name in os.listdir(folder) if os.path.isdir(folder) else []:
                if name in earlier or name.startswith(STAGING_PREFIX + PREFIX_CHECKPOINT_DIR):
                    shutil.rmtree(os.path.join(folder, name))
        self.accelerator.wait_for_everyone()

    def _get_output_dir(self, trial) -> str:
        return self._staging_dir or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        """Write the checkpoint into tmp-checkpoint-N/ and rename it to checkpoint-N once every file is there.

        transformers writes checkpoint-N in place, so a kill mid-save leaves a folder that
        resume_from_checkpoint=True picks and fails on. There is no public hook for where a checkpoint
        goes: the run folder (`_get_output_dir`) is redirected while transformers saves.
        """
        self.finite_guard.check_weights(self.args)  # whatever asked for this save: never NaN weights
        run_dir = super()._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = os.path.join(run_dir, STAGING_PREFIX + name)
        written, final = os.path.join(staging, name), os.path.join(run_dir, name)
        if self.args.should_save and os.path.exists(staging):  # left by a save that was killed
            shutil.rmtree(staging)
        self.accelerator.wait_for_everyone()
        self._staging_dir = staging
        try:
            with explained_write_errors(staging), weights_as_loaded(self.accelerator.unwrap_model(self.model)):
                super()._save_checkpoint(model, trial)
                self.save_checkpoint_extras(written)
        finally:
            self._staging_dir = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            if self.state.best_model_checkpoint == written:  # this step is the best: name its final place
                self.state.best_model_checkpoint = final
                self.state.save_to_json(os.path.join(written, TRAINER_STATE))
            with explained_write_errors(written):  # the last file: what resuming checks the others by
                write_manifest(written, self.run_identity())
            replaced = staging + "-old"  # a tmp- name too: never resumed from, cleared by the next fresh run
            if os.path.exists(final):  # e.g. resumed from an earlier checkpoint of this run
                os.rename(final, replaced)
            os.rename(written, final)
            os.rmdir(staging)
            shutil.rmtree(replaced, ignore_errors=True)
            compat.rotate_checkpoints(self, run_dir)
        self.accelerator.wait_for_everyone()

    def _issue_warnings_after_load(self, load_result) -> None:
        # transformers' private hook, overridden because no public one sees the loaded keys: a weight tied to
        # another (lm_head.weight to the embeddings) is not saved, so it is "missing" on every resume, and
        # loaded all the same through its partner. Only other missing keys are worth a warning.
        tied: dict[int, list[str]] = defaultdict(list)
        for name, param in self.model.named_parameters(remove_duplicate=False):
            tied[id(param)].append(name)
        aliases = [name for names in tied.values() if len(names) > 1 for name in names]
        missing = [k for k in load_result.missing_keys
                   if not any(a == k or a.endswith("." + k) or k.endswith("." + a) for a in aliases)]
        if hasattr(load_result, "_replace"):  # torch's _IncompatibleKeys, a namedtuple
            load_result = load_result._replace(missing_keys=missing)
        super()._issue_warnings_after_load(load_result)

    def run_identity(self) -> dict:
        """The model (its name, and a digest of its trained parameters' names and shapes) and the `RUN_SETTINGS`
        (with the train_dataset's length and the number of processes) a checkpoint's manifest records."""
        import hashlib

        model = self.accelerator.unwrap_model(self.model)
        shapes = [f"{n}:{tuple(getattr(p, 'ds_shape', p.shape))}" for n, p in model.named_parameters() if p.requires_grad]
        settings = {n: getattr(self.args, n) for n in RUN_SETTINGS if hasattr(self.args, n)}
        settings = {n: v if isinstance(v, (int, float, str, bool, type(None))) else str(getattr(v, "value", v))
                    for n, v in settings.items()}
        settings["processes"] = self.accelerator.num_processes
        if self.train_dataset is not None and hasattr(self.train_dataset, "__len__"):
            settings["train_dataset rows"] = len(self.train_dataset)
        return {"model": {"name": self.model_name, "class": type(model).__name__, "trained_parameters": len(shapes),
                          "shapes": hashlib.sha256("\n".join(shapes).encode()).hexdigest()[:16]},
                "settings": settings}

    def check_resume(self, folder: str) -> None:
        """Before anything is loaded from checkpoint `folder`: its files against its manifest (`check_checkpoint`,
        on the main process; every process gets the verdict), then its model (another model's checkpoint is
        refused) and its settings (a change is said, setting by setting)."""
        problem = None
        if self.accelerator.is_main_process:
            try:
                check_checkpoint(folder)
            except CheckpointError as err:
                problem = str(err)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            problem = broadcast_object_list([problem])[0]
        if problem:
            raise CheckpointError(problem)
        run = (read_manifest(folder) or {}).get("run") or {}
        if not run:
            return
        now, then = self.run_identity(), run
        if then.get("model", {}).get("shapes") != now["model"]["shapes"]:
            was, new = then.get("model", {}), now["model"]
            raise CheckpointError(
                f"cannot resume from {folder}: it belongs to another model ({was.get('name')}, {was.get('class')}, "
                f"{was.get('trained_parameters')} trained tensors) than this run's ({new['name']}, {new['class']}, "
                f"{new['trained_parameters']} trained tensors; their names or shapes differ). Resume with the "
                "checkpoint's model, or start afresh")
        changed = [f"{n}: {then['settings'][n]!r} -> {v!r}" for n, v in now["settings"].items()
                   if n in then.get("settings", {}) and then["settings"][n] != v]
        if changed:
            logger.warning(f"resuming from {folder} with settings that differ from the run that wrote it ("
                           f"{'; '.join(changed)}): the resumed run is not the one that was interrupted")

    def _sync_callback(self) -> SyncRefModelCallback | None:
        return next((cb for cb in self.callback_handler.callbacks if isinstance(cb, SyncRefModelCallback)), None)

    def _state_file(self, folder: str) -> str:
        if self.accelerator.num_processes == 1:
            return os.path.join(folder, STATE_FILE)
        return os.path.join(folder, STATE_FILE.replace(".pt", f"_{self.accelerator.process_index}.pt"))

    def save_checkpoint_extras(self, folder: str):
        """Save what a step depends on beyond transformers' checkpoint: `checkpointed` attributes (each process)
        and a reference model that training moves (main process)."""
        from safetensors.torch import save_model

        state = {}
        for name in self.checkpointed:
            value = getattr(self, name, None)
            if isinstance(value, torch.Generator):
                state[name] = value.get_state()
            elif hasattr(value, "state_dict"):
                state[name] = value.state_dict()
            elif value is not None:
                state[name] = value
        os.makedirs(folder, exist_ok=True)
        torch.save(state, self._state_file(folder))
        sync = self._sync_callback()
        if sync is not None and self.args.should_save:
            save_model(self.accelerator.unwrap_model(sync.ref_model), os.path.join(folder, REF_MODEL_FILE))

    def load_checkpoint_extras(self, folder: str):
        """Restore what `save_checkpoint_extras` saved; checkpoints written before it existed are read as they are."""
        from safetensors.torch import load_model

        path = self._state_file(folder)
        if not os.path.exists(path):  # saved by a run with another number of processes
            path = os.path.join(folder, STATE_FILE)
        state = torch.load(path, weights_only=True) if os.path.exists(path) else {}
        for name, value in state.items():
            current = getattr(self, name, None)
            if isinstance(current, torch.Generator):
                current.set_state(value)
            elif hasattr(current, "load_state_dict"):
                current.load_state_dict(value)
            else:
                setattr(self, name, value)
        sync, ref_path = self._sync_callback(), os.path.join(folder, REF_MODEL_FILE)
        if sync is not None:
            if not os.path.exists(ref_path):
                logger.warning(f"{folder} has no {REF_MODEL_FILE}: the synced reference model restarts from its "
                               "initial weights, so the resumed run will differ from an uninterrupted one")
            else:
                ref = self.accelerator.unwrap_model(sync.ref_model)
                load_model(ref, ref_path, device=str(next(ref.parameters()).device))

    # ------------------------------------------------------------------ reference policy
    def make_reference(self, ref_model, needed: bool = True):
        """The frozen reference policy: given, or a frozen copy; None when a PEFT model can disable its adapter."""
        if not needed:
            return None
        policy = self.accelerator.unwrap_model(self.model)
        peft = loading.is_peft_model(policy)
        if ref_model is not None and (ref_model is policy or (peft and ref_model is policy.get_base_model())):
            # freezing the shared object would freeze the policy too: treat it as "no reference given"
            logger.info("ref_model is the policy model itself: the reference is "
                        + ("the policy with its adapter disabled" if peft else "a frozen copy of its initial weights"))
            ref_model = None
        if ref_model is None and peft:
            return None  # reference = the same weights with the adapter disabled: no second copy
        if ref_model is None:
            ref_model = loading.frozen_copy(policy)
        else:
            load = loading.load_vision_lm if multimodal.is_vision_model(policy) else loading.load_causal_lm
            ref_model = load(ref_model, **(self.args.model_init_kwargs or {}))
            ref_model.requires_grad_(False).eval()
            if not self.args.torch_compile:
                products.enable(ref_model)
        return loading.prepare_frozen(self.accelerator, ref_model)  # sharded like the policy under ZeRO-3 and FSDP2

    def reference_context(self, ref_model):
        """Context in which `self.model` acts as the reference (PEFT: adapter disabled), when ref_model is None."""
        import contextlib

        if ref_model is None and loading.is_peft_model(self.model):
            return self.accelerator.unwrap_model(self.model).disable_adapter()
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ evaluation data
    def prepare_eval_dataset(self, dataset, name: str = "eval"):
        """Turn a raw evaluation dataset into what the collator reads, as the trainer does at construction.

        `evaluate(eval_dataset=...)` calls it for data given after construction; a dataset that is
        already prepared must come back unchanged. The default returns the data as it is.
        """
        return dataset

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """transformers' evaluate, plus: a raw dataset (or a list of row dicts, or a dict of them: one
        `eval_<name>_loss` each) given here is prepared as the eval data given at construction."""
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = as_dataset(eval_dataset, "eval_dataset")
            refuse_transforms(eval_dataset)
            if isinstance(eval_dataset, Mapping):  # as transformers does, but each dataset is prepared once
                metrics = {}
                for name, data in eval_dataset.items():
                    with errors_named(f"{EVAL_SET}[{name!r}]"):
                        data = self.prepare_eval_dataset(data, f"eval[{name}]")
                    metrics.update(super().evaluate(data, ignore_keys, f"{metric_key_prefix}_{name}"))
                return metrics
            with errors_named(EVAL_SET):
                eval_dataset = self.prepare_eval_dataset(eval_dataset)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    # ------------------------------------------------------------------ saving: model card
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """transformers' save_model, plus a model card (README.md) beside the weights, as TRL writes one."""
        with explained_write_errors(output_dir or self.args.output_dir):
            super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            folder = output_dir or self.args.output_dir
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "README.md"), "w") as f:
                f.write(self.model_card(os.path.basename(os.path.normpath(folder))))

    def create_model_card(self, model_name: str | None = None, **kwargs) -> None:
        """What `push_to_hub` calls: posttrain's model card (see `model_card`) in output_dir, not transformers'."""
        if self.is_world_process_zero():
            folder = self.args.output_dir
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "README.md"), "w") as f:
                f.write(self.model_card(model_name or os.path.basename(os.path.normpath(folder))))

    def model_card(self, model_name: str) -> str:
        """The model card's text: YAML metadata (base model, tags, dataset), the method, the hyperparameters
        that shape the result, library versions and the method's citation."""
        import datasets
        import transformers
        import yaml

        import posttrain

        model = self.accelerator.unwrap_model(self.model)
        tags = list(dict.fromkeys(["generated_from_trainer", *(getattr(model, "model_tags", None) or []),
                                   "posttrain", self._tag]))
        dataset = getattr(getattr(self.train_dataset, "info", None), "dataset_name", None)
        meta = {"base_model": self.model_name, "library_name": "transformers", "model_name": model_name,
                "tags": tags, **({"datasets": [dataset]} if dataset else {})}
        args = self.args
        names = ("learning_rate", "lr_scheduler_type", "num_train_epochs", "max_steps", "per_device_train_batch_size",
                 "gradient_accumulation_steps", "seed", "beta", "loss_type", "max_length", "num_generations")
        hyper = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
        if (args.max_steps or 0) > 0:  # max_steps overrides num_train_epochs: listing both misleads
            hyper.pop("num_train_epochs", None)
        else:
            hyper.pop("max_steps", None)
        hyper["lr_scheduler_type"] = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
        if getattr(self, "vision", False):  # a vision-language model: the hub's task and what of it was trained
            meta["pipeline_tag"] = "image-text-to-text"
            meta["tags"].append("vision-language")
            hyper.update({n: getattr(args, n) for n in ("freeze_vision_tower", "freeze_multi_modal_projector")
                          if hasattr(args, n)})
        base = _model_reference(self.model_name)
        versions = {"posttrain": getattr(posttrain, "__version__", "unknown"), "transformers": transformers.__version__,
                    "torch": torch.__version__, "datasets": datasets.__version__}
        if importlib.util.find_spec("peft") is not None:
            import peft

            versions["peft"] = peft.__version__
        lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "", f"# Model Card for {model_name}", "",
                 f"This model is a fine-tuned version of {base}" + (f" on the {dataset} dataset" if dataset else "")
                 + f". It was trained with posttrain's `{type(self).__name__}` ({self._name}).", "",
                 "## Training hyperparameters", "", *(f"- {k}: {v}" for k, v in hyper.items()), "",
                 "## Framework versions", "", *(f"- {k}: {v}" for k, v in versions.items()), ""]
        if self._citation:
            lines += ["## Citations", "", f"Cite {self._name} as:", "", "```bibtex", self._citation.strip(), "```", ""]
        return "\n".join(lines)

    # ------------------------------------------------------------------ metrics
    def record(self, metrics: dict[str, Any], mode: str | None = None):
        """Buffer metrics (floats or tensors); `log` averages them over the steps since the last log."""
        mode = mode or ("train" if self.model.training else "eval")
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().float()
                value = self.accelerator.gather_for_metrics(value.reshape(1) if value.dim() == 0 else value).mean().item()
            self._metrics[mode][name].append(float(value))

    def recorded_metrics(self, mode: str = "train") -> dict[str, list[float]]:
        """What `record` buffered since the last `log`, name -> values (a copy); `log` reports their means
        and `state.log_history` keeps what was logged."""
        return {name: list(values) for name, values in self._metrics[mode].items()}

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        prefix = "eval_" if mode == "eval" else ""
        for name, values in self._metrics[mode].items():
            if values:
                logs[prefix + name] = sum(values) / len(values)
        self._metrics[mode].clear()
        super().log(logs, start_time)


@contextlib.contextmanager
def weights_as_loaded(model):
    """Checkpoints of a model whose weight names transformers converts when it loads a checkpoint (LLaVA and the
    other vision-language models: `language_model.model.*` on disk, `model.language_model.*` in memory) are
    written under the in-memory names: resuming loads a checkpoint's state dict as it is, without the conversion,
    so the names `save_pretrained` writes by default would match nothing. The final model keeps the on-disk names."""
    plain = not getattr(model, "_checkpoint_conversion_mapping", None) and not multimodal.is_vision_model(model)
    if plain or loading.is_peft_model(model) or "save_pretrained" in vars(model):
        yield
        return
    model.save_pretrained = lambda *args, **kwargs: type(model).save_pretrained(
        model, *args, **{**kwargs, "save_original_format": False})
    try:
        yield
    finally:
        del model.save_pretrained


def _model_reference(name: str | None) -> str:
    """The base model as the model card names it: a hub link for a hub id, plain text for a built-in
    model or a local folder (a link to huggingface.co/<local path> leads nowhere)."""
    if not name:
        return "a base model"
    from posttrain.models.loading import BUILTIN_PREFIX

    local = name.startswith(BUILTIN_PREFIX) or os.path.isabs(name) or name.startswith((".", "~")) or \
        os.path.exists(name) or name.count("/") != 1
    return f"`{name}`" if local else f"[{name}](https://huggingface.co/{name})"


def _accelerator_available() -> bool:
    """Whether torch sees an accelerator (CUDA, XPU, MPS, ...) to which pinned memory would be copied."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return accelerator.is_available()
    return torch.cuda.is_available()
