"""Tool-calling data: the built-in template's rendering, assistant-only masks around tool turns,
row/column errors for malformed tool calls, and SFT / preference tokenisation of tool rows."""

import json

import pytest
from datasets import Dataset

from posttrain.data import formats
from posttrain.data.chat import template_inputs, template_tools
from posttrain.data.tokenize import TokenizeError, encode_prompt, encode_prompt_completion, encode_text
from posttrain.models.loading import load_tokenizer
from posttrain.trainers.preference_base import prepare_preference_dataset
from posttrain.trainers.sft import SFTConfig, SFTTrainer

MODEL = "posttrain/tiny-qwen2"


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "12 * 34".
    """
    return expression


CALC_SCHEMA = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string",
                                                                   "description": 'The expression, e.g. "12 * 34".'}},
                   "required": ["expression"]},
    "return": {"type": "string"}}}


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


EPISODE = [
    {"role": "user", "content": "What is 123 * 456?"},
    {"role": "assistant", "tool_calls": [call("calculate", {"expression": "123 * 456"})]},
    {"role": "tool", "name": "calculate", "content": "56088"},
    {"role": "assistant", "content": "56088"},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None, model=MODEL)


# ------------------------------------------------------------------ the built-in template


def test_template_renders_tools_calls_and_results(tok):
    messages = [{"role": "system", "content": "Be brief."}, *EPISODE]
    text = tok.apply_chat_template(messages, tools=[calculate], tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\nYou may call these functions:\n<tools>\n"
        + json.dumps(CALC_SCHEMA)
        + '\n</tools>\nTo call one, write <tool_call>{"name": <name>, "arguments": <JSON object>}</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\nWhat is 123 * 456?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "calculate", "arguments": {"expression": "123 * 456"}}'
        "</tool_call><|im_end|>\n"
        "<|im_start|>tool\n56088<|im_end|>\n"
        "<|im_start|>assistant\n56088<|im_end|>\n")
    # content beside calls, several calls, arguments as a JSON string (written as given)
    turn = {"role": "assistant", "content": "Two sums.",
            "tool_calls": [call("calculate", '{"expression":"1+1"}'), call("calculate", {"expression": "2+2"})]}
    assert tok.apply_chat_template([EPISODE[0], turn], tokenize=False).endswith(
        '<|im_start|>assistant\nTwo sums.\n<tool_call>{"name": "calculate", "arguments": {"expression":"1+1"}}'
        '</tool_call>\n<tool_call>{"name": "calculate", "arguments": {"expression": "2+2"}}</tool_call>'
        "<|im_end|>\n")


def test_template_without_tools_is_plain_chatml(tok):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}]
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert tok.apply_chat_template(messages, tokenize=False) == expected
    assert tok.apply_chat_template(messages, tools=[], tokenize=False) == expected
    assert tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True) == (
        expected[: expected.index("<|im_start|>assistant")] + "<|im_start|>assistant\n")


def test_assistant_only_mask_trains_on_calls_not_on_tool_results(tok):
    out = encode_text(tok, EPISODE, assistant_only=True, tools=[CALC_SCHEMA])
    ids, mask = out["input_ids"], out["loss_mask"]
    assert len(ids) == len(mask)
    # token by token: every masked-in token lies inside an assistant turn's body
    text = tok.decode(ids)
    spans = []  # (start, end) character spans of what the assistant writes, <|im_end|> included
    start = 0
    while (i := text.find("<|im_start|>assistant\n", start)) >= 0:
        body = i + len("<|im_start|>assistant\n")
        end = text.index("<|im_end|>", body) + len("<|im_end|>")
        spans.append((body, end))
        start = end
    offset = 0
    for token, m in zip(ids, mask):
        piece = tok.decode([token])
        inside = any(a <= offset and offset + len(piece) <= b for a, b in spans)
        assert m == int(inside), (piece, offset)
        offset += len(piece)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == (
        '<tool_call>{"name": "calculate", "arguments": {"expression": "123 * 456"}}</tool_call><|im_end|>'
        "56088<|im_end|>")


# ------------------------------------------------------------------ validation


def test_tool_rows_validate_in_every_layout():
    rows = [{"messages": EPISODE, "tools": [CALC_SCHEMA]}]
    assert formats.validate(rows).conversational
    prompt_completion = [{"prompt": EPISODE[:1], "completion": EPISODE[1:], "tools": json.dumps([CALC_SCHEMA])}]
    assert formats.validate(prompt_completion).name == "prompt_completion"
    preference = [{"prompt": EPISODE[:3], "chosen": EPISODE[3:], "rejected": [{"role": "assistant", "content": "1"}]}]
    assert formats.validate(Dataset.from_list(preference)).name == "preference"
    assert formats.is_conversational(EPISODE)


@pytest.mark.parametrize("message, expected", [
    ({"role": "assistant", "tool_calls": [call("calculate", "{not json")]},
     r"message 1, tool call 0: 'arguments' is a string but not valid JSON"),
    ({"role": "assistant", "tool_calls": [call("calculate", [1, 2])]},
     r"message 1, tool call 0: 'arguments' must be a dict or a JSON object string, got list"),
    ({"role": "assistant", "tool_calls": [call("calculate", "[1]")]},
     r"message 1, tool call 0: 'arguments' must be a dict or a JSON object string"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": {}}}]},
     r"message 1, tool call 0: the function 'name' must be a non-empty string, got nothing"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "calculate"}}]},
     r"message 1, tool call 0: the function 'arguments' are missing"),
    ({"role": "assistant", "tool_calls": [{"name": "calculate", "arguments": {}}]},
     r"message 1, tool call 0: expected \{'type': 'function', 'function'"),
    ({"role": "assistant", "tool_calls": [{"type": "web", "function": {"name": "f", "arguments": {}}}]},
     r"message 1, tool call 0: 'type' must be 'function'"),
    ({"role": "assistant", "tool_calls": []}, r"message 1: 'tool_calls' must be a non-empty list"),
    ({"role": "assistant", "content": 3, "tool_calls": [call("f", {})]},
     r"message 1: 'content' must be a string or None beside 'tool_calls'"),
    ({"role": "user", "tool_calls": [call("f", {})]}, r"message 1: only assistant messages may hold 'tool_calls'"),
    ({"role": "tool", "name": "calculate"}, r"message 1: 'content' is missing"),
    ({"role": "tool", "content": "1", "tool_call_id": 7}, r"message 1: 'tool_call_id' must be a string, got int"),
])
def test_malformed_tool_messages_name_row_column_and_message(message, expected):
    good = {"messages": EPISODE}
    bad = {"messages": [EPISODE[0], message]}
    with pytest.raises(formats.FormatError, match=r"^row 1, column 'messages': " + expected):
        formats.validate([good, bad])


@pytest.mark.parametrize("tools, expected", [
    ("[{", r"is a string but not valid JSON"),
    ({"name": "f"}, r"expected a list of tools"),
    ([{"type": "function", "function": {"description": "no name"}}], r"tool 0: expected a JSON schema with a"),
])
def test_malformed_tools_column(tools, expected):
    rows = [{"messages": EPISODE, "tools": [CALC_SCHEMA]}, {"messages": EPISODE, "tools": tools}]
    with pytest.raises(formats.FormatError, match=r"^row 1, column 'tools': " + expected):
        formats.validate(rows)


# ------------------------------------------------------------------ rows as a Dataset stores them


def test_arrow_filled_keys_do_not_reach_the_template(tok):
    """Arrow gives every row's arguments the keys of all rows (None where absent); none is rendered."""
    other = [EPISODE[0], {"role": "assistant", "tool_calls": [call("guess", {"n": 5})]},
             {"role": "tool", "content": "lower"}, {"role": "assistant", "content": "4"}]
    data = Dataset.from_list([{"messages": EPISODE, "tools": None}, {"messages": other, "tools": None}])
    stored = data[0]["messages"]
    assert stored[1]["tool_calls"][0]["function"]["arguments"] == {"expression": "123 * 456", "n": None}
    messages, tools = template_inputs(stored, data[0]["tools"])
    assert tools is None
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"expression": "123 * 456"}
    assert "tool_calls" not in messages[0]  # the None Arrow gave a message without calls
    assert encode_text(tok, stored)["input_ids"] == encode_text(tok, EPISODE)["input_ids"]


def test_template_tools_accepts_functions_schemas_and_json():
    assert template_tools([calculate]) == [CALC_SCHEMA]
    assert template_tools(json.dumps([CALC_SCHEMA])) == [CALC_SCHEMA]
    assert template_tools(None) is None and template_tools([]) is None and template_tools("[]") is None


def test_conversational_to_text_renders_each_rows_tools(tok):
    rows = [{"prompt": EPISODE[:1], "completion": EPISODE[1:], "tools": [CALC_SCHEMA]}]
    out = formats.conversational_to_text(rows, tok)[0]
    assert "<tools>\n" + json.dumps(CALC_SCHEMA) in out["prompt"]
    assert out["completion"].startswith('<tool_call>{"name": "calculate"')
    assert out["tools"] == [CALC_SCHEMA]


# ------------------------------------------------------------------ tokenisation for the trainers


def test_tools_need_conversational_rows(tok):
    with pytest.raises(TokenizeError, match="tools need conversational rows"):
        encode_prompt(tok, "What is 2 * 3?", tools=[CALC_SCHEMA])
    with pytest.raises(TokenizeError, match="tools need conversational rows"):
        encode_text(tok, "2 * 3 = 6", tools=[CALC_SCHEMA])


def test_multi_turn_completion_and_prompt_with_tools(tok):
    out = encode_prompt_completion(tok, EPISODE[:1], EPISODE[1:], tools=[CALC_SCHEMA])
    assert "<tools>" in tok.decode(out["prompt_ids"])
    assert tok.decode(out["completion_ids"]) == (
        '<tool_call>{"name": "calculate", "arguments": {"expression": "123 * 456"}}</tool_call><|im_end|>\n'
        "<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n56088<|im_end|>\n")


def targets(tokenizer, row):
    return tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])


def test_sft_rows_with_tools(tok):
    args = SFTConfig(output_dir="unused", assistant_only_loss=True)
    messages = Dataset.from_list([{"messages": EPISODE, "tools": json.dumps([CALC_SCHEMA])}])
    row = SFTTrainer.prepare_dataset(messages, tok, args, packing=False)[0]
    assert "<tools>" in tok.decode(row["input_ids"])
    assert targets(tok, row) == (
        '<tool_call>{"name": "calculate", "arguments": {"expression": "123 * 456"}}</tool_call><|im_end|>'
        "56088<|im_end|>")
    # prompt-completion rows: the tool result inside the completion is masked out too
    pairs = Dataset.from_list([{"prompt": EPISODE[:1], "completion": EPISODE[1:], "tools": [CALC_SCHEMA]}])
    row = SFTTrainer.prepare_dataset(pairs, tok, args, packing=False)[0]
    assert targets(tok, row) == (
        '<tool_call>{"name": "calculate", "arguments": {"expression": "123 * 456"}}</tool_call><|im_end|>'
        "56088<|im_end|>")
    row = SFTTrainer.prepare_dataset(pairs, tok, SFTConfig(output_dir="unused"), packing=False)[0]
    assert "<|im_start|>tool\n56088" in targets(tok, row)  # completion-only loss alone keeps every completion token


def test_preference_rows_with_tool_turns_in_the_prompt(tok):
    rows = [{"prompt": EPISODE[:3], "chosen": [{"role": "assistant", "content": "56088"}],
             "rejected": [{"role": "assistant", "content": "56000"}], "tools": [CALC_SCHEMA]}]
    out = prepare_preference_dataset(rows, tok, paired=True, max_length=None, max_prompt_length=None,
                                     max_completion_length=None, truncation_mode="keep_start", name="DPO")[0]
    prompt = tok.decode(out["prompt_ids"])
    assert "<tools>" in prompt and prompt.endswith("<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(out["chosen_ids"]) == "56088<|im_end|>\n"
    assert tok.decode(out["rejected_ids"]) == "56000<|im_end|>\n"
    unpaired = prepare_preference_dataset(rows, tok, paired=False, max_length=None, max_prompt_length=None,
                                          max_completion_length=None, truncation_mode="keep_start", name="KTO")
    assert [tok.decode(r["completion_ids"]) for r in unpaired] == ["56088<|im_end|>\n", "56000<|im_end|>\n"]


def test_sft_and_dpo_train_on_tool_traces(tmp_path):
    """Two steps each on the calculator traces: the losses are finite and the weights move."""
    import math

    import torch

    from posttrain.tasks.environments import calculator_traces
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    common = dict(per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2, logging_steps=1, disable_tqdm=True,
                  report_to="none", dataloader_pin_memory=False, seed=0)
    traces = calculator_traces("train", 8)
    sft = SFTTrainer(MODEL, args=SFTConfig(output_dir=str(tmp_path / "sft"), assistant_only_loss=True, **common),
                     train_dataset=traces)
    before = [p.detach().clone() for p in sft.model.parameters()]
    sft.train()
    assert all(not torch.equal(a, b) for a, b in zip(before, sft.model.parameters()))
    assert all(math.isfinite(r["loss"]) for r in sft.state.log_history if "loss" in r)

    pairs = Dataset.from_list([{"prompt": t["messages"][:3], "chosen": [t["messages"][3]],
                                "rejected": [{"role": "assistant", "content": t["messages"][3]["content"][::-1] + "1"}],
                                "tools": t["tools"]} for t in traces])
    dpo = DPOTrainer(MODEL, args=DPOConfig(output_dir=str(tmp_path / "dpo"), **common), train_dataset=pairs)
    dpo.train()
    losses = [r["loss"] for r in dpo.state.log_history if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_continuation_ids_append_tool_turns_like_a_full_rendering(tok):
    """prompt ids + sampled turn (ending at EOS) + continuation ids == the whole conversation rendered
    at once, turn after turn: a multi-turn rollout can grow one row's tokens without re-rendering."""
    from posttrain.data.tokenize import continuation_ids

    guess = [call("guess", {"n": 8}), call("guess", {"n": 4})]
    turns = [({"role": "assistant", "content": "", "tool_calls": [guess[0]]}, [{"role": "tool", "content": "lower"}]),
             ({"role": "assistant", "content": "Two at once.", "tool_calls": [guess[1], guess[1]]},
              [{"role": "tool", "content": "higher"}, {"role": "tool", "content": "higher"}])]
    tools = [CALC_SCHEMA]
    conversation = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Find my number."}]
    ids = encode_prompt(tok, conversation, tools)
    for turn, results in turns:
        sampled = encode_prompt_completion(tok, conversation, [turn], tools=tools)["completion_ids"]
        sampled = sampled[: sampled.index(tok.eos_token_id) + 1]  # the sampler stops at EOS
        added = continuation_ids(tok, conversation + [turn], results, tools)
        assert tok.decode(added).startswith("\n<|im_start|>tool\n") and tok.decode(added).endswith(
            "<|im_start|>assistant\n")
        ids += sampled + added
        conversation += [turn, *results]
        assert ids == encode_prompt(tok, conversation, tools)
