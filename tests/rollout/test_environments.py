"""Built-in environments: the safe calculator, the calculator task's data and reward, the
guessing game's feedback and reward, and SFT traces that replay to a full score."""

import json

import pytest

from posttrain.data.tokenize import encode_text
from posttrain.data.tools import environment_tools, tool_schemas
from posttrain.models.loading import load_tokenizer
from posttrain.rollout.tools import parse_tool_calls, run_tool_call, tools_by_name
from posttrain.tasks.environments import (ENVIRONMENTS, CalculatorEnv, GuessNumberEnv, calculator_dataset,
                                          calculator_reward, calculator_traces, evaluate_arithmetic,
                                          guess_number_dataset, guess_number_traces)


def test_arithmetic_values():
    assert evaluate_arithmetic("123 * 456") == 56088
    assert evaluate_arithmetic(" 2 + 3 * (4 - 1) ") == 11
    assert evaluate_arithmetic("-7 // 2") == -4 and evaluate_arithmetic("7 % 3") == 1
    assert evaluate_arithmetic("2 ** 10") == 1024 and evaluate_arithmetic("1 / 4") == 0.25
    assert evaluate_arithmetic("+1.5 * -2") == -3.0


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('echo hi')", "only numbers"),
    ("abs(-3)", "only numbers"),
    ("x + 1", "only numbers"),
    ("(1).real", "only numbers"),
    ("[1, 2]", "only numbers"),
    ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("9 ** 9 ** 9", "exponent"),
    ("10 ** 100", "out of range"),
    ("1 +", "not an arithmetic expression"),
    ("1" * 201, "longer than 200"),
])
def test_arithmetic_refuses_anything_else(expression, message):
    with pytest.raises(ValueError, match=message):
        evaluate_arithmetic(expression)


def test_calculator_env_tool_and_its_failures():
    env = ENVIRONMENTS["calculator"]()
    assert env.reset(prompt="ignored", answer="1") is None
    tools = environment_tools(env)
    assert [t.__name__ for t in tools] == ["calculate"]
    assert tool_schemas(tools)[0]["function"]["parameters"]["properties"]["expression"]["type"] == "string"
    assert env.calculate("347 * 829") == "287663" and env.calculate("10 / 4") == "2.5" and env.calculate("9 / 3") == "3"
    by_name = tools_by_name(tools)
    message, error = run_tool_call({"name": "calculate", "arguments": {"expression": "1 / 0"}}, by_name)
    assert error == "Error: calculate failed: ZeroDivisionError: division by zero" and message["content"] == error
    _, error = run_tool_call({"name": "calculate", "arguments": {"expression": "open('f')"}}, by_name)
    assert error.startswith("Error: calculate failed: ValueError: only numbers")
    assert env.calls == 5 and env.results == ["287663", "2.5", "3"]
    env.reset()
    assert env.calls == 0 and env.results == []


def test_calculator_env_can_withhold_its_results():
    env = CalculatorEnv(show_results=False)
    env.reset()
    assert env.calculate("47 * 83") == "unavailable" and env.calls == 1 and env.results == ["3901"]
    assert tool_schemas(environment_tools(env)) == tool_schemas(environment_tools(CalculatorEnv()))


def test_calculator_dataset_is_deterministic_with_disjoint_splits():
    train, test = calculator_dataset("train", 300), calculator_dataset("test", 50)
    assert len(train) == 300 and len(test) == 50
    assert train["prompt"] == calculator_dataset("train", 300)["prompt"]
    assert not {p[0]["content"] for p in train["prompt"]} & {p[0]["content"] for p in test["prompt"]}
    for row in train.select(range(20)):
        a, b = map(int, row["prompt"][0]["content"].removeprefix("What is ").removesuffix("?").split(" * "))
        assert 32 <= a <= 99 and 32 <= b <= 99 and row["answer"] == str(a * b) and len(row["answer"]) == 4
    with pytest.raises(ValueError, match="split"):
        calculator_dataset("valid")


def test_calculator_reward_reads_the_assistants_last_words():
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "12 * 34"}}}]}
    result = {"role": "tool", "name": "calculate", "content": "408"}
    right = [call, result, {"role": "assistant", "content": "The answer is 408."}]
    wrong = [call, result, {"role": "assistant", "content": "418"}]
    unfinished = [call, result]  # the answer sits in the tool result only
    text = '<tool_call>{"name": "calculate", "arguments": {"expression": "12 * 34"}}</tool_call> 408'
    rewards = calculator_reward([right, wrong, unfinished, text, "408", "no"], ["408"] * 6)
    assert rewards == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_calculator_traces_replay_through_the_environment():
    traces, data = calculator_traces("test", 10), calculator_dataset("test", 10)
    for trace, row in zip(traces, data):
        messages = trace["messages"]
        assert messages[0]["content"] == row["prompt"][0]["content"]
        env = CalculatorEnv()
        env.reset(**row)
        tools = tools_by_name(environment_tools(env))
        result, error = run_tool_call(messages[1]["tool_calls"][0], tools)
        assert error is None and result["content"] == messages[2]["content"] == row["answer"]
        assert calculator_reward([messages[1:]], [row["answer"]]) == [1.0]
        assert json.loads(trace["tools"]) == tool_schemas(environment_tools(env))


def test_calculator_traces_without_the_tool_listing_are_short():
    tok = load_tokenizer(None, model="posttrain/tiny-qwen2")
    full, short = calculator_traces("test", 1)[0], calculator_traces("test", 1, list_tools=False)[0]
    assert "tools" not in short and short["messages"] == full["messages"]
    listed = encode_text(tok, full["messages"], assistant_only=True, tools=full["tools"])
    bare = encode_text(tok, short["messages"], assistant_only=True)
    assert "<tools>" in tok.decode(listed["input_ids"]) and "<tools>" not in tok.decode(bare["input_ids"])
    assert len(bare["input_ids"]) < len(listed["input_ids"]) // 3
    # the same trained tokens: the call, then the answer
    trained = [tok.decode([t for t, m in zip(o["input_ids"], o["loss_mask"]) if m]) for o in (listed, bare)]
    assert trained[0] == trained[1] and trained[0].endswith(f"{full['messages'][-1]['content']}<|im_end|>")


def test_guess_feedback_and_reward():
    env = ENVIRONMENTS["guess_number"]()
    assert env.reset(secret=11, low=1, high=16, prompt="given") is None
    assert [t.__name__ for t in environment_tools(env)] == ["guess"]
    assert [env.guess(8), env.guess(12), env.guess(10), env.guess(11)] == ["higher", "lower", "higher", "correct"]
    assert env.get_reward() == 1.0  # 4 guesses, within binary search's worst case of 5 for 16 numbers
    assert env.guess(3) == "correct: you already found 11" and env.guesses == 4
    env.reset(secret=9, low=1, high=16)
    for n in range(1, 10):  # a linear scan: 9 guesses, within the default limit of twice binary search's 5
        env.guess(n)
    assert env.found and env.get_reward() == pytest.approx(5 / 9)
    env.reset(secret=2, low=1, high=16, max_guesses=2)
    assert [env.guess(9), env.guess(5), env.guess(2)] == ["lower", "lower", "no guesses left"]
    assert not env.found and env.get_reward() == 0.0
    assert env.guess("1") == "no guesses left"


def test_guess_reset_without_a_dataset_and_bad_rows():
    env = GuessNumberEnv(seed=3)
    assert env.reset(low=1, high=100) == "Find my number from 1 to 100."
    assert 1 <= env.secret <= 100
    drawn = []
    for _ in range(2):
        twin = GuessNumberEnv(seed=3)
        twin.reset(low=1, high=100)
        drawn.append(twin.secret)
    assert drawn == [env.secret] * 2  # a seed fixes the draw
    with pytest.raises(ValueError, match="outside"):
        env.reset(secret=20, low=1, high=16)
    with pytest.raises(ValueError, match="must not exceed"):
        env.reset(secret=1, low=5, high=2)
    message, error = run_tool_call({"name": "guess", "arguments": {"n": "five"}}, tools_by_name(environment_tools(env)))
    assert error.startswith("Error: guess failed: ValueError")


def test_guess_number_dataset_is_deterministic():
    train = guess_number_dataset("train", 50)
    assert train["secret"] == guess_number_dataset("train", 50)["secret"]
    assert train["secret"] != guess_number_dataset("test", 50)["secret"]
    assert set(train["secret"]) <= set(range(1, 17)) and len(set(train["secret"])) > 5
    assert {p[0]["content"] for p in train["prompt"]} == {"Find my number from 1 to 16."}


def test_guess_traces_are_binary_search_and_score_full_marks():
    traces, data = guess_number_traces("train", 40), guess_number_dataset("train", 40)
    for trace, row in zip(traces, data):
        env = GuessNumberEnv()
        env.reset(**row)
        tools = tools_by_name(environment_tools(env))
        messages = trace["messages"]
        calls = [m for m in messages if m["role"] == "assistant" and m["tool_calls"]]
        results = [m for m in messages if m["role"] == "tool"]
        assert len(calls) == len(results) <= 5
        for call, expected in zip(calls, results):
            message, error = run_tool_call(call["tool_calls"][0], tools)
            assert error is None and message["content"] == expected["content"]
        assert results[-1]["content"] == "correct" and messages[-1]["content"] == str(row["secret"])
        assert env.found and env.get_reward() == 1.0


def test_trace_sft_mask_leaves_out_the_environment_answers():
    tok = load_tokenizer(None, model="posttrain/tiny-qwen2")
    trace = guess_number_traces("train", 1)[0]
    out = encode_text(tok, trace["messages"], assistant_only=True, tools=trace["tools"])
    trained = tok.decode([t for t, m in zip(out["input_ids"], out["loss_mask"]) if m])
    calls, errors = parse_tool_calls(trained)
    assert errors == [] and len(calls) == sum(1 for m in trace["messages"] if m["role"] == "tool")
    for word in ("higher", "lower", "correct", "<tools>", "Find my number"):
        assert word not in trained
    assert trained.endswith(f"{trace['messages'][-1]['content']}<|im_end|>")
