"""What the offline preference trainers (reward, DPO, BCO, KTO, ORPO, CPO, TPO) share: one data path and one
reference path.

* `prepare_preference_dataset`: validate any accepted layout (formats.validate names the bad
  row), convert it to pairs (`prompt_ids`, `chosen_ids`, `rejected_ids`) or to unpaired rows
  (`prompt_ids`, `completion_ids`, `label`), truncate, and report once how many rows were
  dropped (prompt alone too long) or truncated.
* `PreferenceCollator`: right-padded tensors. Pairs are stacked [chosen; rejected] as 2B rows,
  so that one forward pass scores both; with `kl_pairs` (KTO) B mismatched rows (completion i
  after prompt i+1) follow the B real ones.
* the forward that scores the rows is `forward.completions.completion_logps`.
* `PreferenceTrainer`: BaseTrainer plus the above, the reference forward, its sync (TR-DPO) or
  precomputation, a prediction_step for evaluation (scores for `compute_metrics`), a cumulative
  token count, and (BCO, DPO's bco_pair) the running reward mean δ, folded in once per optimizer
  step and saved with every checkpoint.
* `generate_during_eval` (a config field of BCO): each evaluation first samples completions of a few eval
  prompts from the policy and the reference, shown side by side (`eval_samples.py`).
* `PairDataConfig`: lengths, truncation_mode and dropout; `ReferenceFreePairConfig` adds what ORPO and CPO
  share (their learning rate, keep_end truncation, generate_during_eval); `PreferenceConfig` adds the
  reference handling (DPO, KTO).
* `ReferenceFreePairTrainer`: the PreferenceTrainer of ORPO, CPO and TPO, whose losses read the policy's own
  log-probs only (no reference model), with TRL's constructor arguments and `record_pairs` for their metrics.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers import TrainerCallback

from posttrain.core.running import RunningMean
from posttrain.data import formats, multimodal
from posttrain.data.collate import pad
from posttrain.data.utils import unpair_preference_dataset
from posttrain.data.vision_collate import VisionPreferenceCollator
from posttrain.data.tokenize import encode_prompt_completion
from posttrain.forward.completions import completion_logps
from posttrain.models import loading
from posttrain.models.modes import disable_dropout, eval_mode
from posttrain.models.vision import vision_run, vision_scorer
from posttrain.trainers.base import (EVAL_SET, BaseConfig, BaseTrainer, SyncRefModelCallback, as_dataset,
                                     check_datasets, classic_arguments, errors_named, is_streamed,
                                     latest_checkpoint, map_datasets)

logger = logging.getLogger(__name__)

RUNNING_FILE = "running_reward_mean.json"  # δ's state, next to the weights of every checkpoint


def check_beta_and_lengths(config):
    """The checks the DPO, BCO and KTO configs share: beta > 0, every length limit >= 1 (or None), and
    max_prompt_length < max_length."""
    if config.beta <= 0:
        raise ValueError(f"beta must be > 0, got {config.beta}")
    for name in ("max_length", "max_prompt_length", "max_completion_length"):
        value = getattr(config, name, None)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be a positive number of tokens or None (no limit), got {value}")
    if config.max_length is not None and config.max_prompt_length is not None \
            and config.max_prompt_length >= config.max_length:
        raise ValueError(f"max_prompt_length ({config.max_prompt_length}) must be below max_length "
                         f"({config.max_length}) to leave room for the completion")
    mode = getattr(config, "truncation_mode", "keep_start")
    if mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation_mode must be one of {TRUNCATION_MODES}, got {mode!r}")


TRUNCATION_MODES = ("keep_start", "keep_end")


@dataclass
class PairDataConfig(BaseConfig):
    """Sequence limits and dropout: what every offline preference config has (the reference-free ORPO, CPO and
    TPO configs are this plus their loss fields)."""

    max_length: int | None = field(default=1024, metadata={
        "help": "Maximum tokens of prompt + completion; `truncation_mode` says which end survives (None: no limit)."})
    max_prompt_length: int | None = field(default=None, metadata={
        "help": "Keep only the last this many prompt tokens (None: no prompt limit besides max_length)."})
    max_completion_length: int | None = field(default=None, metadata={
        "help": "Cut completions to their first this many tokens (None: only max_length limits them)."})
    truncation_mode: str = field(default="keep_start", metadata={
        "help": "What survives when prompt + completion exceed max_length. 'keep_start': the whole prompt, the "
                "completion's end is cut, and rows whose prompt alone reaches max_length are dropped. 'keep_end': "
                "the completion, by cutting the prompt's start (down to one token; only then is the completion's "
                "end cut). For pairs the prompt is cut to fit the longer completion.",
        "choices": list(TRUNCATION_MODES)})
    disable_dropout: bool = field(default=True, metadata={
        "help": "Set every dropout probability of the model to 0, so policy and reference log-probs are comparable."})

    def _check(self):
        check_beta_and_lengths(self)


@dataclass
class ReferenceFreePairConfig(PairDataConfig):
    """The fields ORPOConfig and CPOConfig share besides their loss's (TRL's defaults of both)."""

    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (AdamW)."})
    truncation_mode: str = field(default="keep_end", metadata={
        "help": "What survives when prompt + completion exceed max_length: 'keep_end' cuts the prompt's start "
                "first, 'keep_start' keeps the whole prompt and cuts the completion's end (see PairDataConfig).",
        "choices": list(TRUNCATION_MODES)})
    generate_during_eval: bool = field(default=False, metadata={
        "help": "At each evaluation, sample completions of a few eval prompts from the policy and log them "
                "as a table (the logging integrations' table, else the console)."})


@dataclass
class PreferenceConfig(PairDataConfig):
    """Fields DPOConfig and KTOConfig share: sequence limits and the reference model's handling."""

    precompute_ref_log_probs: bool = field(default=False, metadata={
        "help": "Score the train (and eval) data with the reference once before training, store the "
                "log-probs as dataset columns and free the reference model."})
    sync_ref_model: bool = field(default=False, metadata={
        "help": "TR-DPO (Gorbatovski et al. 2024): every `ref_model_sync_steps` steps set "
                "ref <- α·policy + (1-α)·ref."})
    ref_model_mixup_alpha: float = field(default=0.6, metadata={
        "help": "α of the reference sync (TR-DPO), in [0, 1]."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "Optimizer steps between reference syncs."})

    def _check(self):
        super()._check()
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ValueError("sync_ref_model updates the reference during training, so its log-probs cannot be "
                             "precomputed; set precompute_ref_log_probs=False or sync_ref_model=False")
        if not 0 <= self.ref_model_mixup_alpha <= 1:
            raise ValueError(f"ref_model_mixup_alpha must be in [0, 1], got {self.ref_model_mixup_alpha}")
        if self.ref_model_sync_steps < 1:
            raise ValueError(f"ref_model_sync_steps must be >= 1, got {self.ref_model_sync_steps}")


# ---------------------------------------------------------------------------------------- data

def _fit(prompt_ids: list[int], completions: list[list[int]], max_length, max_prompt_length, max_completion_length,
         truncation_mode: str = "keep_start"):
    """(prompt_ids, completions, truncated) cut to the limits, or None when the prompt leaves no room.

    `completions` share the prompt (a pair's chosen and rejected), so the prompt is cut once for all."""
    truncated = False
    if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
        prompt_ids, truncated = prompt_ids[-max_prompt_length:], True  # keep the end: nearest the answer
    if max_completion_length is not None and any(len(c) > max_completion_length for c in completions):
        completions, truncated = [c[:max_completion_length] for c in completions], True
    if max_length is None:
        return prompt_ids, completions, truncated
    longest = max(len(c) for c in completions)
    if truncation_mode == "keep_end" and len(prompt_ids) + longest > max_length:
        # one prompt token stays: the first completion token is scored from it
        prompt_ids, truncated = prompt_ids[-max(max_length - longest, 1):], True
    if len(prompt_ids) >= max_length:
        return None
    room = max_length - len(prompt_ids)
    if longest > room:
        completions, truncated = [c[:room] for c in completions], True
    return prompt_ids, completions, truncated


RANKED_RULE = "'scores' (higher is better) or 'ranks' (lower is better, 0 = best)"


def ranked_columns(batch: dict[str, list], indices, name: str = "train") -> dict[str, list]:
    """Ranked rows (`responses` with `scores` or `ranks`) as formats reads them: the classic `instruction`
    key is their prompt, and rows that give `ranks` get them as `scores` (-rank) where rows of one dataset
    mix the two. A row that gives both, or neither, is refused, naming it. Other batches pass unchanged."""
    if "responses" not in batch:
        return batch
    batch = dict(batch)  # a new dict: datasets' map would drop the columns of the very batch it passed
    if "instruction" in batch:
        prompts = batch.get("prompt") or [None] * len(batch["instruction"])
        batch["prompt"] = [p if p is not None else q for p, q in zip(prompts, batch.pop("instruction"))]
    keys = [k for k in ("ranks", "scores") if k in batch]
    if not keys:
        raise ValueError(f"{name} data: rows with 'responses' need {RANKED_RULE}, one number per response")
    for i, values in zip(indices, zip(*(batch[k] for k in keys))):
        given = sum(v is not None for v in values)
        if given != 1:
            raise ValueError(f"{name} data, row {i} gives {'both' if given else 'neither'}: a row with 'responses' "
                             f"gives one of {RANKED_RULE}")
    if len(keys) == 2:
        scores = [score if score is not None else [-r for r in rank]
                  for rank, score in zip(batch["ranks"], batch["scores"])]
        batch = {**{k: v for k, v in batch.items() if k != "ranks"}, "scores": scores}
    return batch


PRETOKENISED = (("chosen_ids", "rejected_ids"), ("chosen_input_ids", "rejected_input_ids"))


def _token_ids(value, row: int, column: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise formats.FormatError(f"row {row}, column {column!r}: expected a list of token ids (ints), "
                                  f"got {type(value).__name__}")
    return list(value)


def pretokenised_pairs(dataset, name: str = "train") -> dict[str, list] | None:
    """Columns of already-tokenised pairs, or None when `dataset` has none.

    Rows hold `chosen_ids` / `rejected_ids` (or TRL's `chosen_input_ids` / `rejected_input_ids`),
    optionally with `prompt_ids`. Without `prompt_ids` the ids are whole sequences and their longest
    common prefix is taken as the prompt (the shared part of a pair), so each completion starts where
    the two differ."""
    names = next((pair for pair in PRETOKENISED if set(pair) <= set(dataset.column_names)), None)
    if names is None:
        return None
    has_prompt = "prompt_ids" in dataset.column_names
    out: dict[str, list] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    for i, row in enumerate(dataset):
        chosen, rejected = (_token_ids(row[c], i, c) for c in names)
        if has_prompt:
            prompt = _token_ids(row["prompt_ids"], i, "prompt_ids")
        else:
            shared = 0
            while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
                shared += 1
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not chosen or not rejected:
            raise formats.FormatError(f"{name} data, row {i}: an empty chosen or rejected completion")
        out["prompt_ids"].append(prompt)
        out["chosen_ids"].append(chosen)
        out["rejected_ids"].append(rejected)
    if not out["prompt_ids"]:
        raise ValueError(f"{name} data has no rows")
    return out


def prepare_preference_dataset(dataset, tokenizer, *, paired: bool, max_length: int | None,
                               max_prompt_length: int | None = None, max_completion_length: int | None = None,
                               keep: tuple[str, ...] = (), name: str = "train", truncation_mode: str = "keep_start",
                               extra_completions: tuple[str, ...] = ()):
    """Validate, convert and tokenise `dataset` for pairwise (`paired`) or unpaired training.

    Any layout formats accepts works (ranked rows expand to every ordered pair, implicit prompts
    are split off; with `paired=False` pairs become a desirable and an undesirable row), as does a
    list of row dicts. Columns in `keep` (e.g. "margin") are carried through. Long prompts lose
    their start, long completions their end; with `truncation_mode="keep_start"` rows whose prompt
    alone reaches `max_length` are dropped, with "keep_end" the prompt's start is cut first (see
    `_fit`). A streamed dataset (IterableDataset) is converted and tokenised lazily, batch by
    batch, as rows are read (no count of dropped or truncated rows then). `extra_completions` (pairs
    only; TPO's "reference") are more completion columns of the same prompt, tokenised and cut with the
    pair into `<column>_ids`.
    """
    from datasets import IterableDataset

    dataset = as_dataset(dataset, name)
    target = "preference" if paired else "unpaired_preference"
    text_cols = ("chosen", "rejected", *extra_completions) if paired else ("completion",)
    limits = (max_length, max_prompt_length, max_completion_length, truncation_mode)

    def encode(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"prompt_ids": [], "truncated": [], **{f"{c}_ids": [] for c in text_cols}}
        if not paired:
            out["label"] = []
        for c in extras:
            out[c] = []
        for k, row in enumerate(indices):
            tools = batch["tools"][k] if "tools" in batch else None
            encoded = [encode_prompt_completion(tokenizer, batch["prompt"][k], batch[col][k], None, row, tools=tools)
                       for col in text_cols]
            fitted = _fit(encoded[0]["prompt_ids"], [e["completion_ids"] for e in encoded], *limits)
            if fitted is None:
                continue
            prompt_ids, completions, truncated = fitted
            out["prompt_ids"].append(prompt_ids)
            for col, completion in zip(text_cols, completions):
                out[f"{col}_ids"].append(completion)
            out["truncated"].append(truncated)
            if not paired:
                out["label"].append(bool(batch["label"][k]))
            for c in extras:
                out[c].append(batch[c][k])
        return out

    if isinstance(dataset, IterableDataset):
        columns = dataset.column_names or list(next(iter(dataset)))
        extras = [c for c in keep if c in columns]

        def stream(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
            batch = ranked_columns(batch, indices, name)
            rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
            try:  # the batch's rows as a list: formats validates and converts them as such
                rows, _ = formats.to_canonical(rows, target=target)
            except formats.FormatError as err:
                raise formats.FormatError(f"{name} data, in the batch from row {indices[0]} on: {err}") from None
            canonical = {c: [r.get(c) for r in rows] for c in dict.fromkeys(k for r in rows for k in r)}
            out = encode(canonical, list(range(indices[0], indices[0] + len(rows))))
            del out["truncated"]
            return out

        return dataset.map(stream, batched=True, with_indices=True, remove_columns=columns)
    tokenised = pretokenised_pairs(dataset, name) if paired and not extra_completions else None
    if tokenised is not None:
        return _fit_pretokenised(dataset, tokenised, keep, limits, name)
    if "responses" in dataset.column_names:
        dataset = dataset.map(lambda batch, indices: ranked_columns(batch, indices, name), batched=True,
                                  with_indices=True, remove_columns=dataset.column_names, desc="ranked rows")
    dataset, _ = formats.to_canonical(dataset, target=target)  # validates every row first
    missing = [c for c in extra_completions if c not in dataset.column_names]
    if missing:
        raise formats.FormatError(f"{name} data has no {missing} column(s): each row needs them beside 'prompt', "
                                  f"'chosen' and 'rejected' (completions of the same prompt)")
    extras = [c for c in keep if c in dataset.column_names]

    before = len(dataset)
    dataset = dataset.map(encode, batched=True, with_indices=True, remove_columns=dataset.column_names,
                          desc=f"tokenising {name} data")
    _report_tokenised(dataset, before, name, paired, max_length, max_prompt_length, max_completion_length)
    return dataset.remove_columns("truncated")


def _report_tokenised(dataset, before: int, name: str, paired: bool, max_length, max_prompt_length,
                      max_completion_length) -> None:
    """Once per dataset: warn of identical pairs and of dropped or truncated rows; refuse an emptied dataset."""
    if paired and len(dataset):
        warn_identical_pairs(name, dataset["chosen_ids"], dataset["rejected_ids"])
    dropped, truncated = before - len(dataset), sum(dataset["truncated"]) if len(dataset) else 0
    if dropped or truncated:
        unit = "pairs" if paired else "rows"
        logger.warning(f"{name} data: dropped {dropped} of {before} {unit} whose prompt alone reaches "
                       f"max_length={max_length}; truncated {truncated} {unit} to max_length={max_length}, "
                       f"max_prompt_length={max_prompt_length}, max_completion_length={max_completion_length}")
    if len(dataset) == 0:
        raise ValueError(f"no {name} rows are left after tokenisation: every prompt reaches max_length={max_length} "
                         f"(raise max_length, set max_prompt_length, or truncation_mode='keep_end' to cut prompts)")


def warn_identical_pairs(name: str, chosen: list, rejected: list) -> None:
    """Warn when pairs have chosen == rejected (the same tokens): such a pair has no margin to learn from, and
    data where every pair is one (a column copied into the other) trains nothing without a word."""
    same = sum(c == r for c, r in zip(chosen, rejected))
    if same:
        every = "every pair has" if same == len(chosen) else f"{same} of {len(chosen)} pairs have"
        logger.warning(f"{name} data: {every} chosen == rejected (the same tokens after truncation): such a pair "
                       "gives the loss no margin to learn from; check the dataset's 'chosen' and 'rejected' columns")


def _fit_pretokenised(dataset, tokenised: dict[str, list], keep: tuple[str, ...], limits: tuple, name: str):
    """`prepare_preference_dataset` for pairs given as token ids (`pretokenised_pairs`): fitted to the
    limits (max_length, max_prompt_length, max_completion_length, truncation_mode), columns in `keep` kept."""
    from datasets import Dataset

    extras = [c for c in keep if c in dataset.column_names]
    for i, value in enumerate(dataset["margin"] if "margin" in extras else ()):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise formats.FormatError(f"{name} data, row {i}, column 'margin': expected a finite number, "
                                      f"got {value!r}")
    warn_identical_pairs(name, tokenised["chosen_ids"], tokenised["rejected_ids"])
    fitted = [_fit(p, [c, r], *limits) for p, c, r in zip(*tokenised.values())]
    kept = [i for i, f in enumerate(fitted) if f is not None]
    if not kept:
        raise ValueError(f"no {name} rows are left: every prompt reaches max_length={limits[0]}")
    return Dataset.from_dict({"prompt_ids": [fitted[i][0] for i in kept],
                              "chosen_ids": [fitted[i][1][0] for i in kept],
                              "rejected_ids": [fitted[i][1][1] for i in kept],
                              **{c: [dataset[c][i] for i in kept] for c in extras}})


class PreferenceCollator:
    """Rows of token ids -> right-padded tensors.

    paired: input_ids / attention_mask / completion_mask (2B, T), chosen rows first; optional
    margin, ref_chosen_logps, ref_rejected_logps (B,).
    unpaired: the same for B rows plus label (B,) bool; optional udm_weight (B,) (BCO's density ratios),
    ref_logps and ref_kl_logps (B,) (KTO's precomputed reference).
    With kl_pairs: B more rows follow (KTO's KL estimate): prompt i followed by the row's
    `kl_completion_ids` where the dataset fixes them (precomputed reference), else completion i after
    prompt (i+1) mod B. Each of `extra_completions` (TPO's "reference") gives B rows of its own:
    `<column>_input_ids`, `<column>_attention_mask`, `<column>_completion_mask` (B, T').
    """

    def __init__(self, pad_token_id: int, paired: bool = True, kl_pairs: bool = False, max_length: int | None = None,
                 extra_completions: tuple[str, ...] = ()):
        self.pad_token_id, self.paired, self.kl_pairs, self.max_length = pad_token_id, paired, kl_pairs, max_length
        self.extra_completions = extra_completions

    def rows(self, prompts: list[list[int]], completions: list[list[int]], prefix: str = "") -> dict[str, Tensor]:
        """[prompt | completion] rows right-padded: input_ids, attention_mask, completion_mask, each (N, T)."""
        seqs = [p + c for p, c in zip(prompts, completions)]
        return {
            f"{prefix}input_ids": pad(seqs, self.pad_token_id),
            f"{prefix}attention_mask": pad([[1] * len(s) for s in seqs], 0),
            f"{prefix}completion_mask": pad([[0] * len(p) + [1] * len(c) for p, c in zip(prompts, completions)], 0),
        }

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        prompts = [list(r["prompt_ids"]) for r in rows]
        if self.paired:
            completions = [list(r["chosen_ids"]) for r in rows] + [list(r["rejected_ids"]) for r in rows]
            prompts = prompts + prompts
        else:
            completions = [list(r["completion_ids"]) for r in rows]
        if self.kl_pairs:
            if "kl_completion_ids" in rows[0]:
                kl_prompts, kl_completions = prompts, [list(r["kl_completion_ids"]) for r in rows]
            else:
                kl_prompts, kl_completions = prompts[1:] + prompts[:1], completions
            room = [None if self.max_length is None else self.max_length - len(p) for p in kl_prompts]
            completions = completions + [c[:n] for c, n in zip(kl_completions, room)]
            prompts = prompts + kl_prompts
        batch = self.rows(prompts, completions)
        for column in self.extra_completions:  # e.g. TPO's reference: rows of their own, B of them
            batch.update(self.rows([list(r["prompt_ids"]) for r in rows], [list(r[f"{column}_ids"]) for r in rows],
                                   prefix=f"{column}_"))
        if not self.paired:
            batch["label"] = torch.tensor([bool(r["label"]) for r in rows])
        for key in ("margin", "ref_chosen_logps", "ref_rejected_logps", "udm_weight", "ref_logps", "ref_kl_logps"):
            if key in rows[0] and rows[0][key] is not None:
                batch[key] = torch.tensor([float(r[key]) for r in rows])
        return batch


@torch.no_grad()
def preference_accuracy(model, tokenizer, dataset, batch_size: int = 64) -> float:
    """Fraction of preference pairs for which the policy gives the chosen completion the higher
    log-probability, log π(chosen|x) > log π(rejected|x) (e.g. on held-out data)."""
    data = prepare_preference_dataset(dataset, tokenizer, paired=True, max_length=None, name="evaluation")
    collate, device = PreferenceCollator(tokenizer.pad_token_id), next(model.parameters()).device
    wins = 0
    with eval_mode(model):
        for start in range(0, len(data), batch_size):
            batch = collate([data[i] for i in range(start, min(start + batch_size, len(data)))])
            logps = completion_logps(model, *(batch[k].to(device) for k in ("input_ids", "attention_mask",
                                                                            "completion_mask")), paired=True)[0]
            chosen, rejected = logps.chunk(2)
            wins += int((chosen > rejected).sum())
    return wins / len(data)


def check_vision_pair_options(args, extra_completions: tuple[str, ...] = ()) -> None:
    """Refuse the preference options the vision path cannot honour, naming them: prompt truncation (it would cut
    image placeholders; a row is cut from its end only, after the images are expanded) and extra completions."""
    if getattr(args, "max_prompt_length", None) is not None or getattr(args, "truncation_mode", "keep_start") != \
            "keep_start":
        raise ValueError("max_prompt_length and truncation_mode='keep_end' cut prompts, which would cut the image "
                         "placeholders of vision-language rows: leave max_prompt_length=None and truncation_mode="
                         "'keep_start' (max_length then cuts each row's end, never its images)")
    if extra_completions:
        raise ValueError(f"vision-language rows with extra completions {list(extra_completions)} are not supported")


def to_device(batch: dict, device) -> dict:
    """A collated batch on `device`, the nested `model_inputs` dict of a vision batch included."""
    return {k: to_device(v, device) if isinstance(v, dict) else v.to(device) for k, v in batch.items()}


# ---------------------------------------------------------------------------------------- trainer

class _FoldRewards(TrainerCallback):
    """After each optimizer step, fold the step's rewards into the running mean δ (all processes)."""

    def __init__(self, trainer: "PreferenceTrainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        pending = self.trainer._pending_rewards
        if pending:
            self.trainer.reward_mean.update(torch.cat(pending), self.trainer.accelerator)
            pending.clear()


class PreferenceTrainer(BaseTrainer):
    """BaseTrainer for offline preference data; subclasses implement `compute_loss`."""

    paired = True  # pairs (reward, DPO) or unpaired rows (BCO, KTO)
    kl_pairs = False  # KTO: the collator appends mismatched rows for the KL reference point
    keep_columns: tuple[str, ...] = ()  # extra dataset columns the collator reads
    extra_completions: tuple[str, ...] = ()  # more completions of each pair's prompt (TPO: "reference")
    uses_reward_mean = False  # BCO / bco_pair: keep the running reward mean δ
    # columns precompute_ref_log_probs adds: the reference log-probs of the collated rows, one block each
    reference_columns: tuple[str, ...] = ("ref_chosen_logps", "ref_rejected_logps")

    def __init__(self, model, ref_model, args, *, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None, callbacks=None, optimizers=(None, None),
                 needs_reference: bool = True, model_kind: str = "causal-lm", compute_metrics=None):
        train_dataset, eval_dataset = as_dataset(train_dataset), as_dataset(eval_dataset, "eval_dataset")
        check_datasets(args, train_dataset, eval_dataset)  # before tokenising, which would blame max_length
        sync = needs_reference and getattr(args, "sync_ref_model", False)
        if sync and ref_model is None and (peft_config is not None or loading.is_peft_model(model)):
            raise ValueError("sync_ref_model needs a separate reference model, but with a PEFT model the "
                             "reference is the adapter-disabled policy; pass ref_model= or unset sync_ref_model")
        if needs_reference and getattr(args, "precompute_ref_log_probs", False) \
                and (is_streamed(train_dataset) or is_streamed(eval_dataset)):
            raise ValueError("precompute_ref_log_probs stores reference log-probs as a column of the whole dataset, "
                             "which a streamed dataset (IterableDataset) does not have; unset one of them")
        trust = (args.model_init_kwargs or {}).get("trust_remote_code", False)
        # a vision-language model (or a dataset with images, refused for a text-only model) takes the vision path
        self.vision = vision_run(model, train_dataset, type(self).__name__)
        if self.vision:
            check_vision_pair_options(args, self.extra_completions)
            if model_kind == "seq-cls":  # a reward model: the VLM's body under a score head
                model = model if not isinstance(model, str) else loading.load_sequence_classifier(
                    model, **(args.model_init_kwargs or {}))
                model = vision_scorer(model)
            else:
                model = loading.load_vision_lm(model, **(args.model_init_kwargs or {}))
            tokenizer = loading.load_processor(processing_class, model=model, trust_remote_code=trust)
        else:
            tokenizer = loading.load_tokenizer(processing_class, model=model, trust_remote_code=trust)
        self._prepare = dict(tokenizer=tokenizer, paired=self.paired, max_length=args.max_length,
                             max_prompt_length=getattr(args, "max_prompt_length", None),
                             max_completion_length=getattr(args, "max_completion_length", None),
                             keep=self.keep_columns, truncation_mode=getattr(args, "truncation_mode", "keep_start"),
                             extra_completions=self.extra_completions)
        self.ref_precomputed = False
        train_dataset = self.prepare_rows(train_dataset, "train")
        with errors_named(EVAL_SET):
            eval_dataset = map_datasets(self.prepare_eval_dataset, eval_dataset, name="eval")
        collator = data_collator or self.make_collator(tokenizer, args.max_length, self.extra_completions)
        super().__init__(model, args, processing_class=tokenizer, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, data_collator=collator, peft_config=peft_config,
                         callbacks=callbacks, optimizers=optimizers, model_kind=model_kind,
                         compute_metrics=compute_metrics)
        # compute_loss returns the micro-batch mean; let Trainer divide by the accumulation steps
        self.loss_is_scaled_for_ga = False
        if getattr(args, "disable_dropout", False):
            disable_dropout(self.model)
        # whether the reference is the policy's initial weights (precompute_ref_log_probs: the untrained model can
        # stand in for it on new evaluation data)
        self._reference_is_policy = ref_model is None or ref_model is model
        self.ref_model = self.make_reference(ref_model, needs_reference)
        if sync:
            self.add_callback(SyncRefModelCallback(self.ref_model))
        if needs_reference and getattr(args, "precompute_ref_log_probs", False):
            self.precompute_reference()
        self._num_tokens = {"train": 0, "eval": 0}
        self.reward_mean, self._pending_rewards = RunningMean(), []
        if self.uses_reward_mean:
            self.add_callback(_FoldRewards(self))
        self.needs_reference = needs_reference

    def prepare_rows(self, dataset, name: str):
        """Raw rows -> what the collator reads: token ids (`prepare_preference_dataset`), or for a vision-language
        model the rows checked and kept whole (`multimodal.prepare_vision_dataset`: the collator processes the
        images batch by batch), pairs split into unpaired rows for the unpaired trainers."""
        if not self.vision:
            return prepare_preference_dataset(dataset, name=name, **self._prepare)
        columns = getattr(dataset, "column_names", None) or list(next(iter(dataset), {}))
        if not self.paired and {"chosen", "rejected"} <= set(columns):
            dataset = unpair_preference_dataset(dataset)
        return multimodal.prepare_vision_dataset(dataset, "paired" if self.paired else "unpaired", name)

    def make_collator(self, processing_class, max_length, extra_completions: tuple[str, ...] = ()):
        """The collator of this trainer's rows: PreferenceCollator, or VisionPreferenceCollator for a VLM."""
        if self.vision:
            return VisionPreferenceCollator(processing_class, self.paired, self.kl_pairs, max_length)
        return PreferenceCollator(processing_class.pad_token_id, self.paired, self.kl_pairs, max_length,
                                  extra_completions)

    def prepare_eval_dataset(self, dataset, name: str = "eval"):
        """Raw evaluation rows -> token ids, as the train data was prepared; prepared data comes back as is."""
        if {"prompt_ids", "row_index"} & set(dataset.column_names or ()):
            return dataset
        prepared = self.prepare_rows(dataset, name)
        if not self.ref_precomputed:
            return prepared
        if self._reference_is_policy and self.state.global_step == 0:
            # the freed reference was the policy's initial weights, which the model still has: it scores the data
            return self.add_reference_columns(prepared)
        why = ("the model has trained since, so it is no longer the reference"
               if self._reference_is_policy else "the separate ref_model is gone")
        raise ValueError(f"precompute_ref_log_probs freed the reference model once the data given at construction was "
                         f"scored and {why}: new evaluation data cannot be scored; pass it as eval_dataset= to the "
                         f"trainer instead")

    # ------------------------------------------------------------------ log-probs
    def reference_logps(self, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                        model_inputs: dict | None = None) -> Tensor:
        """Summed completion log-probs (N,) under the reference (frozen copy or adapter-disabled model);
        model_inputs: the rows' images for a vision-language model (the reference sees the policy's pixels)."""
        model = self.ref_model if self.ref_model is not None else self.accelerator.unwrap_model(self.model)
        with torch.no_grad(), self.reference_context(self.ref_model):
            return completion_logps(model, input_ids, attention_mask, completion_mask, paired=self.paired,
                                    model_inputs=model_inputs)[0]

    def precompute_reference(self) -> None:
        """precompute_ref_log_probs: score the train and eval data once with the reference, store the
        log-probs as `reference_columns`, and free the reference model."""
        self.train_dataset = self.add_reference_columns(self.train_dataset)
        self.eval_dataset = map_datasets(self.add_reference_columns, self.eval_dataset)
        self.ref_model, self.ref_precomputed = None, True

    @torch.no_grad()
    def add_reference_columns(self, dataset):
        """The dataset plus `reference_columns`: the collated rows' reference log-probs, split into one
        block per column (DPO: chosen, rejected; KTO: the rows, their KL rows). Each process scores its share."""
        collate = self.make_collator(self.processing_class, self.args.max_length)
        blocks = len(self.reference_columns)

        def score(rows: list[int]) -> Tensor:  # (len(rows), blocks)
            batch = to_device(collate([dataset[i] for i in rows]), self.accelerator.device)
            extra = batch.get("model_inputs")  # passed only with images (overrides may keep the text-only signature)
            logps = self.reference_logps(batch["input_ids"], batch["attention_mask"], batch["completion_mask"],
                                         *([extra] if extra else []))
            return torch.stack(logps.chunk(blocks), dim=1)

        values = self.shared_pass(len(dataset), score, self.args.per_device_eval_batch_size, "reference log-probs")
        for j, name in enumerate(self.reference_columns):
            dataset = dataset.add_column(name, values[:, j].tolist())
        return dataset

    def shared_pass(self, n: int, compute, batch_size: int, desc: str) -> Tensor:
        """`compute(rows) -> Tensor (len(rows), ...)` for rows 0..n-1, each process computing one contiguous share
        (with a progress bar), gathered in row order on every process.

        Every process runs the same number of batches (the last shares padded with repeats of row n-1, dropped
        after the gather): under ZeRO-3 or FSDP a forward gathers weights from all processes."""
        from tqdm.auto import tqdm

        acc = self.accelerator
        share = math.ceil(n / acc.num_processes)
        rows = [min(acc.process_index * share + i, n - 1) for i in range(share)]
        starts = range(0, share, batch_size)
        pieces = [compute(rows[start:start + batch_size]).to(acc.device)
                  for start in tqdm(starts, desc=desc, disable=self.args.disable_tqdm or not acc.is_local_main_process)]
        if not pieces:
            return torch.zeros(0)
        values = torch.cat(pieces)
        if acc.num_processes > 1:
            values = acc.gather(values)  # (num_processes * share, ...), rank by rank
        return values[:n].cpu()

    def count_tokens(self, attention_mask: Tensor, mode: str) -> None:
        """Cumulative non-padding tokens seen, over all processes (logged as num_tokens)."""
        n = attention_mask.sum().reshape(1)
        self._num_tokens[mode] += int(self.accelerator.gather(n).sum().item())
        self._metrics[mode]["num_tokens"] = [float(self._num_tokens[mode])]

    def masked_means(self, values: dict[str, Tensor], mask: Tensor, mode: str) -> dict[str, float] | None:
        """Record (and return) the mean of each (B,) tensor over the rows where mask is True, across
        processes; None when no process has such a row."""
        mask = mask.bool()
        stacked = torch.stack([torch.where(mask, v.detach().float(), 0.0).sum() for v in values.values()])
        sums = self.accelerator.gather(torch.cat([stacked, mask.sum().float().reshape(1)]).reshape(1, -1)).sum(0)
        if sums[-1] == 0:
            return None
        means = {name: float(total / sums[-1]) for name, total in zip(values, sums[:-1])}
        for name, value in means.items():
            self._metrics[mode][name].append(value)
        return means

    def record_pairs(self, chosen_rewards: Tensor, rejected_rewards: Tensor, logps: Tensor, mean_logits: Tensor,
                     mode: str) -> None:
        """rewards/{chosen,rejected,accuracies,margins}, logps/{chosen,rejected}, logits/{chosen,rejected} of B pairs:
        rewards (B,) each; logps and mean_logits (2B,), chosen rows first."""
        B = chosen_rewards.shape[0]
        self.record({
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": logps[:B].detach().mean(),
            "logps/rejected": logps[B:].detach().mean(),
            "logits/chosen": mean_logits[:B].mean(),
            "logits/rejected": mean_logits[B:].mean(),
        }, mode)

    def record_unpaired(self, rewards: Tensor, logps: Tensor, labels: Tensor, mode: str) -> None:
        """rewards/chosen, rewards/rejected, rewards/margins, logps/chosen, logps/rejected of unpaired
        rows: desirable rows count as chosen, undesirable ones as rejected."""
        labels = labels.bool()
        good = self.masked_means({"rewards/chosen": rewards, "logps/chosen": logps}, labels, mode)
        bad = self.masked_means({"rewards/rejected": rewards, "logps/rejected": logps}, ~labels, mode)
        if good and bad:
            self._metrics[mode]["rewards/margins"].append(good["rewards/chosen"] - bad["rewards/rejected"])

    def mode(self) -> str:
        return "train" if self.model.training else "eval"

    # ------------------------------------------------------------------ running reward mean δ
    def add_pending_rewards(self, rewards: Tensor) -> None:
        """Rewards of a training micro-batch; folded into δ after the optimizer step, so every
        micro-batch of one step sees the same δ whatever the accumulation split."""
        if self.model.training:
            self._pending_rewards.append(rewards.detach().float())

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if self.uses_reward_mean and self.args.should_save:
            folder = output_dir or self.args.output_dir
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, RUNNING_FILE), "w") as f:
                json.dump(self.reward_mean.state_dict(), f)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if self.uses_reward_mean and resume_from_checkpoint:
            folder = resume_from_checkpoint
            if folder is True:
                folder = latest_checkpoint(self.args.output_dir)  # the newest complete one
            path = os.path.join(folder or "", RUNNING_FILE)
            if folder and os.path.exists(path):
                with open(path) as f:
                    self.reward_mean.load_state_dict(json.load(f))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ------------------------------------------------------------------ evaluation
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """(loss, predictions, labels); predictions only for a `compute_metrics`, which then receives
        an EvalPrediction of all evaluation rows: for pairs, predictions (N, 2) = the [chosen, rejected]
        scores (implicit rewards β·log π/π_ref for DPO, the reward model's scores for Reward) and
        label_ids (N,) zeros (column 0, the chosen one, is preferred), so that argmax(predictions)
        == label_ids is the pair accuracy; for unpaired rows (BCO, KTO) predictions (N,) = the rows'
        implicit rewards and label_ids (N,) = their labels (1 desirable, 0 undesirable)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            if prediction_loss_only or self.compute_metrics is None:
                return self.compute_loss(model, inputs).detach(), None, None
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        if self.paired:
            predictions = torch.stack([outputs["rewards_chosen"], outputs["rewards_rejected"]], dim=-1).float()
            labels = torch.zeros(predictions.shape[0], dtype=torch.long, device=predictions.device)
        else:
            predictions, labels = outputs["rewards"].float(), inputs["label"].long()
        return loss.detach(), predictions.detach(), labels

    # ------------------------------------------------------------------ evaluation: sampled completions
    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """transformers' loop; with `generate_during_eval`, first sample completions of the eval prompts."""
        if getattr(self.args, "generate_during_eval", False):
            from posttrain.trainers.eval_samples import sample_eval_completions

            sample_eval_completions(self, dataloader.dataset, metric_key_prefix)
        return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)


class ReferenceFreePairTrainer(PreferenceTrainer):
    """PreferenceTrainer for pair losses of the policy's own log-probs (ORPO, CPO, TPO): no reference model.
    Subclasses name their `config_class` and implement `compute_loss`; the constructor takes TRL's arguments
    in TRL's order."""

    config_class: type = PairDataConfig
    paired = True

    def __init__(self, model, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, model_init=None, callbacks=None, optimizers=(None, None),
                 preprocess_logits_for_metrics=None, peft_config=None, compute_metrics=None, **kwargs):
        name = type(self).__name__
        # kwargs: TRL's older conventions (tokenizer=, config fields such as beta=), see classic_arguments
        args, processing_class = classic_arguments(name, self.config_class, args, processing_class, kwargs)
        if model_init is not None:
            raise ValueError(f"{name}: model_init is not supported; pass the model (an object or a name) as model=")
        if preprocess_logits_for_metrics is not None:
            raise ValueError(f"{name}: preprocess_logits_for_metrics is not supported: evaluation passes the pairs' "
                             "implicit rewards, not logits, to compute_metrics")
        super().__init__(model, None, args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, peft_config=peft_config,
                         callbacks=callbacks, optimizers=optimizers, needs_reference=False,
                         compute_metrics=compute_metrics)

    def pair_logps(self, model, inputs) -> tuple[Tensor, Tensor, Tensor]:
        """Summed completion log-probs, lengths and mean logits of the [chosen; rejected] rows, each (2B,)."""
        ids, mask, cmask = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
        self.count_tokens(mask, self.mode())
        return completion_logps(model, ids, mask, cmask, paired=True, model_inputs=inputs.get("model_inputs"))
