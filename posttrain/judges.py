"""Pairwise judges and win rate: is the policy's answer better than a reference answer?

A judge looks at a prompt and two completions and returns the index (0 or 1) of the better one,
or -1 when it could not decide for that item (a failed request, an unreadable answer). One bad
item never raises; misuse (lists of different lengths, a pair that is not a pair) does.

* `RewardModelJudge`: a sequence-classification reward model scores both completions.
* `OpenAIPairwiseJudge`: any OpenAI-compatible chat endpoint, through the `openai` SDK when it is
  installed (its retries honour Retry-After; Azure OpenAI), else a small standard-library client.
* `win_rate(judge, prompts, completions, reference_completions)`: fraction of decided
  comparisons that the completions win.
* `WinRateCallback` (in `posttrain.callbacks`, also `posttrain.WinRateCallback`; the old path
  `posttrain.judges.WinRateCallback` still works): logs `eval_win_rate` of the model being trained at
  every evaluation.

Position bias: LLM judges tend to prefer whichever answer comes first (or second). With
`shuffle_order=True` (the default) each pair is swapped with probability 1/2 before judging and
the verdict is swapped back, so the bias spreads evenly over both sides.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import os
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from posttrain.eval import generate_completions
from posttrain.models.modes import eval_mode

__all__ = ["PairwiseJudge", "BasePairwiseJudge", "RewardModelJudge", "OpenAIPairwiseJudge", "JudgeError", "win_rate",
           "WinRateCallback", "generate_completions"]


def __getattr__(name: str):
    # The old path `posttrain.judges.WinRateCallback`: callbacks.py imports this module, so the callback comes
    # through the package's lazy public names instead of an import here (which would make a cycle).
    if name == "WinRateCallback":
        import posttrain

        return posttrain.WinRateCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class JudgeError(RuntimeError):
    """Every item of a judge call failed (the message quotes the first failure)."""


def _is_messages(value) -> bool:
    return isinstance(value, list) and (not value or isinstance(value[0], dict))


def _render(prompt) -> str:
    """A prompt as text: a string as is, a conversation as `role: content` lines."""
    if _is_messages(prompt):
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in prompt)
    return str(prompt)


class PairwiseJudge:
    """Base judge. Subclasses implement `compare(prompts, pairs) -> list[int]` on pairs in the order given;
    `judge` adds input checks and the order shuffle."""

    rng = random.Random()  # subclasses that skip __init__ still shuffle

    def __init__(self, seed: int | None = None):
        self.rng = random.Random(seed)

    def judge(self, prompts: Sequence[Any], completion_pairs: Sequence[Sequence[str]] | None = None,
              shuffle_order: bool = True, *, completions: Sequence[Sequence[str]] | None = None) -> list[int]:
        """For each prompt, 0 or 1: the index of the better completion in its pair; -1 where no verdict.

        `completions=` is accepted as another name for `completion_pairs` (the keyword TRL's judges use).
        """
        if (completion_pairs is None) == (completions is None):
            raise ValueError("pass the completion pairs once, as completion_pairs (or completions=)")
        completion_pairs = completion_pairs if completion_pairs is not None else completions
        if len(prompts) != len(completion_pairs):
            raise ValueError(f"judge got {len(prompts)} prompts but {len(completion_pairs)} completion pairs; "
                             "pass one pair (a, b) per prompt")
        pairs = []
        for i, pair in enumerate(completion_pairs):
            if isinstance(pair, str) or len(pair) != 2:
                raise ValueError(f"completion_pairs[{i}] must hold exactly two completions, got {pair!r:.200}")
            pairs.append((pair[0], pair[1]))
        if not pairs:
            return []
        swapped = [shuffle_order and self.rng.random() < 0.5 for _ in pairs]
        asked = [(b, a) if s else (a, b) for (a, b), s in zip(pairs, swapped)]
        verdicts = list(self.compare(list(prompts), asked))
        if len(verdicts) != len(pairs):
            raise RuntimeError(f"{type(self).__name__}.compare returned {len(verdicts)} verdicts "
                               f"for {len(pairs)} pairs")
        return [-1 if v not in (0, 1) else (1 - v if s else v) for v, s in zip(verdicts, swapped)]

    def compare(self, prompts: list, pairs: list[tuple[str, str]]) -> list[int]:
        raise NotImplementedError


BasePairwiseJudge = PairwiseJudge  # the name TRL code subclasses


# --------------------------------------------------------------------------- reward model

class RewardModelJudge(PairwiseJudge):
    """The completion with the higher reward-model score wins; equal scores give -1 (no verdict).

    Text is encoded the way the reward trainer encodes it: a standard prompt and completion are
    concatenated (plus EOS); a conversational prompt (a list of messages) gets the completion as an
    assistant turn, rendered with the chat template.
    """

    def __init__(self, model, tokenizer=None, batch_size: int = 16, max_length: int | None = None,
                 seed: int | None = None):
        from posttrain.models import loading

        super().__init__(seed)
        name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
        self.model = loading.load_sequence_classifier(model)
        self.tokenizer = loading.load_tokenizer(tokenizer, model=name or self.model)
        num_labels = getattr(self.model.config, "num_labels", 1)
        if num_labels != 1:
            raise ValueError(f"RewardModelJudge needs a reward model with one output (num_labels=1), got {num_labels}")
        if getattr(self.model.config, "pad_token_id", None) is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size, self.max_length = batch_size, max_length

    def _encode(self, prompt, completion) -> list[int]:
        from posttrain.data.tokenize import encode_prompt_completion

        if _is_messages(prompt) and isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        out = encode_prompt_completion(self.tokenizer, prompt, completion, self.max_length)
        return out["prompt_ids"] + out["completion_ids"]

    @torch.no_grad()
    def scores(self, prompts: list, completions: list[str]) -> list[float | None]:
        """Reward of each (prompt, completion); None where the row could not be encoded."""
        from posttrain.data.collate import pad

        encoded: list[list[int] | None] = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            try:
                encoded.append(self._encode(p, c))
            except Exception as err:  # one bad row is a missing verdict, not a crash
                warnings.warn(f"RewardModelJudge: could not encode item {i}: {err}")
                encoded.append(None)
        out: list[float | None] = [None] * len(encoded)
        rows = [i for i, ids in enumerate(encoded) if ids]
        device = next(self.model.parameters()).device
        with eval_mode(self.model):
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start:start + self.batch_size]
                ids = pad([encoded[i] for i in chunk], self.tokenizer.pad_token_id, "right")
                mask = pad([[1] * len(encoded[i]) for i in chunk], 0, "right")
                logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
                for i, value in zip(chunk, logits[:, 0].float().tolist()):
                    out[i] = value
        return out

    def compare(self, prompts, pairs):
        flat = self.scores([p for p in prompts for _ in (0, 1)], [c for pair in pairs for c in pair])
        verdicts = []
        for a, b in zip(flat[0::2], flat[1::2]):
            verdicts.append(-1 if a is None or b is None or a == b else int(b > a))
        return verdicts


# --------------------------------------------------------------------------- OpenAI-compatible HTTP

DEFAULT_JUDGE_SYSTEM_PROMPT = (
    "You are an impartial evaluator. You will see a prompt and two candidate responses, labelled "
    "0 and 1. Decide which response serves the prompt better: correct, helpful, honest and clear. "
    "The order of the responses and their length must not influence you. "
    "Reply with exactly one character: 0 or 1.")

_USER_TEMPLATE = ("[Prompt]\n{prompt}\n\n[Response 0]\n{first}\n\n[Response 1]\n{second}\n\n"
                  "Which response is better? Reply with 0 or 1 only.")
_ANSWER = re.compile(r"^\W*([01])\W*$")
_MAX_BODY = 1 << 20  # read at most 1 MiB of a response


def _is_local(url: str) -> bool:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Retryable(Exception):
    pass


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Follow no redirect: urllib would re-send the Authorization header to wherever a 3xx points
    (and turn the POST into a GET). The 3xx then surfaces as an HTTPError."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class _Deadline:
    """An overall time limit on one HTTP exchange. The socket timeout bounds each read only, so a
    server sending a byte at a time could hold a request for ever; when the time is up this shuts
    the request's sockets down, whatever the request waits for (TLS handshake, headers, body)."""

    def __init__(self, seconds: float):
        self.expired, self.done = False, threading.Event()
        self.connections: list[http.client.HTTPConnection] = []
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._watch, args=(seconds,), daemon=True).start()

    def connection_class(self, base: type[http.client.HTTPConnection]) -> type[http.client.HTTPConnection]:
        deadline = self

        class Tracked(base):
            def connect(self):
                deadline.connections.append(self)  # its socket appears during connect (TLS handshake included)
                super().connect()
                deadline.sockets.append(self.sock)  # urllib drops connection.sock once the headers are in

        return Tracked

    def _watch(self, seconds: float):
        if self.done.wait(seconds):
            return
        self.expired = True
        while True:  # a connection still connecting has no socket yet: keep at it until the request ends
            for sock in [c.sock for c in list(self.connections)] + list(self.sockets):
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
            if self.done.wait(0.05):
                return


class _TrackedHTTP(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(self.deadline.connection_class(http.client.HTTPConnection), req)


class _TrackedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):  # no context given: HTTPSConnection's default (verified) one
        return self.do_open(self.deadline.connection_class(http.client.HTTPSConnection), req)


class OpenAIPairwiseJudge(PairwiseJudge):
    """Ask a chat model behind an OpenAI-compatible `/chat/completions` endpoint which response is better.

    * Client: with the `openai` package installed (and `use_openai_sdk` not False) requests go through
      its client, built with `base_url`, the key, `timeout` and `max_retries`: it retries connection
      errors, 408/409/429 and 5xx, waiting what a Retry-After header asks. `client=` takes a ready SDK
      client instead, e.g. `openai.AzureOpenAI(...)`; with `$AZURE_OPENAI_ENDPOINT` set and no
      `base_url` / `$OPENAI_BASE_URL`, an `openai.AzureOpenAI()` is built from the environment
      (`AZURE_OPENAI_API_KEY`, `OPENAI_API_VERSION`; `model` is the deployment name). Without the
      package, the built-in client below is used; the points on timeouts, retries and redirects
      describe it (the SDK has its own), the rest hold for both.
    * `base_url`: default `$OPENAI_BASE_URL`, else `https://api.openai.com/v1`.
    * The key is read from the environment variable `api_key_env` each time `judge` runs. When it is
      unset the call fails with an error naming the variable, except for a loopback `base_url`
      (localhost, 127.0.0.1, ::1: a local server such as vLLM or llama.cpp), which is sent no key.
    * Each request has a `timeout` (seconds) on the whole exchange (connect, headers, body), not on
      each read; connection errors, timeouts, HTTP 429 and 5xx are retried up to `max_retries`
      times, waiting `backoff * 2**attempt` seconds in between.
    * Redirects are not followed (the key would go along to the new address): a 3xx is an error
      naming the status and the Location, and is not retried. Give the final URL as `base_url`.
    * An item whose request fails or whose answer is not "0"/"1" gets -1 and one warning per call
      sums them up; when every item of a call fails, `JudgeError` quotes what the server said.
    * `system_prompt` replaces the default system message; a prompt that contains the placeholders
      `{prompt}`, `{response0}` and `{response1}` is instead filled in and sent as the only (user)
      message, as TRL's judge does.
    * `max_requests` caps the HTTP requests over the judge's lifetime (retries count); items past
      the cap get -1. None: no cap.
    """

    def __init__(self, model: str, base_url: str | None = None, api_key_env: str = "OPENAI_API_KEY",
                 system_prompt: str | None = None, timeout: float = 30.0, max_retries: int = 3,
                 backoff: float = 0.5, temperature: float | None = 0.0, max_workers: int = 4,
                 max_requests: int | None = None, seed: int | None = None, client=None,
                 use_openai_sdk: bool | None = None):
        super().__init__(seed)
        self.model = model
        self.azure = client is None and base_url is None and not os.environ.get("OPENAI_BASE_URL") \
            and bool(os.environ.get("AZURE_OPENAI_ENDPOINT"))
        if self.azure:
            base_url = os.environ["AZURE_OPENAI_ENDPOINT"]
            if api_key_env == "OPENAI_API_KEY":
                api_key_env = "AZURE_OPENAI_API_KEY"
        self.client, self.use_openai_sdk = client, use_openai_sdk
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1").rstrip("/")
        self.api_key_env, self.system_prompt = api_key_env, system_prompt or DEFAULT_JUDGE_SYSTEM_PROMPT
        self.timeout, self.max_retries, self.backoff = timeout, max_retries, backoff
        self.temperature, self.max_workers = temperature, max(1, max_workers)
        self._local = _is_local(self.base_url)
        self.max_requests, self.num_requests, self._count_lock = max_requests, 0, threading.Lock()

    def _sdk_client(self, key: str | None):
        """The OpenAI SDK client for this call, or None for the built-in client."""
        if self.client is not None or self.use_openai_sdk is False:
            return self.client
        try:
            import openai
        except ImportError:
            if self.use_openai_sdk:
                raise ImportError("OpenAIPairwiseJudge(use_openai_sdk=True) needs the openai package: "
                                  "pip install openai") from None
            return None
        options = dict(api_key=key or "none", timeout=self.timeout, max_retries=max(0, self.max_retries))
        if self.azure:  # endpoint and api version from the environment
            return openai.AzureOpenAI(azure_endpoint=self.base_url, **options)
        return openai.OpenAI(base_url=self.base_url, **options)

    def _api_key(self) -> str | None:
        if self.client is not None:
            return None  # the given client carries its own credentials
        key = os.environ.get(self.api_key_env)
        if not key and not self._local:
            raise ValueError(f"OpenAIPairwiseJudge: the environment variable {self.api_key_env} is not set; "
                             f"export it with the API key for {self.base_url} (or pass api_key_env=)")
        return key or None

    def _post(self, body: dict, key: str | None) -> str:
        """The assistant's answer text; raises _Retryable or ValueError with the server's words."""
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                         headers=headers, method="POST")
        deadline = _Deadline(self.timeout)
        handlers = [_NoRedirect(), _TrackedHTTP(deadline), _TrackedHTTPS(deadline)]
        if self._local:  # a loopback server is reached directly, whatever proxy the environment names
            handlers.append(urllib.request.ProxyHandler({}))
        opener = urllib.request.build_opener(*handlers)
        late = f"no complete response within timeout={self.timeout} s"
        try:
            with opener.open(request, timeout=self.timeout) as response:
                raw = response.read(_MAX_BODY)
        except urllib.error.HTTPError as err:
            if 300 <= err.code < 400:
                raise ValueError(f"HTTP {err.code} redirect to {err.headers.get('Location')!r}: the judge follows "
                                 f"no redirects (the API key would go along); set base_url to the address that "
                                 f"answers") from err
            try:
                detail = err.read(2000).decode("utf-8", "replace")
            except (OSError, http.client.HTTPException):  # the error body itself cut short
                detail = ""
            message = late if deadline.expired else f"HTTP {err.code}: {detail[:500]}"
            if err.code == 429 or err.code >= 500 or deadline.expired:
                raise _Retryable(message) from err
            raise ValueError(message) from err
        except (urllib.error.URLError, http.client.HTTPException, socket.timeout, TimeoutError,
                ConnectionError) as err:
            raise _Retryable(late if deadline.expired else f"request failed: {getattr(err, 'reason', err)}") from err
        finally:
            deadline.done.set()
        if deadline.expired:  # a body cut short by the deadline
            raise _Retryable(late)
        text = raw.decode("utf-8", "replace")
        try:
            content = json.loads(text)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ValueError(f"unexpected response (not an OpenAI chat completion): {text[:500]!r}") from None
        return content if isinstance(content, str) else str(content)

    @staticmethod
    def _post_sdk(client, body: dict) -> str:
        """The assistant's answer text through the SDK, which retried already; failures raise ValueError."""
        import openai

        try:
            response = client.chat.completions.create(**body)
        except openai.OpenAIError as err:
            status = getattr(err, "status_code", None)
            raise ValueError(f"HTTP {status}: {err}" if status else f"request failed: {err}") from err
        try:
            content = response.choices[0].message.content
        except (AttributeError, IndexError, TypeError):
            raise ValueError(f"unexpected response (not a chat completion): {str(response)[:500]!r}") from None
        return content if isinstance(content, str) else str(content)

    def _ask(self, prompt, first: str, second: str, key: str | None, client=None) -> tuple[int, str | None]:
        """(verdict, error message or None) for one pair."""
        if all(p in self.system_prompt for p in ("{prompt}", "{response0}", "{response1}")):
            text = self.system_prompt
            for name, value in (("{prompt}", _render(prompt)), ("{response0}", first), ("{response1}", second)):
                text = text.replace(name, value)
            messages = [{"role": "user", "content": text}]
        else:
            messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content":
                        _USER_TEMPLATE.format(prompt=_render(prompt), first=first, second=second)}]
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        for attempt in range(self.max_retries + 1):
            with self._count_lock:
                if self.max_requests is not None and self.num_requests >= self.max_requests:
                    return -1, f"max_requests={self.max_requests} reached"
                self.num_requests += 1
            try:
                answer = self._post_sdk(client, body) if client is not None else self._post(body, key)
            except _Retryable as err:
                if attempt == self.max_retries:
                    return -1, f"{err} (after {attempt + 1} attempts)"
                time.sleep(self.backoff * 2 ** attempt)
                continue
            except ValueError as err:
                return -1, str(err)
            match = _ANSWER.match(answer)
            if match is None:
                return -1, f"the judge answered {answer[:200]!r}, not 0 or 1"
            return int(match.group(1)), None
        return -1, "no attempt made"  # max_retries < 0

    def compare(self, prompts, pairs):
        key = self._api_key()
        client = self._sdk_client(key)
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(pairs))) as pool:
            results = list(pool.map(lambda item: self._ask(item[0], *item[1], key, client), zip(prompts, pairs)))
        errors = [(i, err) for i, (_, err) in enumerate(results) if err is not None]
        if errors and len(errors) == len(results):
            raise JudgeError(f"all {len(results)} judge requests to {self.base_url} failed; "
                             f"first error: {errors[0][1]}")
        if errors:
            warnings.warn(f"OpenAIPairwiseJudge: {len(errors)} of {len(results)} items got no verdict (-1); "
                          f"first, item {errors[0][0]}: {errors[0][1]}")
        return [verdict for verdict, _ in results]


# --------------------------------------------------------------------------- win rate

def win_rate(judge: PairwiseJudge, prompts: Sequence[Any], completions: Sequence[str],
             reference_completions: Sequence[str], shuffle_order: bool = True) -> dict[str, float]:
    """How often `completions` beat `reference_completions`, per `judge`.

    Returns {"win_rate", "num_judged", "num_failed", "num_ties"}. A completion identical to its
    reference is a tie and is not sent to the judge; ties and failures (-1) are left out of the
    denominator: win_rate = wins / num_judged. With nothing judged, win_rate is 0.5 when every
    pair was a tie (the two sides cannot be told apart) and NaN when the judge failed on all.
    """
    if not len(prompts) == len(completions) == len(reference_completions):
        raise ValueError(f"win_rate needs as many completions and reference completions as prompts; got "
                         f"{len(prompts)} prompts, {len(completions)} completions, "
                         f"{len(reference_completions)} reference completions")
    asked = [i for i, (c, r) in enumerate(zip(completions, reference_completions)) if c != r]
    verdicts = judge.judge([prompts[i] for i in asked],
                           [(completions[i], reference_completions[i]) for i in asked], shuffle_order=shuffle_order)
    wins = sum(v == 0 for v in verdicts)
    judged = sum(v in (0, 1) for v in verdicts)
    failed = len(verdicts) - judged
    ties = len(prompts) - len(asked)
    if judged:
        rate = wins / judged
    else:
        rate = float("nan") if failed else 0.5
    return {"win_rate": rate, "num_judged": judged, "num_failed": failed, "num_ties": ties}
