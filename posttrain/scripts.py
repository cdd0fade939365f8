"""TRL's script helpers, so that a script copied from `trl/scripts/sft.py` or `dpo.py` runs after changing its import.

* `ScriptArguments`, `ModelConfig`, `DatasetMixtureConfig` (+ `DatasetConfig`): the dataclasses TRL's scripts parse,
  with TRL's field names and defaults.
* `TrlParser(dataclass_types)`: flags from dataclasses, `parse_args_and_config(args=None,
  return_remaining_strings=False, fail_with_unknown_args=True)` with `--config file.yaml` (whose `env:` section sets
  environment variables); the flags are made by posttrain's CLI machinery (`posttrain.flags`), so a flag, a YAML value
  and `posttrain <command>` read a value the same way.
* `get_dataset(mixture)`: a `DatasetDict` from a mixture of datasets, each with its split (slices such as
  `train[:50%]` select fractions), columns and configuration.
* `get_peft_config`, `get_quantization_config`, `get_kbit_device_map`: what a `ModelConfig` asks for.

Departures from TRL: datasets come from posttrain's offline sources (built-in names, local files and folders, or
`datasets`' own builders such as `json` with `data_files`), never from the hub; a YAML value is type-checked
against its field before anything loads; a dataclass field given by several dataclasses (e.g. `trust_remote_code`,
which every posttrain config has and `ModelConfig` has too) is one flag that sets all of them, where
`HfArgumentParser` would refuse the duplicate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ScriptArguments:
    """Arguments every TRL training script has: which dataset, which splits."""

    dataset_name: str | None = field(
        default=None, metadata={"help": "Dataset to load: a built-in name (zen, zen/preference, reverse, ...), a local "
                                        ".json/.jsonl/.csv/.parquet file or a local dataset folder (nothing is "
                                        "downloaded). Ignored when `datasets` (a mixture) is given."})
    dataset_config: str | None = field(
        default=None, metadata={"help": "Configuration name of the dataset (the `name` argument of "
                                        "datasets.load_dataset). Ignored when `datasets` is given."})
    dataset_train_split: str = field(
        default="train", metadata={"help": "Split to train on; a slice such as train[:80%] takes part of it."})
    dataset_test_split: str = field(
        default="test", metadata={"help": "Split to evaluate on (read only when eval_strategy is not 'no')."})
    dataset_streaming: bool = field(
        default=False, metadata={"help": "Load the dataset as an IterableDataset, read row by row."})
    gradient_checkpointing_use_reentrant: bool = field(
        default=False, metadata={"help": "use_reentrant for gradient checkpointing (a script passes it into "
                                         "gradient_checkpointing_kwargs)."})
    ignore_bias_buffers: bool = field(
        default=False, metadata={"help": "Debug switch for DDP with models whose bool bias/mask buffers break "
                                         "broadcasting (transformers issue 22482): a script adds those buffers to "
                                         "the model's _ddp_params_and_buffers_to_ignore."})


@dataclass
class ModelConfig:
    """Which model to load and how: dtype, attention kernel, LoRA adapter, 4/8-bit quantization (QLoRA)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Model to train: a built-in name (posttrain/tiny-qwen2, ...) or a local "
                                        "folder."})
    model_revision: str = field(
        default="main", metadata={"help": "Revision (branch, tag or commit) of a hub model; a local folder has only "
                                          "the one it holds."})
    dtype: typing.Literal["auto", "bfloat16", "float16", "float32"] | None = field(
        default="float32", metadata={"help": "dtype to load the weights in: auto (as saved), bfloat16, float16 or "
                                             "float32."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run the modelling code a model folder ships (auto_map). That code runs in "
                                         "this process with your permissions: only for folders you trust."})
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Attention kernel of transformers (eager, sdpa, flash_attention_2, ...). "
                                        "Default: transformers' choice."})
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter (get_peft_config) instead of every "
                                                            "weight; needs the peft package."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (the update is scaled by "
                                                          "lora_alpha / lora_r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA branch."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Module names to adapt (e.g. q_proj v_proj), or all-linear (every "
                                        "linear layer but the output layer). Default: peft's choice for the "
                                        "architecture."})
    lora_target_parameters: list[str] | None = field(
        default=None, metadata={"help": "Parameter names to adapt directly (e.g. a mixture of experts' fused "
                                        "expert weights), for weights that are not in a module of their own."})
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Modules trained in full and saved with the adapter (e.g. lm_head, score)."})
    lora_task_type: str = field(
        default="CAUSAL_LM", metadata={"help": "peft task type: CAUSAL_LM, or SEQ_CLS for a reward model."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA: scale by "
                                                              "lora_alpha / sqrt(lora_r)."})
    use_dora: bool = field(default=False, metadata={"help": "DoRA: weight-decomposed LoRA."})
    load_in_8bit: bool = field(default=False, metadata={"help": "Load the base weights in 8 bits (bitsandbytes); "
                                                                "train an adapter on them."})
    load_in_4bit: bool = field(default=False, metadata={"help": "Load the base weights in 4 bits (bitsandbytes), "
                                                                "QLoRA; train an adapter on them."})
    bnb_4bit_quant_type: typing.Literal["fp4", "nf4"] = field(
        default="nf4", metadata={"help": "4-bit data type: nf4 (normal float, QLoRA's) or fp4."})
    use_bnb_nested_quant: bool = field(
        default=False, metadata={"help": "Quantize the 4-bit quantization constants too (double quantization): "
                                         "about 0.4 bit per weight less."})

    def __post_init__(self):
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("load_in_8bit and load_in_4bit are both set: choose one precision")
        if self.lora_target_modules == ["all-linear"]:
            self.lora_target_modules = "all-linear"  # peft reads this string, not a module named so


@dataclass
class DatasetConfig:
    """One dataset of a mixture, with `datasets.load_dataset`'s argument names."""

    path: str = field(metadata={"help": "A built-in name, a local file or folder, or a datasets builder (json, csv, "
                                        "parquet, ...) with data_files."})
    name: str | None = field(default=None, metadata={"help": "Configuration name."})
    data_dir: str | None = field(default=None, metadata={"help": "Folder of data files, for a builder."})
    data_files: str | list[str] | dict[str, str] | None = field(
        default=None, metadata={"help": "Data file(s) for a builder: a path, a list, or {split: path}."})
    split: str = field(default="train", metadata={"help": "Split to take; train[:30%] or train[10:20] takes part "
                                                         "of it, train+test both."})
    columns: list[str] | None = field(default=None, metadata={"help": "Columns to keep. Default: all."})


@dataclass
class DatasetMixtureConfig:
    """A mixture of datasets concatenated into one (YAML: a `datasets:` list of DatasetConfig fields)."""

    datasets: list[DatasetConfig] = field(
        default_factory=list, metadata={"help": "Datasets of the mixture: in YAML a list of {path, name, data_dir, "
                                                "data_files, split, columns}; on the command line JSON objects or "
                                                "bare paths."})
    streaming: bool = field(default=False, metadata={"help": "Load the mixture as an IterableDataset."})
    test_split_size: float | None = field(
        default=None, metadata={"help": "Hold out this share (a float < 1) or this many rows (>= 1) of the mixture "
                                        "as the test split. Default: no test split."})

    def __post_init__(self):
        for i, dataset in enumerate(self.datasets):
            if isinstance(dataset, str):
                self.datasets[i] = DatasetConfig(path=dataset)
            elif isinstance(dataset, dict):
                unknown = sorted(set(dataset) - {f.name for f in dataclasses.fields(DatasetConfig)})
                if unknown:
                    raise ValueError(f"datasets[{i}]: unknown key(s) {unknown}; a dataset has path, name, data_dir, "
                                     "data_files, split and columns")
                self.datasets[i] = DatasetConfig(**dataset)


# ---------------------------------------------------------------------------- datasets

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



def load_split(path: str, split: str = "train", name: str | None = None, data_dir: str | None = None,
               data_files=None, streaming: bool = False):
    """One split of a dataset, offline. `split` may be a slice of one or several splits in `datasets`' syntax
    (`train[:50%]`, `train[10:20]`, `train+test`); a builder name with data_files/data_dir goes to
    `datasets.load_dataset` as is, anything else to posttrain's loader (`load_dataset_arg`)."""
    import datasets

    if data_files is not None or data_dir is not None:
        return datasets.load_dataset(path, name=name, data_dir=data_dir, data_files=data_files, split=split,
                                     streaming=streaming)
    from datasets.arrow_reader import ReadInstruction

    try:
        instruction = ReadInstruction.from_spec(split)
    except (ValueError, AssertionError) as err:
        raise ValueError(f"dataset {path!r}: split {split!r} is not a split name or a slice such as "
                         f"train[:50%] or train[10:20] ({err})") from None
    wanted = list(dict.fromkeys(part.splitname for part in instruction._relative_instructions))
    whole = {name_: load_dataset_arg(path, name_, name) for name_ in wanted}
    parts = [whole[part.splitname].select(range(part.from_, part.to))
             for part in instruction.to_absolute({k: len(v) for k, v in whole.items()})]
    dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return dataset.to_iterable_dataset() if streaming else dataset


def get_dataset(mixture_config: DatasetMixtureConfig):
    """The mixture's datasets, each loaded (`load_split`) and cut to its columns, concatenated in order, as a
    `DatasetDict` with a "train" split, and a "test" split when `test_split_size` is set."""
    import datasets

    loaded = []
    for i, config in enumerate(mixture_config.datasets):
        dataset = load_split(config.path, config.split, config.name, config.data_dir, config.data_files,
                             mixture_config.streaming)
        if config.columns is not None:
            missing = [c for c in config.columns if c not in (dataset.column_names or [])]
            if missing:
                raise ValueError(f"datasets[{i}] ({config.path!r}, split {config.split!r}): no column(s) {missing}; "
                                 f"it has {dataset.column_names}")
            dataset = dataset.select_columns(config.columns)
        loaded.append(dataset)
    if not loaded:
        raise ValueError("the dataset mixture is empty: give at least one dataset in `datasets`")
    try:
        combined = datasets.concatenate_datasets(loaded)
    except ValueError as err:
        columns = [d.column_names for d in loaded]
        raise ValueError(f"the mixture's datasets cannot be concatenated: their columns differ ({columns}); select "
                         f"the same columns in each (`columns:`) ({err})") from err
    if mixture_config.test_split_size is None:
        return datasets.DatasetDict({"train": combined})
    if mixture_config.streaming:
        raise ValueError("test_split_size needs the whole mixture to split it, which streaming does not load; "
                         "set streaming to false or give a separate test dataset")
    # a fixed seed: the same rows are held out in every run (and in every process of a distributed one)
    return combined.train_test_split(test_size=mixture_config.test_split_size, seed=0)


# ---------------------------------------------------------------------------- model helpers

def get_peft_config(model_args: ModelConfig):
    """The `peft.LoraConfig` the LoRA fields describe (bias untrained), or None without use_peft."""
    if not model_args.use_peft:
        return None
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise ImportError("use_peft needs the peft package: pip install 'posttrain[peft]'") from err
    target = model_args.lora_target_modules
    target = "all-linear" if target == ["all-linear"] else target
    return LoraConfig(task_type=model_args.lora_task_type, r=model_args.lora_r, target_modules=target,
                      target_parameters=model_args.lora_target_parameters, lora_alpha=model_args.lora_alpha,
                      lora_dropout=model_args.lora_dropout, bias="none", use_rslora=model_args.use_rslora,
                      use_dora=model_args.use_dora, modules_to_save=model_args.lora_modules_to_save)


def get_quantization_config(model_args: ModelConfig):
    """A `transformers.BitsAndBytesConfig` for load_in_4bit (compute and storage dtype: `dtype`) or load_in_8bit,
    else None. Loading with it needs the bitsandbytes package, whose 4- and 8-bit layers run on CPU and CUDA."""
    if not (model_args.load_in_4bit or model_args.load_in_8bit):
        return None
    from transformers import BitsAndBytesConfig

    if model_args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    dtype = None if model_args.dtype in (None, "auto") else model_args.dtype  # "auto": bitsandbytes' defaults
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype,
                              bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
                              bnb_4bit_quant_storage=dtype)


def get_kbit_device_map() -> dict[str, int] | None:
    """`device_map` for a quantized model: the whole model on this process's accelerator ({"": local index}),
    or None on CPU (where from_pretrained keeps it)."""
    import torch

    if torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()):
        from accelerate import PartialState

        return {"": PartialState().local_process_index}
    return None


# ---------------------------------------------------------------------------- TrlParser

class TrlParser(argparse.ArgumentParser):
    """An argument parser whose flags are the fields of `dataclass_types` (as transformers' HfArgumentParser makes
    them: a bool field is `--flag`, `--flag true|false`, and `--no_flag` when it defaults to True; a list field
    takes several words), plus `--config file.yaml`."""

    def __init__(self, dataclass_types=None, **kwargs):
        from posttrain import flags

        if dataclass_types is None:
            dataclass_types = []
        elif dataclasses.is_dataclass(dataclass_types) or not isinstance(dataclass_types, Iterable):
            dataclass_types = [dataclass_types]
        self.dataclass_types = list(dataclass_types)
        for cls in self.dataclass_types:
            if "config" in {f.name for f in dataclasses.fields(cls)}:
                raise ValueError(f"dataclass {cls.__name__} has a field named 'config', which TrlParser keeps for "
                                 "the --config file: rename the field")
        super().__init__(**kwargs)
        self.flags: dict[str, Any] = {}  # field name -> flags._Flag (the first dataclass that has it makes the flag)
        for cls in self.dataclass_types:
            new = {k: v for k, v in flags._flags(cls).items() if k not in self.flags}
            flags._add_flags(self, cls, new, cls.__name__)
            self.flags.update(new)
        self.add_argument("--config", default=argparse.SUPPRESS,
                          help="YAML file of `field: value` pairs (and an `env:` mapping of environment variables); "
                               "command-line flags override it.")
        self._config_values: dict[str, Any] = {}

    def set_defaults_with_config(self, **kwargs) -> list[str]:
        """Take `kwargs` (field: value, type-checked) as defaults below the command line; returns the
        `--key value` strings of the keys no dataclass has."""
        from posttrain.flags import _yaml_value

        remaining = []
        for key, value in kwargs.items():
            flag = self.flags.get(key)
            if flag is None:
                remaining += [f"--{key}", str(value)]
                continue
            try:
                self._config_values[key] = _yaml_value(flag, value)
            except (ValueError, TypeError):
                raise ValueError(f"config field {key!r}: expected {flag.type_name}, got {type(value).__name__} "
                                 f"{value!r}") from None
        return remaining

    def parse_args_into_dataclasses(self, args=None, return_remaining_strings: bool = False, **_ignored):
        """One instance of each dataclass type from `args` (default: sys.argv[1:]) over the config's values
        over the defaults; `return_remaining_strings` appends the words no flag took (else they are an error)."""
        namespace, remaining = self.parse_known_args(list(args) if args is not None else sys.argv[1:])
        given = {**self._config_values, **{k: v for k, v in vars(namespace).items() if k != "config"}}
        outputs = []
        for cls in self.dataclass_types:
            names = {f.name for f in dataclasses.fields(cls) if f.init}
            missing = [f"--{f.name}" for f in dataclasses.fields(cls) if f.init and f.name not in given
                       and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
            if missing:
                self.error(f"the following arguments are required: {', '.join(missing)}")
            try:
                outputs.append(cls(**{k: v for k, v in given.items() if k in names}))
            except (ValueError, TypeError) as err:
                self.error(f"invalid {cls.__name__}: {err}")
        if return_remaining_strings:
            return (*outputs, remaining)
        if remaining:
            raise ValueError(f"Some specified arguments are not used by the TrlParser: {remaining}")
        return tuple(outputs)

    def parse_args_and_config(self, args=None, return_remaining_strings: bool = False,
                              fail_with_unknown_args: bool = True):
        """The dataclasses from the command line over `--config file.yaml` over the defaults; the file's `env:`
        mapping is put into os.environ first. Keys of the file that no dataclass has are returned with the
        remaining strings, or raise (fail_with_unknown_args), or are ignored."""
        args = list(args) if args is not None else sys.argv[1:]
        config_remaining = []
        path = _pop_config(args)
        if path is not None:
            config_remaining = self.set_defaults_with_config(**read_config(path))
        output = self.parse_args_into_dataclasses(args, return_remaining_strings=return_remaining_strings)
        if return_remaining_strings:
            return (*output[:-1], config_remaining + output[-1])
        if fail_with_unknown_args and config_remaining:
            raise ValueError(f"unknown field(s) in the config file: {config_remaining[::2]}; remove them, add them to "
                             "a dataclass, or pass fail_with_unknown_args=False")
        return output

    def parse_dict(self, args: dict[str, Any], allow_extra_keys: bool = False):
        """The dataclasses from a dict of field values (as transformers' HfArgumentParser.parse_dict)."""
        unknown = set(args) - {f.name for cls in self.dataclass_types for f in dataclasses.fields(cls)}
        if unknown and not allow_extra_keys:
            raise ValueError(f"Some keys are not used by the TrlParser: {sorted(unknown)}")
        return tuple(cls(**{k: v for k, v in args.items() if k in {f.name for f in dataclasses.fields(cls)}})
                     for cls in self.dataclass_types)


def _pop_config(args: list[str]) -> str | None:
    """Remove `--config PATH` (or `--config=PATH`) from `args` and return PATH."""
    for i, word in enumerate(args):
        if word == "--config":
            if i + 1 >= len(args):
                raise ValueError("--config needs a YAML file path")
            path = args[i + 1]
            del args[i:i + 2]
            return path
        if word.startswith("--config="):
            del args[i]
            return word.split("=", 1)[1]
    return None


def read_config(path: str) -> dict:
    """The YAML file's mapping, after putting its `env:` mapping into os.environ."""
    import yaml

    try:
        with open(path) as handle:
            data = yaml.safe_load(handle) or {}
    except OSError as err:
        raise ValueError(f"cannot read --config file: {err}") from err
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold `field: value` pairs, got {type(data).__name__}")
    env = data.pop("env", {}) or {}
    if not isinstance(env, dict):
        raise ValueError(f"{path}: `env` must be a mapping of environment variables, got {type(env).__name__}")
    for key, value in env.items():
        os.environ[str(key)] = str(value)
    return data
