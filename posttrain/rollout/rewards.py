"""Reward functions and reward models -> one rewards tensor per batch of completions.

`RewardScorer` takes what users pass as `reward_funcs` in the usual trainer API:

* a Python callable (sync or async) -- called with the keyword arguments its signature names,
  among `prompts`, `completions`, `completion_ids` and every dataset column; `**kwargs` takes
  them all; a callable with a single positional parameter that names none of them is called
  with the completions only (`lambda texts: ...`);
* a sequence-classification model object with one output (num_labels=1; others are refused),
  scored on prompt + completion text with its own tokenizer;
* a string: a built-in reward name (`posttrain.tasks.builtin.REWARD_FUNCTIONS`), a
  "module:function" path, or else a model name/path loaded as a sequence classifier.

Each function returns one value per completion; `None` means "this function abstains on this
sample" (NaN in the per-function table, skipped in the weighted total). A function that abstains
on a whole batch is warned about once; a sample on which every function abstains gets total 0,
with a warning.
Every reward must be a finite number no larger in magnitude than `REWARD_LIMIT` (`check_scores`,
which `PPOTrainer.step` also applies to the scores it is given). Async functions run
concurrently with each other (one `asyncio.gather`, in a worker thread so that it also works
under an already running event loop, e.g. a notebook) and with the sync functions and reward
models. Sync functions each run in their own thread, all started together (when there are
several, or with `timeout`), while reward models run in the calling thread; `timeout` (the
trainer's `reward_timeout`) turns a call still running past it into a `RewardError` naming the
function.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import inspect
import math
import numbers
import os
import re
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch import Tensor

from posttrain.models.modes import eval_mode

REWARD_MODEL_BATCH = 64  # rows per reward-model forward


# Rewards are normalised in float32 (group mean and std): the square of a larger magnitude
# overflows float32 (max 3.4e38), the std becomes inf and every advantage silently 0 or NaN.
# Such rewards are refused rather than rescaled, since any rescaling would change what they mean.
REWARD_LIMIT = 1e15


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable; the message names it."""


def check_scores(scores, source: str = "scores", *, allow_none: bool = False) -> Tensor:
    """`scores` as a float32 tensor (N,), each checked to be a finite real number with |s| <= REWARD_LIMIT.

    scores: a tensor or array of N values, or a sequence of numbers or one-element tensors (the
    `PPOTrainer.step` form). source names where they came from in the error, e.g.
    "reward function 'f'". allow_none: None is an abstention and becomes NaN (reward functions);
    otherwise it is refused. Raises RewardError naming the source and the sample index.
    """
    if isinstance(scores, Tensor):
        scores = scores.detach().cpu().double().reshape(-1).tolist()
    elif hasattr(scores, "tolist") and not isinstance(scores, (str, bytes)):  # numpy arrays
        scores = scores.tolist()
    if isinstance(scores, (str, bytes, dict)) or not hasattr(scores, "__len__"):
        raise RewardError(f"{source} returned a {type(scores).__name__}; it must be a list with one value "
                          f"per sample")
    values = []
    for j, v in enumerate(scores):
        if v is None and allow_none:
            values.append(math.nan)
            continue
        if isinstance(v, Tensor) and v.numel() == 1:
            v = v.item()
        if not isinstance(v, numbers.Real):
            hint = "return a float, or None to abstain" if allow_none else "give a float"
            raise RewardError(f"{source} returned a non-number value {v!r} ({type(v).__name__}) for sample {j}; "
                              f"{hint}")
        v = float(v)
        if math.isnan(v):
            hint = "; return None to abstain on a sample" if allow_none else ""
            raise RewardError(f"{source} returned NaN for sample {j}{hint}")
        if math.isinf(v):
            raise RewardError(f"{source} returned {v} for sample {j}; rewards must be finite")
        if abs(v) > REWARD_LIMIT:
            raise RewardError(f"{source} returned {v:g} for sample {j}; rewards must lie within "
                              f"+-{REWARD_LIMIT:g}, beyond which the float32 std of the advantages overflows: "
                              f"rescale the reward")
        values.append(v)
    return torch.tensor(values, dtype=torch.float32)


def resolve_reward_func(spec):
    """A callable or a model from a reward spec.

    Strings: a built-in name ("exact_match", "digit_match"), "module:function" (imported), or
    anything else is a model name/path loaded with `load_sequence_classifier` (with a warning
    when its score head is untrained). Objects are returned unchanged, a model only once it is
    known to give one score (num_labels == 1).
    """
    from posttrain.models.loading import check_num_labels, load_sequence_classifier

    if not isinstance(spec, str):
        if _is_model(spec):
            check_num_labels(spec, 1)
        return spec
    from posttrain.tasks.builtin import REWARD_FUNCTIONS

    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    module_name, sep, attr = spec.partition(":")
    if sep and module_name and attr and not os.path.exists(spec):
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r} ({err})") from err
        func = module
        for part in attr.split("."):
            func = getattr(func, part, None)
            if func is None:
                raise ValueError(f"reward function {spec!r}: module {module_name!r} has no attribute {attr!r}")
        if not callable(func):
            raise ValueError(f"reward function {spec!r} is not callable")
        return func
    return load_sequence_classifier(spec, warn_untrained_head=True)


def _is_model(func) -> bool:
    return isinstance(func, torch.nn.Module)


def _name(func) -> str:
    if _is_model(func):
        from posttrain.cache import cache_dir

        path = getattr(getattr(func, "config", None), "_name_or_path", "") or ""
        name = os.path.basename(path.rstrip("/\\"))
        if name and os.path.dirname(path.rstrip("/\\")) == str(cache_dir()):
            # a built-in model's folder is "<name>-<12 hex digits of its recipe>": report the name
            name = re.sub(r"-[0-9a-f]{12}$", "", name)
        return name or type(func).__name__
    inner = getattr(func, "func", func)  # functools.partial
    return getattr(inner, "__name__", None) or type(inner).__name__


def _is_async(func) -> bool:
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


class _Caller:
    """How to call one reward function: which of the available arguments it takes."""

    def __init__(self, func: Callable, name: str):
        self.func, self.name = func, name
        try:
            self.params = inspect.signature(func).parameters
        except (TypeError, ValueError):  # builtins without a signature: completions only
            self.params = None

    def arguments(self, available: dict[str, Any]) -> tuple[tuple, dict]:
        """(args, kwargs) for this function, picked by name from `available`: copies of the prompts, the
        completions and the columns, so a function that changes its arguments changes nothing the next function
        or the completions log sees (`completion_ids`, token ids the trainer keeps nowhere else, is passed as it is)."""
        available = {k: copy.deepcopy(v) if isinstance(v, list) and k != "completion_ids" else v
                     for k, v in available.items()}
        params = self.params
        if params is None:
            return (available["completions"],), {}
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return (), dict(available)
        named = [p for p in params.values() if p.kind is not p.VAR_POSITIONAL]
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        args = ()
        first = named[0] if named else None
        if first is None:
            if len(params) == 0:
                raise RewardError(f"reward function {self.name!r} takes no arguments")
            return (available["completions"],), {}  # only *args
        # One required positional parameter that names nothing available (`lambda texts: ...`,
        # `def f(x, scale=2)`): it receives the completions.
        required = [p for p in named if p.default is p.empty]
        if first.kind in positional and required in ([], [first]) and \
                (first.name not in available or first.kind is first.POSITIONAL_ONLY):
            args, named = (available["completions"],), named[1:]
        missing = [p.name for p in named if p.default is p.empty and p.name not in available]
        if missing:
            raise RewardError(f"reward function {self.name!r} needs argument(s) {missing}, which are not among "
                              f"the available arguments {sorted(available)} (prompts, completions, completion_ids "
                              f"and the dataset columns)")
        return args, {p.name: available[p.name] for p in named if p.name in available}


class RewardScorer:
    """Score completions with several reward functions / models and combine them with weights.

    reward_funcs: one spec or a list (see `resolve_reward_func`). reward_weights: one float per
    function (default 1.0 each). reward_processing_classes: one tokenizer (or None) per function,
    used for reward models; a model without one gets the tokenizer saved with it, else the
    policy `tokenizer`. device: where reward models run and where the result tensors go
    (default: reward models stay where they are, results on CPU).
    """

    def __init__(self, reward_funcs, reward_weights=None, reward_processing_classes=None, *,
                 tokenizer=None, device=None, timeout: float | None = None):
        specs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not specs:
            raise ValueError("reward_funcs is empty: give at least one reward function or reward model")
        self.funcs = [resolve_reward_func(s) for s in specs]
        for i, func in enumerate(self.funcs):
            if not (_is_model(func) or callable(func)):
                raise ValueError(f"reward_funcs[{i}] is a {type(func).__name__}, neither a callable nor a model")
        F = len(self.funcs)
        self.names: list[str] = [_name(f) for f in self.funcs]
        if reward_weights is None:
            reward_weights = [1.0] * F
        if len(reward_weights) != F:
            raise ValueError(f"reward_weights has {len(reward_weights)} values but there are {F} reward functions "
                             f"({self.names})")
        for i, w in enumerate(reward_weights):
            if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
                raise ValueError(f"reward_weights[{i}] (for {self.names[i]!r}) is {w!r}; each weight must be a "
                                 f"finite number")
        self.weights = torch.tensor([float(w) for w in reward_weights], dtype=torch.float32)
        self._warned_abstain: set[int] = set()  # functions already warned about abstaining on a whole batch
        if reward_processing_classes is None:
            reward_processing_classes = [None] * F
        elif not isinstance(reward_processing_classes, (list, tuple)):
            reward_processing_classes = [reward_processing_classes]
        if len(reward_processing_classes) != F:
            raise ValueError(f"reward_processing_classes has {len(reward_processing_classes)} entries but there "
                             f"are {F} reward functions ({self.names})")
        self.device = torch.device(device) if device is not None else None
        self.timeout = timeout  # seconds a reward function may take (None: no limit)
        self._main_thread_only: set[int] = set()  # sync functions that need the main thread: called there
        self.tokenizer = tokenizer
        self.tokenizers: list = []
        for spec, func, proc in zip(specs, self.funcs, reward_processing_classes):
            if _is_model(func):
                proc = self._model_tokenizer(spec, func, proc)
                if self.device is not None:
                    func.to(self.device)
            self.tokenizers.append(proc)
        self._callers = [None if _is_model(f) else _Caller(f, n) for f, n in zip(self.funcs, self.names)]

    def _model_tokenizer(self, spec, model, proc):
        from posttrain.models.loading import load_tokenizer

        if proc is None:
            source = spec if isinstance(spec, str) else getattr(model.config, "_name_or_path", None)
            if source:
                proc = load_tokenizer(source)
            elif self.tokenizer is not None:
                proc = self.tokenizer
            else:
                raise ValueError(f"reward model {_name(model)!r} has no tokenizer: pass it in "
                                 f"reward_processing_classes")
        proc = load_tokenizer(proc)  # pad token ensured
        if getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = proc.pad_token_id  # the score is read at the last non-pad token
        return proc

    def __call__(self, prompts: list, completions: list, completion_ids: list[list[int]],
                 columns: dict[str, list], extra: dict | None = None) -> tuple[Tensor, Tensor]:
        """Returns (per_function (N, F) float32, NaN where a function abstained; total (N,) float32).

        total = sum over functions of weight * value, skipping abstentions; a sample on which every
        function abstains gets total 0.
        """
        N = len(completions)
        for what, values in [("prompts", prompts), ("completion_ids", completion_ids), *columns.items()]:
            if len(values) != N:
                raise ValueError(f"{what!r} has {len(values)} values but there are {N} completions")
        # extra: per-call values, not per completion (the trainer's `trainer_state`, `log_metric`, `log_extra`)
        available = {**columns, **(extra or {}), "prompts": prompts, "completions": completions,
                     "completion_ids": completion_ids}

        calls = {i: c.arguments(available) for i, c in enumerate(self._callers) if c is not None}  # fail before running any
        results: list = [None] * len(self.funcs)
        pending = {i: self._guard_async(i, self.funcs[i](*args, **kwargs))
                   for i, (args, kwargs) in calls.items() if _is_async(self.funcs[i])}
        sync = [i for i in calls if i not in pending]
        # several sync functions (or one beside reward models), or a timeout: each sync function in its own thread,
        # all started together, so that I/O-bound ones (sandboxes, HTTP judges) wait at the same time
        threaded = self.timeout is not None or len(sync) + len(self.funcs) - len(calls) > 1
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(asyncio.run, self._gather(list(pending.values()))) if pending else None
            started = {i: self._start(i, *calls[i]) for i in sync if threaded and i not in self._main_thread_only}
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            outs = {}
            for i in range(len(self.funcs)):  # meanwhile, in this thread: reward models and unthreaded functions
                if i not in calls:
                    results[i] = self._score_model(i, prompts, completions)
                elif i in sync and i not in started:
                    outs[i] = self._call(i, *calls[i])
            for i, job in started.items():
                outs[i] = self._join(i, job, deadline, calls[i])
            late = {}  # awaitables returned by sync-looking callables (e.g. a lambda around an async function)
            for i in sync:
                if inspect.isawaitable(outs[i]):
                    late[i] = self._guard_async(i, outs[i])
                else:
                    results[i] = outs[i]
            if future is not None:
                results_async = future.result()
                for i, out in zip(pending, results_async):
                    results[i] = out
            if late:
                for i, out in zip(late, pool.submit(asyncio.run, self._gather(list(late.values()))).result()):
                    results[i] = out

        table = torch.stack([self._check(i, out, N) for i, out in enumerate(results)], dim=1).reshape(N, -1)
        self._check_abstentions(table)
        total = torch.nansum(table * self.weights, dim=1)
        check_scores(total, "the weighted sum of the rewards")  # large weights can overflow a valid reward
        if self.device is not None:
            table, total = table.to(self.device), total.to(self.device)
        return table, total

    def _start(self, i: int, args: tuple, kwargs: dict) -> tuple[threading.Thread, dict]:
        """Sync reward function i started in a daemon thread: (the thread, the box its result or error goes in)."""
        box: dict[str, Any] = {}

        def target():
            try:
                box["out"] = self.funcs[i](*args, **kwargs)
            except Exception as err:  # noqa: BLE001 -- re-raised by _join / _result, naming the function
                box["error"] = err

        thread = threading.Thread(target=target, daemon=True, name=f"reward-{self.names[i]}")
        thread.start()
        return thread, box

    def _join(self, i: int, job: tuple[threading.Thread, dict], deadline: float | None, call: tuple):
        """The result of a started function, given up on past the deadline (Python cannot stop a thread: a
        function stuck in a loop keeps it busy, but training ends with a clear error instead of waiting forever)."""
        thread, box = job
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            raise RewardError(f"reward function {self.names[i]!r} did not return within {self.timeout:g} s "
                              "(reward_timeout): it hangs, or needs a larger reward_timeout")
        err = box.get("error")
        if isinstance(err, ValueError) and "main thread" in str(err):  # signal.alarm timeouts (math_verify)
            warnings.warn(f"reward function {self.names[i]!r} needs the main thread (it uses signals), so it runs "
                          "there, alone and without reward_timeout", stacklevel=2)
            self._main_thread_only.add(i)
            return self._call(i, *call)
        return self._result(i, box)

    def _call(self, i: int, args: tuple, kwargs: dict):
        """Call sync reward function i in this thread."""
        box: dict[str, Any] = {}
        try:
            box["out"] = self.funcs[i](*args, **kwargs)
        except Exception as err:  # noqa: BLE001 -- re-raised by _result, naming the function
            box["error"] = err
        return self._result(i, box)

    def _result(self, i: int, box: dict):
        if "error" in box:
            err = box["error"]
            raise RewardError(f"reward function {self.names[i]!r} raised {type(err).__name__}: {err}") from err
        return box.get("out")

    async def _guard_async(self, i: int, coroutine):
        try:
            if self.timeout is None:
                return await coroutine
            return await asyncio.wait_for(coroutine, self.timeout)
        except asyncio.TimeoutError:
            raise RewardError(f"reward function {self.names[i]!r} did not return within {self.timeout:g} s "
                              "(reward_timeout): it hangs, or needs a larger reward_timeout") from None
        except Exception as err:
            raise RewardError(f"reward function {self.names[i]!r} raised {type(err).__name__}: {err}") from err

    @staticmethod
    async def _gather(coroutines):
        return await asyncio.gather(*coroutines)

    def _check(self, i: int, out, N: int) -> Tensor:
        """Validate one function's output; None -> NaN (abstain)."""
        name = self.names[i]
        if hasattr(out, "__len__") and not isinstance(out, (str, bytes, dict)) and len(out) != N:
            raise RewardError(f"reward function {name!r} returned {len(out)} values, expected {N} "
                              f"(one per completion)")
        return check_scores(out, f"reward function {name!r}", allow_none=True)

    def _check_abstentions(self, table: Tensor):
        """Warn once per function that abstains on a whole batch, and about samples no function scores."""
        abstained = table.isnan()  # (N, F)
        if len(table) == 0:
            return
        # As in TRL, a sample nobody scores gets total 0 and a warning, not an error: None means
        # "not applicable", and a batch may legitimately hold a sample no function covers.
        unscored = abstained.all(dim=1).nonzero().flatten().tolist()
        if unscored:
            warnings.warn(f"every reward function ({self.names}) returned None for sample(s) {unscored[:10]}"
                          f"{' ...' if len(unscored) > 10 else ''}: their reward is 0; make at least one function "
                          f"score every sample", stacklevel=3)
        for i in abstained.all(dim=0).nonzero().flatten().tolist():
            if i not in self._warned_abstain:
                self._warned_abstain.add(i)
                warnings.warn(f"reward function {self.names[i]!r} returned None for every sample of a batch of "
                              f"{len(table)}: it contributes no reward there (warned once per function)",
                              stacklevel=3)

    def _texts(self, tokenizer, prompts: list, completions: list) -> tuple[list[str], bool]:
        """Prompt + completion as one text per sample; (texts, whether a chat template rendered them)."""
        conversational = any(isinstance(p, list) or isinstance(c, list) for p, c in zip(prompts, completions))
        if not conversational:
            return [p + c for p, c in zip(prompts, completions)], False
        use_template = bool(getattr(tokenizer, "chat_template", None))
        texts = []
        for p, c in zip(prompts, completions):
            messages = (p if isinstance(p, list) else [{"role": "user", "content": p}]) + \
                       (c if isinstance(c, list) else [{"role": "assistant", "content": c}])
            if use_template:
                texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
            else:
                texts.append("\n".join(m.get("content", "") for m in messages))
        return texts, use_template

    @torch.no_grad()
    def _score_model(self, i: int, prompts: list, completions: list) -> list[float]:
        model, tokenizer = self.funcs[i], self.tokenizers[i]
        texts, templated = self._texts(tokenizer, prompts, completions)
        device = next(model.parameters()).device
        scores = []
        with eval_mode(model):
            for start in range(0, len(texts), REWARD_MODEL_BATCH):
                batch = tokenizer(texts[start:start + REWARD_MODEL_BATCH], padding=True, truncation=True,
                                  add_special_tokens=not templated, return_tensors="pt").to(device)
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                scores.append(logits[:, 0].float().cpu())
        return torch.cat(scores).tolist() if scores else []
