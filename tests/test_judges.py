"""Pairwise judges, win rate and the win-rate callback.

The OpenAI-compatible judge is tested against a fake server bound to 127.0.0.1 on an ephemeral
port; what the server does is read from the prompt text, so concurrent requests stay predictable.
"""

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from posttrain.judges import (JudgeError, OpenAIPairwiseJudge, PairwiseJudge, RewardModelJudge,
                              WinRateCallback, generate_completions, win_rate)


# --------------------------------------------------------------------------- fake server

class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass

    def _reply(self, status: int, body: bytes):
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
            pass

    def do_POST(self):
        server = self.server
        length = min(int(self.headers.get("Content-Length", 0)), 1 << 20)
        request = json.loads(self.rfile.read(length))
        user = request["messages"][-1]["content"]
        with server.lock:
            server.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": request})
            server.hits[user] += 1
            hits = server.hits[user]
        first = user.split("[Response 0]\n")[1].split("\n\n[Response 1]")[0]

        def answer(text):
            self._reply(200, json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode())

        if "FLAKY" in user and hits == 1:
            self._reply(500, b'{"error": "overloaded"}')
        elif "GARBAGE" in user:
            self._reply(200, b"<html>not json</html>")
        elif "WORDS" in user:
            answer("Response 1 is better because it is longer.")
        elif "SLEEP" in user:
            time.sleep(0.6)
            answer("0")
        elif "DENY" in user:
            self._reply(401, b'{"error": {"message": "invalid api key"}}')
        elif "BIASED" in user:
            answer("0")  # always the first position
        else:
            answer("0" if "GOOD" in first else "1")  # an honest judge: the GOOD response wins


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.lock, srv.seen, srv.hits = threading.Lock(), [], Counter()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    yield srv
    srv.shutdown()
    srv.server_close()


def _judge(server, **kw):
    kw = {"timeout": 5.0, "max_retries": 2, "backoff": 0.01, "seed": 0, **kw}
    return OpenAIPairwiseJudge("judge-model", base_url=server.url, **kw)


# --------------------------------------------------------------------------- OpenAI-compatible judge

def test_openai_judge_good_answers_and_key_header(server, monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test-123")
    judge = _judge(server, api_key_env="MY_JUDGE_KEY")
    prompts = [f"q{i}" for i in range(8)]
    pairs = [("GOOD a", "bad b") if i % 2 == 0 else ("bad a", "GOOD b") for i in range(8)]
    assert judge.judge(prompts, pairs) == [0, 1] * 4  # right despite the random order swaps
    assert judge.judge(prompts, pairs, shuffle_order=False) == [0, 1] * 4
    assert len(server.seen) == 16
    assert {r["auth"] for r in server.seen} == {"Bearer sk-test-123"}
    assert {r["path"] for r in server.seen} == {"/v1/chat/completions"}
    body = server.seen[0]["body"]
    assert body["model"] == "judge-model" and body["messages"][0]["role"] == "system"


def test_openai_judge_key_read_at_call_time_and_required_for_remote_urls(server, monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    remote = OpenAIPairwiseJudge("m", base_url="https://judge.example.com/v1", api_key_env="NO_SUCH_KEY_VAR")
    with pytest.raises(ValueError, match="NO_SUCH_KEY_VAR"):
        remote.judge(["p"], [("a", "b")])
    # a loopback server needs no key: no Authorization header is sent
    local = _judge(server, api_key_env="NO_SUCH_KEY_VAR")
    assert local.judge(["p"], [("GOOD", "bad")]) == [0]
    assert server.seen[-1]["auth"] is None
    monkeypatch.setenv("NO_SUCH_KEY_VAR", "later-key")  # set after construction: still picked up
    local.judge(["p"], [("GOOD", "bad")])
    assert server.seen[-1]["auth"] == "Bearer later-key"


def test_openai_judge_retries_a_500(server):
    judge = _judge(server)
    assert judge.judge(["FLAKY"], [("GOOD", "bad")], shuffle_order=False) == [0]
    assert len(server.seen) == 2  # one 500, one success


def test_openai_judge_bad_items_get_minus_one_and_a_warning(server):
    judge = _judge(server)
    with pytest.warns(UserWarning, match="2 of 3 items got no verdict"):
        out = judge.judge(["GARBAGE", "fine", "WORDS"], [("GOOD", "b"), ("a", "GOOD"), ("GOOD", "b")])
    assert out == [-1, 1, -1]


def test_openai_judge_raises_when_every_item_fails_quoting_the_server(server):
    judge = _judge(server)
    with pytest.raises(JudgeError, match="not json"):
        judge.judge(["GARBAGE", "GARBAGE"], [("a", "b"), ("c", "d")])
    with pytest.raises(JudgeError, match="HTTP 401.*invalid api key"):
        judge.judge(["DENY"], [("a", "b")])
    assert server.hits[[k for k in server.hits if "DENY" in k][0]] == 1  # a 4xx is not retried


def test_openai_judge_timeout(server):
    judge = _judge(server, timeout=0.15, max_retries=1)
    start = time.monotonic()
    with pytest.warns(UserWarning, match="after 2 attempts"):
        out = judge.judge(["SLEEP", "ok"], [("GOOD", "b"), ("GOOD", "b")], shuffle_order=False)
    assert out == [-1, 0]
    assert time.monotonic() - start < 3.0


class _RecordingHandler(BaseHTTPRequestHandler):
    """Records every request (method, path, Authorization) and answers with a verdict, as a
    hostile host that a redirect points at would."""

    def log_message(self, *args):
        pass

    def _record_and_answer(self):
        with self.server.lock:
            self.server.seen.append((self.command, self.path, self.headers.get("Authorization")))
        body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "0"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _record_and_answer


class _RedirectHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.server.lock:
            self.server.seen.append((self.command, self.path, self.headers.get("Authorization")))
        self.send_response(self.server.status)
        self.send_header("Location", self.server.location)
        self.send_header("Content-Length", "0")
        self.end_headers()


class _DripHandler(BaseHTTPRequestHandler):
    """Answers one byte every 0.4 s: each read is quick, the whole answer never comes. Where the
    drip starts (status line or body) is the server's `drip` attribute."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "0"}}]}).encode()
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        drip = head + body if self.server.drip == "headers" else body
        if self.server.drip != "headers":
            self.wfile.write(head)
        try:
            for byte in drip:  # at most ~45 s, and it stops when the client hangs up or the test ends
                if self.server.stop.wait(0.4):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass


def _serve(handler, **attributes):
    """A ThreadingHTTPServer on 127.0.0.1 (ephemeral port) running in a daemon thread."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.lock, srv.seen, srv.stop = threading.Lock(), [], threading.Event()
    for name, value in attributes.items():
        setattr(srv, name, value)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    return srv


def _stop(*servers):
    for srv in servers:
        srv.stop.set()
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_openai_judge_follows_no_redirect_and_never_sends_the_key_elsewhere(status, monkeypatch):
    other = _serve(_RecordingHandler)
    redirecting = _serve(_RedirectHandler, status=status, location=other.url + "/steal")
    try:
        monkeypatch.setenv("MY_JUDGE_KEY", "sk-secret")
        judge = OpenAIPairwiseJudge("m", base_url=redirecting.url + "/v1", api_key_env="MY_JUDGE_KEY",
                                    max_retries=2, backoff=0.01, timeout=5.0)
        with pytest.raises(JudgeError, match=f"HTTP {status} redirect to '{other.url}/steal'"):
            judge.judge(["p"], [("a", "b")])
        assert redirecting.seen == [("POST", "/v1/chat/completions", "Bearer sk-secret")]  # not retried either
        assert other.seen == []  # the other host never heard of the request, let alone the key
    finally:
        _stop(other, redirecting)


@pytest.mark.parametrize("drip", ["body", "headers"])
def test_openai_judge_timeout_bounds_the_whole_request_not_each_read(drip):
    srv = _serve(_DripHandler, drip=drip)
    try:
        judge = OpenAIPairwiseJudge("m", base_url=srv.url + "/v1", timeout=1.0, max_retries=0)
        start = time.monotonic()
        with pytest.raises(JudgeError, match=r"no complete response within timeout=1\.0 s"):
            judge.judge(["p"], [("a", "b")])
        # the drip would take ~25 s (~45 s from the status line); the deadline is 1 s
        assert time.monotonic() - start < 4.0
    finally:
        _stop(srv)


def test_openai_judge_trl_style_prompt_template_and_request_cap(server):
    template = "TRL-STYLE {prompt}\n[Response 0]\n{response0}\n\n[Response 1]\n{response1}"
    judge = _judge(server, system_prompt=template, max_requests=3)
    assert judge.judge(["q1", "q2"], completions=[("a", "GOOD"), ("GOOD", "b")]) == [1, 0]
    messages = server.seen[-1]["body"]["messages"]
    assert len(messages) == 1 and messages[0]["role"] == "user" and messages[0]["content"].startswith("TRL-STYLE q")
    with pytest.warns(UserWarning, match="max_requests=3 reached"):
        assert sorted(judge.judge(["q3", "q4"], [("GOOD", "b"), ("GOOD", "b")], shuffle_order=False)) == [-1, 0]
    assert len(server.seen) == 3


def test_shuffle_order_counters_position_bias(server):
    judge = _judge(server)
    pairs = [("a", "b")] * 40
    assert judge.judge(["BIASED"] * 40, pairs, shuffle_order=False) == [0] * 40
    shuffled = judge.judge(["BIASED"] * 40, pairs)
    assert 8 <= sum(shuffled) <= 32  # the bias is spread over both sides, not all 0


def test_judge_misuse_raises():
    class Zero(PairwiseJudge):
        def compare(self, prompts, pairs):
            return [0] * len(pairs)

    with pytest.raises(ValueError, match="2 prompts but 1 completion pairs"):
        Zero().judge(["a", "b"], [("x", "y")])
    with pytest.raises(ValueError, match=r"completion_pairs\[0\] must hold exactly two"):
        Zero().judge(["a"], [("x", "y", "z")])
    assert Zero().judge([], []) == []
    with pytest.raises(ValueError, match="pass the completion pairs once"):
        Zero().judge(["a"], [("x", "y")], completions=[("x", "y")])


def test_a_trl_style_judge_subclass_works_with_win_rate():
    from posttrain.judges import BasePairwiseJudge

    class PrefersShorter(BasePairwiseJudge):  # overrides judge() itself, as TRL judges do
        def judge(self, prompts, completions, shuffle_order=True):
            return [0 if len(a) < len(b) else 1 for a, b in completions]

    out = win_rate(PrefersShorter(), ["p", "q"], ["ab", "abcd"], ["abc", "abc"])
    assert out["win_rate"] == 0.5 and out["num_judged"] == 2


# --------------------------------------------------------------------------- win rate

class _Oracle(PairwiseJudge):
    """Prefers completions that contain 'good'; says nothing (-1) when both or neither do."""

    def compare(self, prompts, pairs):
        return [-1 if ("good" in a) == ("good" in b) else (0 if "good" in a else 1) for a, b in pairs]


def test_win_rate_counts_wins_ties_and_failures():
    prompts = ["p"] * 6
    completions = ["good", "good", "bad", "same", "good x", "meh"]
    references = ["bad", "bad2", "good", "same", "good y", "meh2"]
    out = win_rate(_Oracle(seed=0), prompts, completions, references)
    # judged: 2 wins + 1 loss; "same" is a tie; both-good and neither-good get -1
    assert out == {"win_rate": 2 / 3, "num_judged": 3, "num_failed": 2, "num_ties": 1}
    assert win_rate(_Oracle(), ["p"], ["x"], ["x"])["win_rate"] == 0.5  # only ties
    with pytest.raises(ValueError, match="as many completions"):
        win_rate(_Oracle(), ["p", "q"], ["x"], ["y"])


def test_reward_model_judge_picks_the_higher_score():
    judge = RewardModelJudge("posttrain/tiny-qwen2-seqcls", seed=0)
    prompts = ["Beautiful is", "Flat is", "Readability"]
    completions = [" better than ugly.", " better than nested.", " counts."]
    others = [" worse than anything.", " 1234 5678", " never matters at all"]
    scores = judge.scores(prompts * 2, completions + others)
    expected = [int(b > a) for a, b in zip(scores[:3], scores[3:])]
    assert judge.judge(prompts, list(zip(completions, others))) == expected
    assert judge.judge(prompts, list(zip(others, completions))) == [1 - e for e in expected]
    # a conversational prompt: the completion becomes an assistant turn under the chat template
    chat = [[{"role": "user", "content": p}] for p in prompts]
    assert all(v in (0, 1) for v in judge.judge(chat, list(zip(completions, others))))
    # batching does not change the scores
    judge.batch_size = 1
    assert torch.allclose(torch.tensor(judge.scores(prompts, completions)), torch.tensor(scores[:3]), atol=1e-5)


# --------------------------------------------------------------------------- callback

class _LongerWins(PairwiseJudge):
    def compare(self, prompts, pairs):
        return [-1 if len(a) == len(b) else int(len(b) > len(a)) for a, b in pairs]


def test_generate_completions_left_pads(tiny_lm):
    model, tok = tiny_lm
    prompts = ["reverse 12 =", "reverse 4721 ="]
    batched = generate_completions(model, tok, prompts, max_new_tokens=6)
    single = [generate_completions(model, tok, [p], max_new_tokens=6)[0] for p in prompts]
    assert batched == single


def test_win_rate_callback_logs_eval_win_rate(tmp_path):
    from posttrain import SFTConfig, SFTTrainer
    from posttrain.tasks.builtin import task_dataset

    prompts = ["reverse 1234 =", "reverse 987 ="]
    callback = WinRateCallback(_LongerWins(seed=0), prompts, max_new_tokens=8)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                     eval_strategy="steps", eval_steps=2, logging_steps=2, use_cpu=True)
    trainer = SFTTrainer("posttrain/tiny-qwen2", args, train_dataset=task_dataset("reverse", size=16),
                         eval_dataset=task_dataset("reverse", "test", size=4), callbacks=[callback])
    trainer.train()
    assert callback.reference_completions is not None and len(callback.reference_completions) == 2
    rows = [r for r in trainer.state.log_history if "eval_win_rate" in r]
    assert [r["step"] for r in rows] == [2, 4]
    assert all(0.0 <= r["eval_win_rate"] <= 1.0 for r in rows)
    assert all("eval_loss" in r for r in rows)  # merged into the evaluation's own row
    # a judge that fails on everything warns instead of stopping training
    class Broken(PairwiseJudge):
        def compare(self, prompts, pairs):
            raise JudgeError("server down")

    callback.judge = Broken()
    with pytest.warns(UserWarning, match="no win rate at step 4: server down"):
        trainer.evaluate()
    callback.judge = _LongerWins(seed=0)
    with pytest.raises(ValueError, match="needs eval_prompts="):  # TRL order (judge, trainer): no prompt column here
        WinRateCallback(_LongerWins(), trainer)
    # with the trainer known, the value goes through trainer.log (reporters see it) and evaluate() returns it
    callback.set_trainer(trainer)
    metrics = trainer.evaluate()
    assert "eval_win_rate" in metrics
    assert trainer.state.log_history[-1]["eval_win_rate"] == metrics["eval_win_rate"]


def test_win_rate_callback_trl_style_arguments():
    from datasets import Dataset
    from transformers import GenerationConfig

    class FakeTrainer:
        eval_dataset = Dataset.from_list([{"prompt": f"reverse {i}{i} ="} for i in range(5)])

    callback = WinRateCallback(_LongerWins(), trainer=FakeTrainer(), num_prompts=3,
                               generation_config=GenerationConfig(max_new_tokens=5, do_sample=False))
    assert callback.eval_prompts == ["reverse 00 =", "reverse 11 =", "reverse 22 ="]
    assert callback.max_new_tokens == 5
    with pytest.raises(ValueError, match="needs eval_prompts="):
        WinRateCallback(_LongerWins())
