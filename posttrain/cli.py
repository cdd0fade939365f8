"""`posttrain <command> [--config file.yaml] [--field value ...]`: train from the command line.

Each command is one entry of `COMMANDS`, a function `run(script_args, config)` that builds
and returns a trainer (or does its work itself and returns None); `run` parses the flags,
trains (resuming from `--resume_from_checkpoint` when given), saves the model to `output_dir`
and returns the trainer; `main`, the console script, returns the exit status instead. The
flags come from two dataclasses named where the command registers (`command`): the script
arguments (the model flags of `ModelArguments`, which feed `model_init_kwargs` and
`peft_config`, and the dataset) and the trainer's config, every field of which is a flag. Values come from, lowest to
highest: the dataclass defaults, the YAML file given with `--config` (flat `field: value` pairs,
type-checked against the fields), the command line. With `--accelerate_config` the command runs
again under `accelerate launch` (`launch_command`).

A trainer's command is one row of `TRAINERS` (its trainer class, how to build it, its script
arguments, its help); any other command registers itself:

    @command("env", config=None, script_args=None, help="Print the versions.")
    def run_env(script_args, config):
        ...
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import importlib.util
import json
import os
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelArguments:
    """Which model to train and how to load it; `--use_peft` trains a LoRA adapter instead of every weight
    (the model flags of TRL's `ModelConfig`). They feed the trainer's `model_init_kwargs` and `peft_config`."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Model to train: a built-in name (posttrain/tiny-qwen2, "
                                        "posttrain/smollm2-135m-instruct, ...) or a local folder."})
    dtype: typing.Literal["auto", "float32", "bfloat16", "float16"] | None = field(
        default=None, metadata={"help": "Weights' dtype when loading: auto (as saved in the checkpoint), "
                                        "float32, bfloat16 or float16. Default: float32. Goes into "
                                        "model_init_kwargs."})
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Attention kernel of transformers ('eager', 'sdpa', 'flash_attention_2', "
                                        "...). Default: transformers' choice. Goes into model_init_kwargs."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run the modelling code a model folder ships (auto_map). Off by default: "
                                         "that code runs in this process with your permissions."})
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter (needs `pip install peft`); "
                                                            "the output folder then holds the adapter."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (the update is scaled by "
                                                          "lora_alpha / lora_r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA branch."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Module names to adapt (e.g. q_proj v_proj, or all-linear). Default: "
                                        "peft's choice for the architecture."})
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Modules trained in full and saved with the adapter (e.g. lm_head)."})
    lora_task_type: str | None = field(
        default=None, metadata={"help": "peft task type. Default: SEQ_CLS for `posttrain reward` (so the score "
                                        "head is trained), CAUSAL_LM otherwise."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA: scale by "
                                                              "lora_alpha / sqrt(lora_r)."})
    use_dora: bool = field(default=False, metadata={"help": "DoRA: weight-decomposed LoRA."})


@dataclass
class ScriptArguments(ModelArguments):
    """What to train on: the model flags and the dataset (shared by every training command)."""

    dataset_name: str | None = field(
        default=None, metadata={"help": "A built-in dataset (zen, zen-chat/preference, reverse, add-chat, ...), "
                                        "a local .json/.jsonl/.csv/.parquet file, or a local dataset folder."})
    dataset_config: str | None = field(
        default=None, metadata={"help": "Configuration name for a dataset folder with several configurations."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(
        default="test", metadata={"help": "Split to evaluate on (read only when eval_strategy is not 'no')."})


def peft_config(script_args: ModelArguments, task_type: str = "CAUSAL_LM"):
    """The `peft.LoraConfig` the LoRA flags describe, or None without --use_peft."""
    if not script_args.use_peft:
        return None
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise ImportError("--use_peft needs the peft package: pip install 'posttrain[peft]'") from err
    target = script_args.lora_target_modules
    return LoraConfig(r=script_args.lora_r, lora_alpha=script_args.lora_alpha, lora_dropout=script_args.lora_dropout,
                      target_modules=target[0] if target == ["all-linear"] else target,
                      modules_to_save=script_args.lora_modules_to_save,
                      task_type=script_args.lora_task_type or task_type, use_rslora=script_args.use_rslora,
                      use_dora=script_args.use_dora)


def tokenizer(script_args: ModelArguments, name: str | None = None):
    """The tokenizer to pass as `processing_class`: `name` (default: the model's) as the trainer loads it;
    loaded here only with --trust_remote_code, which a tokenizer that ships its own code needs as well."""
    name = name or script_args.model_name_or_path
    if not script_args.trust_remote_code or name is None:
        return name
    from transformers import AutoTokenizer

    from posttrain.models import loading

    return loading.ensure_pad_token(AutoTokenizer.from_pretrained(loading.resolve(name), trust_remote_code=True))


_LOAD_FLAGS = ("dtype", "attn_implementation", "trust_remote_code")  # model flags that go into model_init_kwargs


def _merge_model_init_kwargs(parser: argparse.ArgumentParser, script_args: ModelArguments, config):
    """Put --dtype, --attn_implementation and --trust_remote_code into `config.model_init_kwargs`; a flag that
    contradicts a key the config's model_init_kwargs already holds is a usage error."""
    kwargs = dict(config.model_init_kwargs or {})
    for name in _LOAD_FLAGS:
        value = getattr(script_args, name)
        if value is None or value is False:
            continue
        if name in kwargs and kwargs[name] != value:
            parser.error(f"--{name} {value} contradicts model_init_kwargs {{{name!r}: {kwargs[name]!r}}}; "
                         "give one of them")
        kwargs[name] = value
    config.model_init_kwargs = kwargs or config.model_init_kwargs


# ---------------------------------------------------------------------------- command registry

COMMANDS: dict[str, Callable] = {}


def command(name: str, config: str | None, script_args: type | None = ScriptArguments, help: str = ""):
    """Register `run(script_args, config)` as `posttrain <name>`, with its config class ("module:Class",
    imported when the command runs) and script-argument class (None: the command takes no flags)."""
    def register(fn):
        fn.config_path, fn.script_args_class, fn.help = config, script_args, help or (fn.__doc__ or "").strip()
        COMMANDS[name] = fn
        return fn
    return register


class DatasetError(ValueError):
    """A dataset argument that cannot be loaded; the message names the file, the line and what is wrong."""


def load_dataset_arg(name: str, split: str = "train", config: str | None = None):
    """A `datasets.Dataset` from a built-in name, a local data file or a local dataset folder.

    Nothing is fetched from the hub: anything else raises a DatasetError that says what is accepted.
    """
    from posttrain.tasks.builtin import builtin_names, load_builtin

    try:
        return load_builtin(name, split)
    except KeyError:
        pass
    path = os.path.expanduser(name)
    formats = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
    if os.path.isfile(path):
        import datasets

        suffix = os.path.splitext(path)[1].lower()
        if suffix not in formats:
            raise DatasetError(f"dataset file {name!r}: unknown extension {suffix!r}; use one of {sorted(formats)}")
        if split != "train":
            raise DatasetError(f"dataset file {name!r} holds a single split, 'train'; there is no split {split!r} "
                               "(point the command at a folder with one file per split to evaluate)")
        check_data_file(path, suffix)
        try:
            return datasets.load_dataset(formats[suffix], data_files=path, split="train")
        except Exception as err:  # what the checks above do not catch, e.g. a corrupt parquet file
            raise DatasetError(f"dataset file {name!r} cannot be read as {formats[suffix]}: "
                               f"{type(err).__name__}: {err}") from err
    if os.path.isdir(path):
        import datasets

        if any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "dataset_info.json", "state.json")):
            data = datasets.load_from_disk(path)
            if isinstance(data, datasets.DatasetDict):
                if split not in data:
                    raise DatasetError(f"dataset folder {name!r} has splits {sorted(data)}, not {split!r}")
                return data[split]
            if split != "train":
                raise DatasetError(f"dataset folder {name!r} holds a single split; there is no split {split!r}")
            return data
        try:  # a folder of data files, e.g. train.jsonl + test.jsonl
            return datasets.load_dataset(path, config, split=split)
        except ValueError as err:
            raise DatasetError(f"dataset folder {name!r}: {err}") from err
        except Exception as err:  # most likely a faulty file: find it and its line
            for root, _, files in os.walk(path):
                for file in sorted(files):
                    if (suffix := os.path.splitext(file)[1].lower()) in formats:
                        check_data_file(os.path.join(root, file), suffix)
            raise DatasetError(f"dataset folder {name!r} cannot be loaded: {type(err).__name__}: {err}") from err
    raise DatasetError(
        f"dataset {name!r} is not a built-in dataset, a local file or a local folder (datasets are not "
        f"downloaded from the hub here: fetch it where you have a network, save it with "
        f"`dataset.save_to_disk(folder)`, and pass the folder). Built-in names: {', '.join(builtin_names())}")


def check_data_file(path: str, suffix: str):
    """Raise a DatasetError naming the line of the first fault of a local data file: empty, not UTF-8
    (text formats), a JSON line that does not parse or is not an object, or a column whose JSON type
    changes between lines. The `datasets` loaders report these as tracebacks without a line."""
    if os.path.getsize(path) == 0:
        raise DatasetError(f"dataset file {path!r} is empty")
    if suffix == ".parquet":
        return
    json_lines = suffix == ".jsonl"
    if suffix == ".json":  # one JSON document (a list of rows, or an object of columns), or JSON lines
        text = "".join(line for _, line in _utf8_lines(path))
        try:
            json.loads(text)
            return
        except json.JSONDecodeError as err:
            first = next((line for line in text.splitlines() if line.strip()), "")
            try:
                json.loads(first)
            except json.JSONDecodeError:
                if first:
                    raise DatasetError(f"dataset file {path!r}, line {err.lineno}, column {err.colno}: "
                                       f"not valid JSON: {err.msg}") from None
            json_lines = True
    blank = True
    column_types: dict[str, tuple[str, int]] = {}  # column -> (JSON type, first line that has it)
    for number, line in _utf8_lines(path):
        if not line.strip():
            continue
        blank = False
        if not json_lines:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"dataset file {path!r}, line {number}, column {err.colno}: not valid JSON: "
                               f"{err.msg} (each line must be one JSON object)") from None
        if not isinstance(row, dict):
            raise DatasetError(f"dataset file {path!r}, line {number}: expected a JSON object "
                               f'{{"column": value, ...}}, got {type(row).__name__}')
        for column, value in row.items():
            if value is None:
                continue
            kind = "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__
            seen = column_types.setdefault(column, (kind, number))
            if seen[0] != kind:
                raise DatasetError(f"dataset file {path!r}, line {number}: column {column!r} is a {kind} here "
                                   f"but a {seen[0]} on line {seen[1]}; a column holds one type")
    if blank:
        raise DatasetError(f"dataset file {path!r} holds only blank lines")


def _utf8_lines(path: str):
    """(line number, text) of each line of a UTF-8 file; a DatasetError at the first bad byte."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DatasetError(f"dataset file {path!r}, line {number}: byte {err.start + 1} of the line "
                                   f"({raw[err.start:err.start + 1]!r}) is not UTF-8; save the file as UTF-8") from None


def load_datasets(script_args: ScriptArguments, config) -> tuple[Any, Any]:
    """(train, eval) datasets for a training command; eval only when `config.eval_strategy` is not 'no'."""
    train = load_dataset_arg(script_args.dataset_name, script_args.dataset_train_split, script_args.dataset_config)
    evaluation = None
    if str(getattr(config, "eval_strategy", "no")) not in ("no", "IntervalStrategy.NO"):
        evaluation = load_dataset_arg(script_args.dataset_name, script_args.dataset_test_split,
                                      script_args.dataset_config)
    return train, evaluation


# ---- online RL commands (GRPO, RLOO, PPO): the rewards come from --reward_funcs and/or --reward_model_path

@dataclass
class OnlineScriptArguments(ScriptArguments):
    """Script arguments of the online RL commands: model, dataset and reward functions."""

    reward_funcs: list[str] | None = field(
        default=None, metadata={"help": "Reward functions: built-in names (exact_match, digit_match, final_answer), "
                                        "'module:function' paths, or reward-model names/paths. "
                                        "--reward_model_path adds a reward model. A 'module:function' is "
                                        "imported and run in this process: it executes that module's code, "
                                        "so name only your own or trusted modules."})


def build_online(trainer_class, script_args, config):
    """A trainer for `posttrain grpo|rloo|ppo`: rewards from --reward_funcs plus --reward_model_path. With the
    classic --sft_model_path (rloo, ppo) the policy starts from it and the tokenizer comes from
    --model_name_or_path, as the classic TRL scripts loaded them."""
    train, evaluation = load_datasets(script_args, config)
    rewards = list(script_args.reward_funcs or []) + ([config.reward_model_path] if config.reward_model_path else [])
    model = getattr(config, "sft_model_path", None) or script_args.model_name_or_path
    return trainer_class(model=model, reward_funcs=rewards, args=config, train_dataset=train,
                         eval_dataset=evaluation, processing_class=tokenizer(script_args, script_args.model_name_or_path
                                                                             or model),
                         peft_config=peft_config(script_args))


# ---- offline commands (SFT, reward model, DPO, BCO, KTO): demonstrations, preference or unpaired datasets

def build_offline(trainer_class, script_args, config, task_type: str = "CAUSAL_LM"):
    """A trainer for `posttrain sft|reward|dpo|bco|kto`: model and datasets from the script arguments."""
    train, evaluation = load_datasets(script_args, config)
    return trainer_class(script_args.model_name_or_path, args=config, train_dataset=train, eval_dataset=evaluation,
                         processing_class=tokenizer(script_args), peft_config=peft_config(script_args, task_type))


def build_reward(trainer_class, script_args, config):
    """`build_offline` with a sequence-classification adapter (--use_peft trains the score head too)."""
    return build_offline(trainer_class, script_args, config, task_type="SEQ_CLS")


# command: (trainer "module:Class", built by, script arguments, help); the config class is the trainer's
# namesake (DPOTrainer: DPOConfig, in the same module)
TRAINERS = {
    "sft": ("posttrain.trainers.sft:SFTTrainer", build_offline, ScriptArguments,
            "Supervised fine-tuning on demonstrations."),
    "grpo": ("posttrain.trainers.grpo:GRPOTrainer", build_online, OnlineScriptArguments,
             "GRPO: online RL with group-relative advantages."),
    "rloo": ("posttrain.trainers.rloo:RLOOTrainer", build_online, OnlineScriptArguments,
             "RLOO: REINFORCE with a leave-one-out baseline."),
    "ppo": ("posttrain.trainers.ppo:PPOTrainer", build_online, OnlineScriptArguments,
            "PPO with a critic (value head or separate value model)."),
    "reward": ("posttrain.trainers.reward:RewardTrainer", build_reward, ScriptArguments,
               "Reward model (Bradley-Terry) on preference pairs."),
    "dpo": ("posttrain.trainers.dpo:DPOTrainer", build_offline, ScriptArguments,
            "DPO and its pairwise variants on preference pairs."),
    "bco": ("posttrain.trainers.bco:BCOTrainer", build_offline, ScriptArguments,
            "BCO on unpaired (or paired) feedback."),
    "kto": ("posttrain.trainers.kto:KTOTrainer", build_offline, ScriptArguments,
            "KTO on unpaired (or paired) feedback."),
}


def _imported(path: str):
    """The object a "module:Name" path names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _trainer_command(trainer: str, build: Callable) -> Callable:
    def run_trainer(script_args, config):
        return build(_imported(trainer), script_args, config)
    return run_trainer


for _name, (_trainer, _build, _script_args, _help) in TRAINERS.items():
    command(_name, config=_trainer.replace("Trainer", "Config"), script_args=_script_args,
            help=_help)(_trainer_command(_trainer, _build))


OPTIONAL_ENGINES = ("deepspeed", "peft", "liger-kernel", "vllm", "bitsandbytes", "wandb", "trackio")


def _version(package: str) -> str:
    import importlib.metadata as metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _accelerate_default_config() -> str:
    """The config `accelerate config` saved (which `accelerate launch` uses by default): its path and
    distributed_type, or "none"."""
    from accelerate.commands.config import config_args

    path = config_args.default_config_file  # read now, so that a test can point it elsewhere
    if not os.path.isfile(path):
        return "none"
    try:
        kind = config_args.load_config_from_file(path).distributed_type
    except Exception as err:  # a file accelerate itself would refuse: say so rather than fail `env`
        return f"{path} (unreadable: {type(err).__name__}: {err})"
    return f"{path} (distributed_type: {str(kind).split('.')[-1]})"


@command("env", config=None, script_args=None, help="Print the versions, accelerate config, optional engines and "
                                                    "hardware posttrain sees.")
def run_env(script_args=None, config=None):
    import platform

    import torch

    import posttrain

    rows = [("posttrain", posttrain.__version__), ("python", platform.python_version()),
            ("platform", platform.platform())]
    for package in ("torch", "transformers", "datasets", "accelerate"):
        rows.append((package, _version(package)))
    rows.append(("accelerate config", _accelerate_default_config()))
    for package in OPTIONAL_ENGINES:
        rows.append((package, _version(package)))
    rows.append(("CPU count", str(os.cpu_count())))
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        rows.append(("memory", f"{pages * page_size / 2**30:.1f} GiB"))
    except (ValueError, OSError, AttributeError):
        rows.append(("memory", "unknown"))
    cuda = torch.cuda.is_available()
    rows.append(("CUDA available", f"yes ({torch.cuda.get_device_name(0)})" if cuda else "no"))
    bf16 = torch.cuda.is_bf16_supported() if cuda else torch.backends.mkldnn.is_available() and \
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    rows.append(("bf16 supported", "yes" if bf16 else "no"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return None


# ---------------------------------------------------------------------------- flags from dataclasses

_TRUE, _FALSE, _NONE = ("true", "yes", "1", "on"), ("false", "no", "0", "off"), ("none", "null")


def _parse_bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


def _members(tp) -> list:
    """The alternatives of a Union (X | Y | None) or [tp]."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return list(typing.get_args(tp))
    return [tp]


def _scalar(tp) -> Callable[[str], Any] | None:
    """A str -> value converter for one non-union, non-list type; None when it cannot be given as text."""
    origin = typing.get_origin(tp)
    if tp is bool:
        return _parse_bool
    if tp in (int, float, str):
        return tp
    if tp is dict or origin is dict:
        def as_dict(text):
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError(text)
            return value
        return as_dict
    if origin is typing.Literal:
        choices = typing.get_args(tp)

        def literal(text):
            for choice in choices:
                if str(choice).lower() == text.lower():
                    return choice
            raise ValueError(text)
        return literal
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp  # the config accepts the member or its string value
    if tp is Any:
        def anything(text):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                return text
        return anything
    return None


@dataclass
class _Flag:
    name: str
    convert: Callable[[str], Any]  # one command-line word -> value (raises ValueError)
    type_name: str
    type: Any  # the field's annotation, to check values that arrive already typed (YAML)
    is_bool: bool = False
    is_list: bool = False


def _flag(name: str, tp) -> _Flag | None:
    members = _members(tp)
    nullable = type(None) in members
    members = [m for m in members if m is not type(None)]
    list_member = next((m for m in members if typing.get_origin(m) is list or m is list), None)
    element = (typing.get_args(list_member) or (str,))[0] if list_member is not None else None
    ordered = sorted((m for m in members if m is not list_member), key=lambda m: m is str)  # str last
    converters = [c for c in map(_scalar, ordered) if c is not None]
    if list_member is not None:
        element_convert = next((c for c in map(_scalar, _members(element)) if c is not None), str)
    if not converters and list_member is None:
        return None

    def convert(text: str):
        if nullable and text.lower() in _NONE:
            return None
        if list_member is not None and text.startswith("["):
            return [element_convert(str(v)) if not isinstance(v, str) else element_convert(v)
                    for v in json.loads(text)]
        for c in converters:
            try:
                return c(text)
            except (ValueError, json.JSONDecodeError):
                continue
        if list_member is not None:
            return element_convert(text)  # one word given for a list field
        raise ValueError(text)

    names = [getattr(m, "__name__", str(m)) for m in members] + (["None"] if nullable else [])
    convert.__name__ = " | ".join(names)  # argparse names the type in "invalid ... value" errors
    return _Flag(name, convert, convert.__name__, tp, is_bool=members == [bool], is_list=list_member is not None)


def _flags(cls) -> dict[str, _Flag]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that cannot be resolved: fall back to the raw ones
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
    flags = {}
    for f in dataclasses.fields(cls):
        if f.init and not f.name.startswith("_"):
            flag = _flag(f.name, hints.get(f.name, f.type))
            if flag is not None:
                flags[f.name] = flag
    return flags


def _add_flags(parser: argparse.ArgumentParser, cls, flags: dict[str, _Flag], title: str):
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        flag = flags.get(f.name)
        if flag is None:
            continue
        names = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        help_text = f.metadata.get("help", "")
        if f.default is not dataclasses.MISSING:
            help_text += f" (default: {f.default!r})"
        kwargs = dict(dest=f.name, type=flag.convert, default=argparse.SUPPRESS, help=help_text.replace("%", "%%"))
        if flag.is_bool:
            kwargs.update(nargs="?", const=True, metavar="true|false")
        elif flag.is_list:
            kwargs.update(nargs="+")
        group.add_argument(*names, **kwargs)


def _matches(value, tp) -> bool:
    """Whether a YAML value (already a Python object) fits annotation `tp`; types we cannot check pass
    and are left to the config's own `__post_init__`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, member) for member in args)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:  # YAML `true` is a bool, which Python counts as an int
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is list or origin is list:
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value if args)
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    if origin is typing.Literal:
        return value in args
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return isinstance(value, tp) or value in [member.value for member in tp]
    return True


def _yaml_value(flag: _Flag, value):
    """A YAML value for `flag`'s field, or ValueError. YAML values arrive typed; strings for non-string
    fields (e.g. `1e-5`) go through the flag's converter, and one value for a list field becomes a list."""
    if isinstance(value, str):
        value = flag.convert(value)
    elif isinstance(value, list) and flag.is_list:
        value = [flag.convert(v) if isinstance(v, str) else v for v in value]
    if _matches(value, flag.type):
        return value
    if flag.is_list and _matches([value], flag.type):
        return [value]
    raise ValueError(value)


def _load_yaml(path: str, parser: argparse.ArgumentParser) -> dict:
    import yaml

    try:
        with open(path) as handle:
            data = yaml.safe_load(handle) or {}
    except OSError as err:
        parser.error(f"cannot read --config file: {err}")
    except yaml.YAMLError as err:
        parser.error(f"{path} is not valid YAML: {err}")
    if not isinstance(data, dict):
        parser.error(f"{path} must hold `field: value` pairs, got {type(data).__name__}")
    return data


def _config_class(fn):
    return None if fn.config_path is None else _imported(fn.config_path)


def parse(name: str, argv: list[str]) -> tuple[Any, Any]:
    """(script_args, config) for command `name` from its flags and optional --config YAML file."""
    fn = COMMANDS[name]
    classes = [c for c in (fn.script_args_class, _config_class(fn)) if c is not None]
    flags = [_flags(c) for c in classes]
    for earlier in flags[:-1]:  # a field of both (a model flag the config also has): the config's flag sets it
        for key in set(earlier) & set(flags[-1]):
            del earlier[key]
    parser = _Parser(prog=f"posttrain {name}", description=fn.help)
    parser.add_argument("--config", help="YAML file of `field: value` pairs; command-line flags override it.")
    if fn.config_path is not None:
        parser.add_argument("--accelerate_config", default=argparse.SUPPRESS, help="Run under `accelerate launch` with this config: a file, "
                            f"or a name of the shipped ones ({', '.join(accelerate_config_names())}). "
                            "Launcher flags, passed to accelerate: " + ", ".join(f"--{f}" for f in LAUNCH_FLAGS) + ".")
        for launch_flag in LAUNCH_FLAGS:
            parser.add_argument(f"--{launch_flag}", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for cls, cls_flags in zip(classes, flags):
        if issubclass(cls, ModelArguments) and cls is not ModelArguments:  # the model flags in a group of their own
            model_fields = {f.name for f in dataclasses.fields(ModelArguments)}
            _add_flags(parser, ModelArguments, {k: v for k, v in cls_flags.items() if k in model_fields},
                       ModelArguments.__name__)
            cls_flags = {k: v for k, v in cls_flags.items() if k not in model_fields}
        _add_flags(parser, cls, cls_flags, cls.__name__)
    given = vars(parser.parse_args(argv))
    launch = {key: given.pop(key) for key in ("accelerate_config", *LAUNCH_FLAGS) if key in given}
    if launch:  # run() launches before parsing; here they are only checked, and mean nothing without the config
        if "accelerate_config" not in launch:
            parser.error(f"{', '.join('--' + k for k in launch)} is a launcher flag: it needs --accelerate_config "
                         "(e.g. --accelerate_config multi_gpu --num_processes 2)")
        _accelerate_config_path(parser, launch["accelerate_config"])
    values: list[dict] = [{} for _ in classes]
    if path := given.pop("config", None):
        for key, value in _load_yaml(path, parser).items():
            owner = next((i for i, fl in enumerate(flags) if key in fl), None)
            if owner is None:
                parser.error(f"{path}: unknown field {key!r} for `posttrain {name}`")
            flag = flags[owner][key]
            try:
                values[owner][key] = _yaml_value(flag, value)
            except (ValueError, json.JSONDecodeError):
                parser.error(f"{path}: {key}: expected {flag.type_name}, got {type(value).__name__} {value!r}")
    for key, value in given.items():
        owner = next(i for i, fl in enumerate(flags) if key in fl)
        values[owner][key] = value
    built = []
    for cls, kwargs in zip(classes, values):
        try:
            built.append(cls(**kwargs))
        except (ValueError, TypeError) as err:
            parser.error(f"invalid {cls.__name__}: {err}")
    script_args = built[0] if fn.script_args_class is not None else None
    config = built[-1] if fn.config_path is not None else None
    if isinstance(script_args, ScriptArguments) and config is not None:
        required = ["dataset_name"] + ([] if getattr(config, "sft_model_path", None) else ["model_name_or_path"])
        missing = [f"--{k}" for k in required if getattr(script_args, k) is None]
        if missing:
            parser.error(f"the following arguments are required: {', '.join(missing)}")
        _merge_model_init_kwargs(parser, script_args, config)
        if script_args.use_peft and importlib.util.find_spec("peft") is None:
            parser.error("--use_peft needs the peft package: pip install 'posttrain[peft]'")
    if isinstance(script_args, OnlineScriptArguments):
        if not script_args.reward_funcs and not getattr(config, "reward_model_path", None):
            parser.error("no reward: give --reward_funcs (built-in names such as digit_match, module:function "
                         "paths, or reward-model paths) and/or --reward_model_path")
        for spec in script_args.reward_funcs or []:
            if problem := _reward_spec_problem(spec):
                parser.error(f"--reward_funcs: {problem}")
    if config is not None and hasattr(config, "resume_from_checkpoint"):
        _check_resume(parser, config)
    return script_args, config


def _check_resume(parser: argparse.ArgumentParser, config):
    """The checks `BaseTrainer.train` makes on resuming and on earlier checkpoints, made before the model
    loads so that a mistyped rerun costs a usage line, not a model load and a traceback."""
    from posttrain.trainers.base import TRAINER_STATE, checkpoint_folders

    resume, folder = _resume_arg(config.resume_from_checkpoint), config.output_dir
    found = checkpoint_folders(folder)
    if resume is True and not any(complete for _, _, complete in found):
        parser.error(f"--resume_from_checkpoint: true asks for the latest checkpoint in --output_dir {folder!r}, "
                     "which holds no complete checkpoint-N folder")
    if isinstance(resume, str) and not os.path.isfile(os.path.join(resume, TRAINER_STATE)):
        what = f"holds no {TRAINER_STATE} (a checkpoint cut short?)" if os.path.isdir(resume) else "does not exist"
        parser.error(f"--resume_from_checkpoint: {resume!r} is not a checkpoint folder: it {what}")
    if resume is None and found and not getattr(config, "overwrite_output_dir", False):
        names = [os.path.basename(path) for _, path, _ in found]
        parser.error(f"--output_dir {folder!r} holds checkpoints of an earlier run ({', '.join(names)}): add "
                     "--resume_from_checkpoint true to continue it, --overwrite_output_dir true to delete them "
                     "and start afresh, or choose another --output_dir")


class _Parser(argparse.ArgumentParser):
    """An error prints one usage line, not the hundred lines of flags that `--help` lists."""

    def error(self, message):
        self.exit(2, f"usage: {self.prog} [options] (see {self.prog} --help)\n{self.prog}: error: {message}\n")


def _reward_spec_problem(spec: str) -> str | None:
    """Why `spec` cannot be a reward, or None. Checked before any model loads: a name that is not
    built in would otherwise be tried as a hub model id and reported as a failed download."""
    import difflib

    from posttrain.models.loading import BUILTIN_PREFIX
    from posttrain.tasks.builtin import REWARD_FUNCTIONS

    module, sep, attr = spec.partition(":")
    if (spec in REWARD_FUNCTIONS or (sep and module and attr) or spec.startswith(BUILTIN_PREFIX)
            or os.path.exists(os.path.expanduser(spec))):
        return None  # module:function imports and unknown built-in models are reported when they load
    close = difflib.get_close_matches(spec, list(REWARD_FUNCTIONS), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (f"{spec!r} is neither a built-in reward name, a module:function, nor a local model path; {hint}"
            f"built-in names: {', '.join(REWARD_FUNCTIONS)}")


def _resume_arg(value: str | None) -> str | bool | None:
    """`resume_from_checkpoint` as `Trainer.train` takes it: true -> the latest checkpoint of output_dir."""
    if value is None or value.lower() in _FALSE:
        return None
    return True if value.lower() in _TRUE else os.path.expanduser(value)


# ---------------------------------------------------------------------------- --accelerate_config

ACCELERATE_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate_configs")
# TRL's names for the same setups
_ACCELERATE_ALIASES = {"zero2": "deepspeed_zero2", "zero3": "deepspeed_zero3", "single_gpu": "single_process"}
LAUNCH_FLAGS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port")


def accelerate_config_names() -> list[str]:
    """Names of the accelerate config files shipped in posttrain/accelerate_configs/."""
    return sorted(name[: -len(".yaml")] for name in os.listdir(ACCELERATE_CONFIGS) if name.endswith(".yaml"))


def _accelerate_config_path(parser: argparse.ArgumentParser, name: str) -> str:
    """The file --accelerate_config names: a path, else a shipped config (by name or TRL's alias)."""
    if os.path.isfile(path := os.path.expanduser(name)):
        return path
    if os.path.isfile(shipped := os.path.join(ACCELERATE_CONFIGS, _ACCELERATE_ALIASES.get(name, name) + ".yaml")):
        return shipped
    parser.error(f"--accelerate_config {name!r} is neither a file nor a shipped config; shipped: "
                 f"{', '.join(accelerate_config_names())}")


def launch_command(name: str, argv: list[str]) -> list[str] | None:
    """The `accelerate launch` command line that `posttrain NAME ARGV` re-executes itself as when ARGV holds
    --accelerate_config (None otherwise): the config file and launcher flags go to accelerate, the rest to
    `python -m posttrain.cli NAME` in each process. ARGV is taken as already checked by `parse`."""
    rest, launch = [], {}
    words = iter(argv)
    for word in words:
        key, eq, value = word[2:].partition("=") if word.startswith("--") else ("", "", "")
        key = key.replace("-", "_")
        if key not in ("accelerate_config", *LAUNCH_FLAGS):
            rest.append(word)
            continue
        launch[key] = value if eq else next(words)
    if "accelerate_config" not in launch:
        return None
    config_file = _accelerate_config_path(_Parser(prog=f"posttrain {name}"), launch.pop("accelerate_config"))
    flags = [word for key, value in launch.items() for word in (f"--{key}", value)]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file, *flags,
            "-m", "posttrain.cli", name, *rest]


@command("demo", config=None, script_args=None,
         help="End-to-end pipeline on the built-in task: every method, accuracy before -> after.")
def run_demo(script_args=None, config=None):
    """Placeholder entry: `run` hands `posttrain demo ...` to posttrain.demo.main with its own flags."""


def run(argv: list[str]):
    """Run `posttrain <command> ...` in this process; returns the trainer of a training command
    (for tests and notebooks), None for the others. With --accelerate_config the command runs again under
    `accelerate launch` (see `launch_command`) and this returns None once it succeeds; its failure exits
    with its status."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {n:<8} {getattr(fn, 'help', '')}" for n, fn in COMMANDS.items()]
        usage = "usage: posttrain <command> [--config file.yaml] [--field value ...]\n\ncommands:\n" + "\n".join(lines)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"{usage}\n\nposttrain: error: unknown command {argv[0]!r}", file=sys.stderr)
            raise SystemExit(2)
        print(usage)
        return None
    name = argv[0]
    if name == "demo":  # the demo has its own small flag set
        from posttrain import demo

        demo.main(argv[1:])
        return None
    script_args, config = parse(name, argv[1:])
    if launched := launch_command(name, argv[1:]):
        import subprocess

        status = subprocess.run(launched).returncode
        if status:
            raise SystemExit(status)
        return None  # the trainer lived in the launched processes
    trainer = COMMANDS[name](script_args, config)
    if trainer is None:
        return None
    with trainer.output_dir_lock():  # the final model is the run's too: no other run writes it meanwhile
        trainer.train(resume_from_checkpoint=_resume_arg(config.resume_from_checkpoint))
        trainer.save_model(config.output_dir)
        if trainer.eval_dataset is not None:
            trainer.evaluate()
    return trainer


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `posttrain` console script: 0 on success. Failures exit non-zero: 2 for a
    usage error; 1 for a dataset or model that cannot be loaded, an output_dir in use by another run, a damaged
    checkpoint, a full disk or a run stopped by NaN or infinite gradients or weights (one line that says why) or any
    other exception (with its traceback)."""
    from posttrain.models.loading import ModelLoadError
    from posttrain.trainers.guards import CheckpointError, NonFiniteError, OutputDirInUseError, SaveError

    try:
        run(sys.argv[1:] if argv is None else argv)
    except (DatasetError, ModelLoadError, CheckpointError, NonFiniteError, OutputDirInUseError,
            SaveError) as err:
        print(f"posttrain: error: {err}", file=sys.stderr)
        return 1
    finally:
        close_process_group()
    return 0


def close_process_group() -> None:
    """Destroy the torch.distributed process group a multi-process run (accelerate launch, torchrun) opened,
    if any, so that its communication threads (gloo: gloo_tcp_loop, pt_gloo_runloop) are joined now.

    torch's destroy_process_group only unregisters the group: while anything still references it, the group
    and its threads live on into interpreter teardown, where a finished run now and then aborted ("terminate
    called without an active exception", exit code -6; PyTorch's analysis, pull request 179291: a gloo worker
    thread that drops a work object needs the GIL during finalization). In a DDP run two references were
    left: objects in reference cycles (the trainer and its DDP module), collected here first, and default
    arguments `group=dist.group.WORLD` of functions defined once the group existed
    (torch.distributed.nn.functional, which DDP imports; deepspeed.comm.torch). Those defaults become None,
    which means the default group there too."""
    import gc

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    world = dist.group.WORLD
    for f in gc.get_objects():
        if isinstance(f, types.FunctionType):
            if f.__defaults__ and any(d is world for d in f.__defaults__):
                f.__defaults__ = tuple(None if d is world else d for d in f.__defaults__)
            if f.__kwdefaults__ and any(d is world for d in f.__kwdefaults__.values()):
                f.__kwdefaults__ = {k: None if d is world else d for k, d in f.__kwdefaults__.items()}
    del world
    dist.destroy_process_group()


def _group_threads_alive() -> bool:
    """Whether threads of a gloo process group still run in this process (their names, on Linux)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return any(name in ("pt_gloo_runloop", "gloo_tcp_loop") for name in names)


def end_process(code: int):
    """Exit with `code` after `close_process_group`. Where a process group outlived it -- DeepSpeed keeps its
    groups in module globals and on ZeRO-3 parameters, out of reach -- its threads would run into interpreter
    teardown and could abort the finished process (see close_process_group). Then the exit work Python does
    is done here (non-daemon threads joined, atexit handlers run, output flushed) and the process ends with
    os._exit(code), which skips that teardown; otherwise it is an ordinary sys.exit."""
    if not _group_threads_alive():
        sys.exit(code)
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter calls first at exit (CPython)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    end_process(main())
