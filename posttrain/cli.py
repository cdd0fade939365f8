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
import importlib
import importlib.util
import json
import logging
import os
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.flags import _FALSE, _TRUE, _add_flags, _flags, _yaml_value
from posttrain.scripts import DatasetMixtureConfig, ModelConfig
from posttrain.scripts import ScriptArguments as TrlScriptArguments
from posttrain.scripts import (DatasetError, check_data_file, get_dataset, get_kbit_device_map,  # noqa: F401
                               get_peft_config, get_quantization_config, load_dataset_arg, load_split, read_config)


@dataclass
class ModelArguments(ModelConfig):
    """Which model to train and how to load it: TRL's `ModelConfig` (`--use_peft` trains a LoRA adapter,
    `--load_in_4bit` loads the base weights in 4 bits for QLoRA). They feed the trainer's `model_init_kwargs`
    and `peft_config`. Two defaults are None where TRL's are set, so that posttrain picks: float32, and the
    reward command's SEQ_CLS adapter."""

    dtype: typing.Literal["auto", "float32", "bfloat16", "float16"] | None = field(
        default=None, metadata={"help": "Weights' dtype when loading: auto (as saved in the checkpoint), "
                                        "float32, bfloat16 or float16. Default: float32. Goes into "
                                        "model_init_kwargs."})
    lora_task_type: str | None = field(
        default=None, metadata={"help": "peft task type. Default: SEQ_CLS for `posttrain reward` (so the score "
                                        "head is trained), CAUSAL_LM otherwise."})


@dataclass
class ScriptArguments(ModelArguments, TrlScriptArguments, DatasetMixtureConfig):
    """What to train on: the model flags, the dataset (TRL's `ScriptArguments`) or a mixture of datasets
    (TRL's `DatasetMixtureConfig`: `--datasets`, `--test_split_size`), shared by every training command."""

    def __post_init__(self):
        ModelArguments.__post_init__(self)
        DatasetMixtureConfig.__post_init__(self)


def peft_config(script_args: ModelArguments, task_type: str = "CAUSAL_LM"):
    """The `peft.LoraConfig` the LoRA flags describe (`get_peft_config`; the command's `task_type` unless
    --lora_task_type is given), or None without --use_peft."""
    if not script_args.use_peft:
        return None
    return get_peft_config(dataclasses.replace(script_args, lora_task_type=script_args.lora_task_type or task_type))


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


def _load_kwargs(script_args: ModelArguments) -> dict:
    """The model_init_kwargs the model flags ask for: dtype, attention kernel, remote code, a revision other than
    main, and a quantization config (with its device map) for --load_in_4bit / --load_in_8bit."""
    kwargs = {name: getattr(script_args, name) for name in _LOAD_FLAGS
              if getattr(script_args, name) is not None and getattr(script_args, name) is not False}
    if script_args.model_revision != "main":
        kwargs["revision"] = script_args.model_revision
    if (quantization := get_quantization_config(dataclasses.replace(script_args,
                                                                    dtype=script_args.dtype or "float32"))):
        kwargs["quantization_config"] = quantization
        if (device_map := get_kbit_device_map()) is not None:
            kwargs["device_map"] = device_map
    return kwargs


def _merge_model_init_kwargs(parser: argparse.ArgumentParser, script_args: ModelArguments, config):
    """Put the model flags (`_load_kwargs`) into `config.model_init_kwargs`; a flag that contradicts a key the
    config's model_init_kwargs already holds is a usage error."""
    kwargs = dict(config.model_init_kwargs or {})
    for name, value in _load_kwargs(script_args).items():
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


# the local data file the running command trains on: {"path": as given, "lines": the 1-based line each row
# starts on, or None where rows are not lines (parquet, a JSON object of columns)}
_SOURCE: dict[str, Any] = {}


def _row_lines(path: str) -> list[int] | None:
    """The 1-based line of a data file on which each row starts (the rows `datasets` reads, in order)."""
    import csv

    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".parquet":
        return None
    with open(path, encoding="utf-8", newline="" if suffix == ".csv" else None) as handle:
        text = handle.read()
    if suffix == ".csv":
        reader, starts, line = csv.reader(text.splitlines(keepends=True)), [], 1
        for _ in reader:
            starts.append(line)
            line = reader.line_num + 1
        return starts[1:]  # the first record is the header
    decoder, start = json.JSONDecoder(), len(text) - len(text.lstrip())
    if suffix == ".json" and text[start:start + 1] in "[{":
        try:
            document, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            document, end = None, 0
        if text[end:].strip():  # more after the first value: JSON lines in a .json file
            document = None
        if isinstance(document, dict):
            return None  # an object of columns
        if isinstance(document, list):  # a list of rows: where each element starts
            starts, pos = [], start + 1
            while True:
                while pos < len(text) and text[pos] in " \t\r\n,":
                    pos += 1
                if pos >= len(text) or text[pos] == "]":
                    return starts
                starts.append(text.count("\n", 0, pos) + 1)
                _, pos = decoder.raw_decode(text, pos)
    return [number for number, line in enumerate(text.splitlines(), 1) if line.strip()]  # JSON lines


def locate(message: str) -> str:
    """A data fault's message with its rows counted as the user counts them: "row i" (0-based, as the
    library reports it) becomes the line of the training file it stands on, or row i + 1 (1-based) where
    rows are not lines; a message that names no row is prefixed with the file."""
    path, lines = _SOURCE.get("path"), _SOURCE.get("lines")

    def where(match) -> str:
        row = int(match.group(1))
        if path is not None and lines is not None and row < len(lines):
            return f"{path}, line {lines[row]}"
        return f"{path + ', ' if path else ''}row {row + 1}"

    located = re.sub(r"\brow (\d+)", where, message)
    located = re.sub(r"\brows (\d+)-(\d+)", lambda m: f"rows {int(m.group(1)) + 1}-{int(m.group(2)) + 1}", located)
    if path is not None and path not in located:
        located = f"{path}: {located}"
    return located


def load_datasets(script_args: ScriptArguments, config) -> tuple[Any, Any]:
    """(train, eval) datasets for a training command; eval only when `config.eval_strategy` is not 'no'. A mixture
    (--datasets) wins over --dataset_name, as in TRL's scripts; its splits are "train" and, with
    --test_split_size, "test"."""
    evaluate = str(getattr(config, "eval_strategy", "no")) not in ("no", "IntervalStrategy.NO")
    if script_args.datasets:
        mixture = get_dataset(script_args)
        if evaluate and script_args.dataset_test_split not in mixture:
            raise DatasetError(f"eval_strategy {config.eval_strategy!r} needs a test split, and the --datasets mixture "
                               f"has only {sorted(mixture)}: give --test_split_size (e.g. 0.1)")
        return mixture["train"], mixture[script_args.dataset_test_split] if evaluate else None

    if os.path.isfile(path := os.path.expanduser(script_args.dataset_name)):  # "row i" can name the file's line
        _SOURCE.update(path=script_args.dataset_name, lines=_row_lines(path))

    def split(name):
        return load_split(script_args.dataset_name, name, script_args.dataset_config,
                          streaming=script_args.dataset_streaming)

    return split(script_args.dataset_train_split), split(script_args.dataset_test_split) if evaluate else None


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
    trainer = trainer_class(script_args.model_name_or_path, args=config, train_dataset=train, eval_dataset=evaluation,
                            processing_class=tokenizer(script_args), peft_config=peft_config(script_args, task_type))
    if script_args.ignore_bias_buffers:  # TRL's DDP workaround: DDP skips broadcasting the model's bool buffers
        import torch

        model = trainer.accelerator.unwrap_model(trainer.model)
        model._ddp_params_and_buffers_to_ignore = [n for n, b in model.named_buffers() if b.dtype == torch.bool]
    return trainer


def build_reward(trainer_class, script_args, config):
    """`build_offline` with a sequence-classification adapter (--use_peft trains the score head too)."""
    return build_offline(trainer_class, script_args, config, task_type="SEQ_CLS")


def build_prm(trainer_class, script_args, config):
    """`build_offline` with a token-classification adapter (--use_peft trains the step head too)."""
    return build_offline(trainer_class, script_args, config, task_type="TOKEN_CLS")


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
    "online_dpo": ("posttrain.trainers.online_dpo:OnlineDPOTrainer", build_online, OnlineScriptArguments,
                   "Online DPO: DPO on pairs the policy samples, ranked by the rewards."),
    "xpo": ("posttrain.trainers.xpo:XPOTrainer", build_online, OnlineScriptArguments,
            "XPO: Online DPO against the reference's samples, with an exploration bonus."),
    "nash_md": ("posttrain.trainers.nash_md:NashMDTrainer", build_online, OnlineScriptArguments,
                "Nash-MD: the policy's sample against the policy/reference mixture's."),
    "gmpo": ("posttrain.trainers.gmpo:GMPOTrainer", build_online, OnlineScriptArguments,
             "GMPO: GRPO with the geometric mean of the token ratios."),
    "gspo_token": ("posttrain.trainers.gspo_token:GSPOTokenTrainer", build_online, OnlineScriptArguments,
                   "GSPO-token: GRPO with the sequence importance ratio at every token."),
    "grpo_with_replay_buffer": ("posttrain.trainers.grpo_replay_buffer:GRPOWithReplayBufferTrainer", build_online,
                                OnlineScriptArguments, "GRPO replaying high-variance groups in place of flat ones."),
    "a2po": ("posttrain.trainers.a2po:A2POTrainer", build_online, OnlineScriptArguments,
             "A*-PO: V* from reference samples, then regression on one on-policy sample."),
    "dppo": ("posttrain.trainers.dppo:DPPOTrainer", build_online, OnlineScriptArguments,
             "DPPO: GRPO with a per-token divergence trust region instead of the ratio clip."),
    "gpg": ("posttrain.trainers.gpg:GPGTrainer", build_online, OnlineScriptArguments,
            "GPG: GRPO as the plain policy gradient, rescaled for groups without signal."),
    "maxrl": ("posttrain.trainers.maxrl:MaxRLTrainer", build_online, OnlineScriptArguments,
              "MaxRL: GRPO with advantages divided by the group's mean reward (p-normalisation)."),
    "async_grpo": ("posttrain.trainers.async_grpo:AsyncGRPOTrainer", build_online, OnlineScriptArguments,
                   "GRPO sampling the next batches while the current one trains (max_staleness)."),
    "reward": ("posttrain.trainers.reward:RewardTrainer", build_reward, ScriptArguments,
               "Reward model (Bradley-Terry) on preference pairs."),
    "dpo": ("posttrain.trainers.dpo:DPOTrainer", build_offline, ScriptArguments,
            "DPO and its pairwise variants on preference pairs."),
    "bco": ("posttrain.trainers.bco:BCOTrainer", build_offline, ScriptArguments,
            "BCO on unpaired (or paired) feedback."),
    "kto": ("posttrain.trainers.kto:KTOTrainer", build_offline, ScriptArguments,
            "KTO on unpaired (or paired) feedback."),
    "distillation": ("posttrain.trainers.distillation:DistillationTrainer", build_offline, ScriptArguments,
                     "On-policy distillation from --teacher_model_name_or_path (generalised JSD)."),
    "gkd": ("posttrain.trainers.gkd:GKDTrainer", build_offline, ScriptArguments,
            "GKD: distillation mixing on-policy and dataset (or teacher, --seq_kd) completions."),
    "minillm": ("posttrain.trainers.minillm:MiniLLMTrainer", build_offline, ScriptArguments,
                "MiniLLM: reverse KL to --teacher_model_name_or_path as a policy gradient."),
    "iw_opd": ("posttrain.trainers.iw_opd:IWOPDTrainer", build_offline, ScriptArguments,
               "IW-OPD: on-policy distillation, sampled tokens weighted by the disagreement before them."),
    "gold": ("posttrain.trainers.gold:GOLDTrainer", build_offline, ScriptArguments,
             "GOLD: GKD, or with --use_uld_loss ULD to a teacher with another tokenizer."),
    "sdft": ("posttrain.trainers.sdft:SDFTTrainer", build_offline, ScriptArguments,
             "SDFT: the model distils itself shown the dataset's privileged_context."),
    "sdpo": ("posttrain.trainers.sdpo:SDPOTrainer", build_online, OnlineScriptArguments,
             "SDPO: GRPO's rollouts; the model, shown a successful peer, distils itself."),
    "server_distillation": ("posttrain.trainers.server_distillation:ServerDistillationTrainer", build_offline,
                            ScriptArguments, "Distillation from the teacher server at --teacher_model_server_url."),
    "async_distillation": ("posttrain.trainers.server_distillation:AsyncDistillationTrainer", build_offline,
                           ScriptArguments, "Distillation from --teacher_server_urls, the next batches sampled and "
                           "scored in the background (--max_staleness)."),
    "orpo": ("posttrain.trainers.orpo:ORPOTrainer", build_offline, ScriptArguments,
             "ORPO: NLL on the chosen plus an odds-ratio term, no reference model."),
    "cpo": ("posttrain.trainers.cpo:CPOTrainer", build_offline, ScriptArguments,
            "CPO / SimPO / AlphaPO: reference-free pair losses plus behaviour cloning."),
    "tpo": ("posttrain.trainers.tpo:TPOTrainer", build_offline, ScriptArguments,
            "TPO on (prompt, reference, chosen, rejected) triples."),
    "prm": ("posttrain.trainers.prm:PRMTrainer", build_prm, ScriptArguments,
            "Process reward model on stepwise supervision (a token classifier)."),
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
# what `trl env` reports besides those: the hub client and the optional packages some of TRL's features use
OTHER_PACKAGES = ("huggingface_hub", "diffusers", "llm-blender", "openai")


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
                                                    "hardware posttrain sees (what `trl env` prints, and more).")
def run_env(script_args=None, config=None):
    import platform

    import torch

    import posttrain

    rows = [("posttrain", posttrain.__version__), ("python", platform.python_version()),
            ("platform", platform.platform())]
    for package in ("torch", "transformers", "datasets", "accelerate"):
        rows.append((package, _version(package)))
    rows.append(("accelerate config", _accelerate_default_config()))
    for package in OPTIONAL_ENGINES + OTHER_PACKAGES:
        rows.append((package, _version(package)))
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    rows.append(("CUDA device(s)", ", ".join(devices) if devices else "not available"))
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

def _load_yaml(path: str, parser: argparse.ArgumentParser) -> dict:
    """The --config file's `field: value` pairs; its `env:` mapping (as in TRL's config files) is put into
    os.environ. A file that cannot be read is a usage error; one that is not YAML names the line and column."""
    import yaml

    try:
        return read_config(path)
    except ValueError as err:
        mark = getattr(err.__cause__, "problem_mark", None)
        if isinstance(err.__cause__, yaml.YAMLError):
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            what = " ".join(str(getattr(err.__cause__, "problem", None) or err.__cause__).split())
            parser.error(f"{path}{where}: not valid YAML: {what}")
        parser.error(str(err))


def _yaml_marks(path: str) -> dict[str, str]:
    """{field: "(line L, column C)"} of a --config file's top-level keys (1-based), for its error messages."""
    import yaml

    try:
        with open(path) as handle:
            node = yaml.compose(handle)
    except (OSError, yaml.YAMLError):
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {key.value: f"(line {key.start_mark.line + 1}, column {key.start_mark.column + 1})"
            for key, _ in node.value}


def default_output_dir(name: str) -> str:
    """Where `posttrain NAME` writes without --output_dir: a folder named for the command (transformers'
    own default, trainer_output/, is shared by every command, so an SFT run and the GRPO run after it
    would write into one folder)."""
    return f"{name}_output"


def _yaml_values(parser: argparse.ArgumentParser, path: str, flags: list[dict], values: list[dict]):
    """Put the --config file's fields into `values` (one dict per flag class, a field of both into both), each
    checked against its field's type; an unknown field or a wrong type is a usage error naming its line."""
    marks = _yaml_marks(path)
    for key, value in _load_yaml(path, parser).items():
        owners = [i for i, fl in enumerate(flags) if key in fl]
        if not owners:
            parser.error(f"{path}: unknown field {key!r} for `{parser.prog}` {marks.get(key, '')}".rstrip())
        flag = flags[owners[0]][key]
        try:
            value = _yaml_value(flag, value)
        except (ValueError, json.JSONDecodeError):
            parser.error(f"{path}: {key}: expected {flag.type_name}, got {type(value).__name__} {value!r} "
                         f"{marks.get(key, '')}".rstrip())
        for owner in owners:
            values[owner][key] = value


def _config_class(fn):
    return None if fn.config_path is None else _imported(fn.config_path)


def parse(name: str, argv: list[str]) -> tuple[Any, Any]:
    """(script_args, config) for command `name` from its flags and optional --config YAML file."""
    fn = COMMANDS[name]
    classes = [c for c in (fn.script_args_class, _config_class(fn)) if c is not None]
    flags = [_flags(c) for c in classes]
    shown = [dict(f) for f in flags]  # a field of both (trust_remote_code): one flag, under the config, sets both
    for earlier in shown[:-1]:
        for key in set(earlier) & set(shown[-1]):
            del earlier[key]
    show_all = "--help-all" in argv
    argv = ["--help" if word == "--help-all" else word for word in argv]
    parser = _Parser(prog=f"posttrain {name}", description=fn.help,
                     usage=f"posttrain {name} [--config file.yaml] [--field value ...]",
                     epilog=None if show_all else f"These are the common flags; every one of the "
                     f"{sum(len(fl) for fl in shown)} fields is a flag: `posttrain {name} --help-all` lists them all.")
    parser.add_argument("--config", help="YAML file of `field: value` pairs; command-line flags override it.")
    parser.add_argument("--help-all", action="store_true", help="List every flag.")
    if fn.config_path is not None:
        parser.add_argument("--accelerate_config", default=argparse.SUPPRESS, help="Run under `accelerate launch` with this config: a file, "
                            f"or a name of the shipped ones ({', '.join(accelerate_config_names())}). "
                            "Launcher flags, passed to accelerate: " + ", ".join(f"--{f}" for f in LAUNCH_FLAGS) + ".")
        for launch_flag in LAUNCH_FLAGS:
            parser.add_argument(f"--{launch_flag}", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for cls, cls_flags in zip(classes, shown):
        if issubclass(cls, ModelArguments) and cls is not ModelArguments:  # the model flags in a group of their own
            model_fields = {f.name for f in dataclasses.fields(ModelArguments)}
            _add_flags(parser, ModelArguments, {k: v for k, v in cls_flags.items() if k in model_fields},
                       ModelArguments.__name__, show_all)
            cls_flags = {k: v for k, v in cls_flags.items() if k not in model_fields}
        _add_flags(parser, cls, cls_flags, cls.__name__, show_all)
    given = vars(parser.parse_args(argv))
    given.pop("help_all", None)
    launch = {key: given.pop(key) for key in ("accelerate_config", *LAUNCH_FLAGS) if key in given}
    if launch:  # run() launches before parsing; here they are only checked, and mean nothing without the config
        if "accelerate_config" not in launch:
            parser.error(f"{', '.join('--' + k for k in launch)} is a launcher flag: it needs --accelerate_config "
                         "(e.g. --accelerate_config multi_gpu --num_processes 2)")
        _accelerate_config_path(parser, launch["accelerate_config"])
    values: list[dict] = [{} for _ in classes]
    if path := given.pop("config", None):
        _yaml_values(parser, path, flags, values)
    for key, value in given.items():
        for owner in (i for i, fl in enumerate(flags) if key in fl):
            values[owner][key] = value
    if fn.config_path is not None and "output_dir" in flags[-1] and "output_dir" not in values[-1]:
        values[-1]["output_dir"] = default_output_dir(name)
        print(f"posttrain {name}: no --output_dir given: writing to {values[-1]['output_dir']}/", file=sys.stderr)
    built = []
    for cls, kwargs in zip(classes, values):
        try:
            built.append(cls(**kwargs))
        except (ValueError, TypeError) as err:
            parser.error(f"invalid {cls.__name__}: {err}")
    script_args = built[0] if fn.script_args_class is not None else None
    config = built[-1] if fn.config_path is not None else None
    if isinstance(script_args, ScriptArguments) and config is not None:
        required = ([] if script_args.datasets else ["dataset_name"]) + (
            [] if getattr(config, "sft_model_path", None) else ["model_name_or_path"])
        missing = [f"--{k}" for k in required if getattr(script_args, k) is None]
        if missing:
            parser.error(f"the following arguments are required: {', '.join(missing)}")
        _merge_model_init_kwargs(parser, script_args, config)
        if script_args.gradient_checkpointing_use_reentrant:  # as TRL's scripts hand it to the config
            config.gradient_checkpointing_kwargs = {**(config.gradient_checkpointing_kwargs or {}),
                                                    "use_reentrant": True}
        if script_args.use_peft and importlib.util.find_spec("peft") is None:
            parser.error("--use_peft needs the peft package: pip install 'posttrain[peft]'")
        if quantized := next((f"--{k}" for k in ("load_in_4bit", "load_in_8bit") if getattr(script_args, k)), None):
            if importlib.util.find_spec("bitsandbytes") is None:
                parser.error(f"{quantized} needs the bitsandbytes package: pip install 'posttrain[qlora]'")
            if not script_args.use_peft:
                parser.error(f"{quantized} loads weights that cannot be trained: add --use_peft to train a LoRA "
                             "adapter on them (QLoRA)")
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
    if argv and argv[0] == "--version":
        import posttrain

        print(f"posttrain {posttrain.__version__}")
        return None
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = [f"  {n:<{width}}  {getattr(fn, 'help', '')}" for n, fn in COMMANDS.items()]
        usage = ("usage: posttrain <command> [--config file.yaml] [--field value ...] [--debug]\n"
                 "       posttrain --version\n\ncommands:\n" + "\n".join(lines) +
                 "\n\n`posttrain <command> --help` lists the command's flags; --debug shows the traceback of an error.")
        if argv and argv[0] in ("-h", "--help"):
            print(usage)
            return None
        problem = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"{usage}\n\nposttrain: error: {problem}", file=sys.stderr)
        raise SystemExit(2)
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
    if trainer.is_world_process_zero():
        print(f"posttrain {name}: model saved to {os.path.abspath(config.output_dir)}")
    return trainer


# (logger, start of message): lines optional packages print on every CPU run when transformers imports them,
# saying only that they found no GPU kernels (bitsandbytes via peft) or no GPU (deepspeed)
KNOWN_NOISE = (("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
               ("DeepSpeed", "Setting accelerator to CPU"))


class _DropMessage(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def quiet_known_noise():
    """Drop the KNOWN_NOISE lines (filters on those loggers, set before the packages are imported)."""
    for name, start in KNOWN_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.start == start for f in logger.filters):
            logger.addFilter(_DropMessage(start))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `posttrain` console script: 0 on success. Failures exit non-zero: 2 for a
    usage error; 1 for a dataset or model that cannot be loaded, data that fits no format (one line
    that names the file, its line and the column: `locate`), an output_dir in use by another run, a damaged
    checkpoint, a full disk or a run stopped by NaN or infinite gradients or weights (one line that says why)
    or any other exception (with its traceback, an internal error). `--debug` anywhere on the line shows the
    traceback of every error."""
    from posttrain.data.formats import FormatError
    from posttrain.models.loading import ModelLoadError
    from posttrain.trainers.guards import CheckpointError, NonFiniteError, OutputDirInUseError, SaveError

    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_known_noise()
    debug = "--debug" in argv
    argv = [word for word in argv if word != "--debug"]
    try:
        run(argv)
    except (DatasetError, ModelLoadError, FormatError) as err:
        if debug:
            raise
        print(f"posttrain: error: {' '.join(locate(str(err)).split())}", file=sys.stderr)
        return 1
    except (CheckpointError, NonFiniteError, OutputDirInUseError, SaveError) as err:  # about the run, not the data
        if debug:
            raise
        print(f"posttrain: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    finally:
        close_process_group()
        _SOURCE.clear()
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
