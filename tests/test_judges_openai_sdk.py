"""OpenAIPairwiseJudge through the `openai` SDK (a fake module here: the package is not installed), with the
built-in client as the fallback."""

import sys
import types

import pytest

from posttrain.judges import JudgeError, OpenAIPairwiseJudge


class _Reply:
    def __init__(self, content):
        self.choices = [types.SimpleNamespace(message=types.SimpleNamespace(content=content))]


def _fake_openai():
    """A module with OpenAI / AzureOpenAI clients that record how they were built and what they were asked;
    the answer is read from the user message ("GOOD" response wins, "FAIL" raises a 429 the SDK gave up on)."""
    sdk = types.ModuleType("openai")
    sdk.built, sdk.requests = [], []

    class OpenAIError(Exception):
        pass

    class APIStatusError(OpenAIError):
        def __init__(self, message, status_code):
            super().__init__(message)
            self.status_code = status_code

    class OpenAI:
        def __init__(self, **kwargs):
            sdk.built.append((type(self).__name__, kwargs))
            self.chat = types.SimpleNamespace(completions=types.SimpleNamespace(create=self._create))

        def _create(self, **body):
            sdk.requests.append(body)
            user = body["messages"][-1]["content"]
            if "FAIL" in user:
                raise APIStatusError("rate limited; retried 3 times", 429)
            first = user.split("Response 0")[1].split("Response 1")[0] if "Response 0" in user else user
            return _Reply("0" if "GOOD" in first else "1")

    class AzureOpenAI(OpenAI):
        pass

    sdk.OpenAIError, sdk.APIStatusError, sdk.OpenAI, sdk.AzureOpenAI = OpenAIError, APIStatusError, OpenAI, AzureOpenAI
    return sdk


@pytest.fixture
def sdk(monkeypatch):
    fake = _fake_openai()
    monkeypatch.setitem(sys.modules, "openai", fake)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("AZURE_OPENAI_ENDPOINT", raising=False)
    return fake


TEMPLATE = "Which is better for {prompt}? Response 0: {response0} Response 1: {response1}. Answer 0 or 1."


def test_the_sdk_client_is_used_when_installed(sdk, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-abc")
    judge = OpenAIPairwiseJudge("gpt-judge", system_prompt=TEMPLATE, timeout=7.0, max_retries=5, seed=0)
    pairs = [("GOOD a", "bad b"), ("bad a", "GOOD b")] * 3
    assert judge.judge(["q"] * 6, pairs) == [0, 1] * 3  # verdicts swapped back after the random order swaps
    assert sdk.built == [("OpenAI", {"base_url": "https://api.openai.com/v1", "api_key": "sk-abc", "timeout": 7.0,
                                     "max_retries": 5})]  # the SDK does the retries (Retry-After included)
    body = sdk.requests[0]
    assert body["model"] == "gpt-judge" and body["temperature"] == 0.0 and len(body["messages"]) == 1
    assert len(sdk.requests) == 6 and judge.num_requests == 6


def test_sdk_failures_give_minus_one_and_all_failing_raises(sdk, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-abc")
    judge = OpenAIPairwiseJudge("m", system_prompt=TEMPLATE, seed=0)
    with pytest.warns(UserWarning, match="1 of 2 items got no verdict"):
        verdicts = judge.judge(["q", "FAIL"], [("GOOD", "bad"), ("GOOD", "bad")], shuffle_order=False)
    assert verdicts == [0, -1]
    assert len(sdk.requests) == 2  # our loop does not retry on top of the SDK's retries
    with pytest.raises(JudgeError, match="HTTP 429: rate limited"):
        judge.judge(["FAIL"], [("a", "b")])


def test_azure_from_the_environment(sdk, monkeypatch):
    monkeypatch.setenv("AZURE_OPENAI_ENDPOINT", "https://my-resource.openai.azure.com")
    monkeypatch.setenv("AZURE_OPENAI_API_KEY", "azure-key")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    judge = OpenAIPairwiseJudge("my-deployment", system_prompt=TEMPLATE)
    assert judge.judge(["q"], [("GOOD", "bad")], shuffle_order=False) == [0]
    name, options = sdk.built[0]
    assert name == "AzureOpenAI" and options["azure_endpoint"] == "https://my-resource.openai.azure.com"
    assert options["api_key"] == "azure-key" and sdk.requests[0]["model"] == "my-deployment"


def test_a_given_client_is_used_as_is_without_a_key(sdk, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    client = sdk.AzureOpenAI(azure_endpoint="https://x", api_version="2024-06-01")
    judge = OpenAIPairwiseJudge("dep", client=client, system_prompt=TEMPLATE)
    assert judge.judge(["q"], [("bad", "GOOD")], shuffle_order=False) == [1]
    assert len(sdk.built) == 1  # only the client the test made


def test_the_builtin_client_without_the_sdk_or_when_asked(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # import openai -> ImportError
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    judge = OpenAIPairwiseJudge("m", base_url="http://127.0.0.1:9/v1", timeout=0.5, max_retries=0)
    assert judge._sdk_client("k") is None
    with pytest.raises(ImportError, match="pip install openai"):
        OpenAIPairwiseJudge("m", use_openai_sdk=True)._sdk_client("k")
    with pytest.raises(JudgeError, match="request failed"):  # the built-in client; nothing listens on port 9
        judge.judge(["q"], [("a", "b")])
    sdk = _fake_openai()
    monkeypatch.setitem(sys.modules, "openai", sdk)
    builtin = OpenAIPairwiseJudge("m", base_url="http://127.0.0.1:9/v1", timeout=0.5, max_retries=0,
                                  use_openai_sdk=False)
    with pytest.raises(JudgeError, match="request failed"):
        builtin.judge(["q"], [("a", "b")])
    assert sdk.built == [] and sdk.requests == []
