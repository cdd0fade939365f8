"""ShareGPT `conversations` rows ({"from", "value"} turns) -> chat messages, and SFT on them."""

import pytest
from datasets import Dataset

from posttrain.data import formats
from posttrain.data.formats import FormatError, sharegpt_to_messages, to_canonical
from posttrain.models.loading import load_tokenizer
from posttrain.trainers.sft import SFTConfig, SFTTrainer

TURNS = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "reverse 12 ="},
         {"from": "gpt", "value": "21"}]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "reverse 12 ="},
            {"role": "assistant", "content": "21"}]


def test_detected_and_converted_to_messages_keeping_other_columns():
    data = Dataset.from_list([{"conversations": TURNS, "id": 3}])
    info = formats.detect_format(data)
    assert (info.name, info.conversational) == ("sharegpt", True)
    out, info = to_canonical(data)
    assert (info.name, info.columns) == ("language_modeling", ("messages",))
    assert out[0] == {"messages": MESSAGES, "id": 3}
    # the synonyms: user / assistant speakers, observation / tool results
    rows = [{"conversations": [{"from": "user", "value": "a"}, {"from": "assistant", "value": "b"},
                               {"from": "user", "value": "c"}, {"from": "assistant", "value": "d"}]}]
    assert [m["role"] for m in sharegpt_to_messages(rows)[0]["messages"]] == ["user", "assistant"] * 2


def test_function_call_turns_become_tool_calls():
    rows = [{"conversations": [{"from": "human", "value": "2+2?"},
                               {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 2, "b": 2}}'},
                               {"from": "observation", "value": "4"}, {"from": "gpt", "value": "4"}]}]
    messages = sharegpt_to_messages(rows)[0]["messages"]
    assert messages[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]}
    assert messages[2] == {"role": "tool", "content": "4"}
    formats.validate([{"messages": messages}])  # a valid tool-calling conversation


def test_bad_turns_are_errors_naming_row_and_turn():
    good = {"conversations": TURNS}
    with pytest.raises(FormatError, match=r"row 1, column 'conversations': turn 1: unknown speaker 'from': 'bot'"):
        to_canonical([good, {"conversations": [TURNS[1], {"from": "bot", "value": "x"}]}])
    with pytest.raises(FormatError, match=r"row 0, column 'conversations': turn 0: expected \{'from'"):
        to_canonical([{"conversations": [{"role": "user", "content": "x"}]}])
    with pytest.raises(FormatError, match="row 0.*turn 1: a 'function_call' value must be a JSON object"):
        to_canonical([{"conversations": [TURNS[1], {"from": "function_call", "value": "add(2, 2)"}]}])
    with pytest.raises(FormatError, match="row 0.*non-empty list of ShareGPT turns"):
        to_canonical([{"conversations": []}])


def test_sft_trains_on_sharegpt_rows_as_on_messages(tmp_path):
    tokenizer = load_tokenizer("posttrain/tiny-qwen2")
    args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True)
    sharegpt = SFTTrainer.prepare_dataset(Dataset.from_list([{"conversations": TURNS}]), tokenizer, args, False)
    messages = SFTTrainer.prepare_dataset(Dataset.from_list([{"messages": MESSAGES}]), tokenizer, args, False)
    assert sharegpt[0] == messages[0]
    assert tokenizer.decode([t for t, m in zip(sharegpt[0]["input_ids"], sharegpt[0]["loss_mask"]) if m]) == \
        "21<|im_end|>"
