"""A distillation teacher behind an HTTP server: its log-probs of given token sequences, TRL's protocol.

TRL's `vllm-serve` answers `POST {base_url}/get_sequence_logprobs` with a JSON body
`{"sequences": [[ids]], "prompt_lengths": [n], "top_logprobs": k, "temperature": t, "response_format": f}`:
for each completion token (every position from the prompt's end), the teacher's k most likely tokens and their
log-probs at temperature t, and the log-prob of the token actually there. The reply is JSON lists
(`logprobs`, `logprob_token_ids`: (completion length, k) per sequence; `actual_logprobs`: (completion length, 1)),
or with `response_format="binary"` base64 numpy arrays (`shape` [B, C, k], `completion_lengths`, `logprobs_b64`
float32, `token_ids_b64` int32, `actual_logprobs_b64` float32); both are read.

`TeacherServer` adds what a training run needs around the request: a deadline per request (`timeout` seconds,
connection and reply), a few retries with a growing pause when the server is unreachable or answers 5xx / 429
(a restarting server), never a redirect followed (a 3xx is an error: the URL is the server's own), direct
connections (no proxy from the environment), every reply checked against the request (one row per sequence,
one position per completion token, finite log-probs <= 0) and errors that say which server, what happened and
what to change.
"""

from __future__ import annotations

import base64
import json
import math
import time
import urllib.error
import urllib.request

import numpy as np


class TeacherServerError(RuntimeError):
    """The teacher server could not be reached, refused the request, or sent a reply that does not fit it."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # urllib then raises the 3xx as an HTTPError: never followed


class TeacherServer:
    """Client of a teacher server at `base_url` (e.g. "http://localhost:8000")."""

    def __init__(self, base_url: str, timeout: float = 240.0, retries: int = 2, backoff: float = 0.5,
                 response_format: str = "binary"):
        if not base_url or not base_url.strip().startswith(("http://", "https://")):
            raise ValueError(f"teacher_model_server_url={base_url!r}: give the server's base URL, e.g. "
                             "'http://localhost:8000'")
        if response_format not in ("binary", "json"):
            raise ValueError(f"response_format={response_format!r}: 'binary' or 'json'")
        self.url = base_url.strip().rstrip("/") + "/get_sequence_logprobs"
        self.timeout, self.retries, self.backoff, self.response_format = timeout, retries, backoff, response_format
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())

    def _post(self, body: dict) -> dict:
        data = json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.url, data=data, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with self._opener.open(request, timeout=self.timeout) as reply:
                    return json.loads(reply.read())
            except urllib.error.HTTPError as err:  # an answer: retried only when the server says "later"
                text = err.read(300).decode(errors="replace")
                if err.code not in (429, 500, 502, 503, 504) or attempt == self.retries:
                    where = (f" to {err.headers.get('Location')!r} (redirects are not followed)"
                             if 300 <= err.code < 400 else "")
                    raise TeacherServerError(f"teacher server {self.url} answered HTTP {err.code}{where}: {text!r}") \
                        from None
                reason = f"HTTP {err.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                reason = getattr(err, "reason", err)
                if attempt == self.retries:
                    raise TeacherServerError(
                        f"teacher server {self.url} did not answer ({reason}) in {self.retries + 1} tries of at most "
                        f"{self.timeout:g} s each (teacher_model_server_timeout): is it running? Start it (e.g. `trl "
                        "vllm-serve --model <teacher>`) or fix teacher_model_server_url") from None
            except json.JSONDecodeError as err:
                raise TeacherServerError(f"teacher server {self.url} sent a reply that is not JSON: {err}") from None
            time.sleep(self.backoff * 2 ** attempt)
        raise AssertionError("unreachable")

    def sequence_logprobs(self, sequences: list[list[int]], prompt_lengths: list[int], top_logprobs: int,
                          temperature: float) -> dict[str, list]:
        """Per sequence, over its completion tokens: `logprobs` and `logprob_token_ids` (C_i, top_logprobs), the
        teacher's most likely tokens; `actual_logprobs` (C_i,) the log-prob of each token given, when the server
        sends them (else absent)."""
        if len(sequences) != len(prompt_lengths):
            raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths")
        reply = self._post({"sequences": sequences, "prompt_lengths": prompt_lengths, "top_logprobs": top_logprobs,
                            "temperature": temperature, "response_format": self.response_format})
        out = _decode_binary(reply) if "logprobs_b64" in reply else reply
        return self._checked(out, [len(s) - p for s, p in zip(sequences, prompt_lengths)], top_logprobs)

    def _checked(self, reply: dict, lengths: list[int], k: int) -> dict[str, list]:
        """The reply's lists, each checked against the request (rows, positions, k, finite log-probs <= 0)."""
        if "logprobs" not in reply or "logprob_token_ids" not in reply:
            raise TeacherServerError(f"teacher server {self.url} sent no 'logprobs' / 'logprob_token_ids' (keys: "
                                     f"{sorted(reply)[:10]})")
        out = {"logprobs": reply["logprobs"], "logprob_token_ids": reply["logprob_token_ids"]}
        if reply.get("actual_logprobs") is not None:
            out["actual_logprobs"] = [[v[0] if isinstance(v, list) else v for v in row]
                                      for row in reply["actual_logprobs"]]
        for key, rows in out.items():
            if len(rows) != len(lengths):
                raise TeacherServerError(f"teacher server {self.url}: {len(rows)} rows of {key!r} for "
                                         f"{len(lengths)} sequences")
            for i, (row, n) in enumerate(zip(rows, lengths)):
                if len(row) != n:
                    raise TeacherServerError(f"teacher server {self.url}: sequence {i} has {n} completion tokens "
                                             f"but {len(row)} positions of {key!r}")
                if key != "actual_logprobs" and any(len(position) < k for position in row):
                    raise TeacherServerError(f"teacher server {self.url}: sequence {i}: fewer than top_logprobs={k} "
                                             f"entries in {key!r}")
                if key != "logprob_token_ids":
                    values = [v for position in row for v in (position if isinstance(position, list) else [position])]
                    bad = [v for v in values if not (math.isfinite(v) and v <= 1e-6)]
                    if bad:
                        raise TeacherServerError(f"teacher server {self.url}: sequence {i}: {key!r} holds "
                                                 f"{bad[:3]}, not log-probabilities (finite, <= 0)")
        return out


def _decode_binary(reply: dict) -> dict[str, list]:
    """The base64 numpy form of a reply as lists, each sequence cut to its completion length."""
    shape, lengths = reply["shape"], reply["completion_lengths"]

    def array(key, dtype, k):
        values = np.frombuffer(base64.b64decode(reply[key]), dtype=dtype).reshape(shape[0], shape[1], k)
        return [values[i, :n].tolist() for i, n in enumerate(lengths)]

    out = {"logprobs": array("logprobs_b64", np.float32, shape[2]),
           "logprob_token_ids": array("token_ids_b64", np.int32, shape[2])}
    if "actual_logprobs_b64" in reply:
        out["actual_logprobs"] = array("actual_logprobs_b64", np.float32, 1)
    return out
