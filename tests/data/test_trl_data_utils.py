"""TRL's data helpers (posttrain.data.utils) against hand-made expectations."""

import pytest
from datasets import Dataset, DatasetDict

from posttrain import (apply_chat_template, extract_prompt, is_conversational, is_conversational_from_value,
                       maybe_apply_chat_template, maybe_convert_to_chatml, maybe_extract_prompt,
                       maybe_unpair_preference_dataset, pack_dataset, truncate_dataset, unpair_preference_dataset)

USER = [{"role": "user", "content": "What color is the sky?"}]
BLUE = [{"role": "assistant", "content": "It is blue."}]
GREEN = [{"role": "assistant", "content": "It is green."}]


@pytest.fixture(scope="module")
def tokenizer():
    from posttrain.models.loading import load_tokenizer

    return load_tokenizer(None, model="posttrain/tiny-qwen2")  # ChatML


def chatml(*turns):
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns)


def test_is_conversational():
    assert is_conversational({"prompt": USER})
    assert is_conversational({"chosen": USER + BLUE, "rejected": USER + GREEN})
    assert not is_conversational({"prompt": "The sky is"})
    assert not is_conversational({"text": USER})  # not one of the message keys
    assert not is_conversational({"prompt": []})
    assert is_conversational_from_value({"conversations": [{"from": "user", "value": "hi"}]})
    assert not is_conversational_from_value({"conversations": [{"role": "user", "content": "hi"}]})
    assert not is_conversational_from_value({"conversations": "The sky is"})


def test_maybe_convert_to_chatml():
    example = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    out = maybe_convert_to_chatml(example)
    assert out == {"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}]}
    assert out is example  # in place, as TRL does
    standard = {"prompt": "The sky is", "completion": " blue."}
    assert maybe_convert_to_chatml(dict(standard)) == standard


def test_apply_chat_template_every_layout(tokenizer):
    prompt = chatml(("user", "What color is the sky?")) + "<|im_start|>assistant\n"
    blue, green = "It is blue.<|im_end|>\n", "It is green.<|im_end|>\n"
    assert apply_chat_template({"messages": USER + BLUE}, tokenizer) == {"text": prompt + blue}
    assert apply_chat_template({"prompt": USER}, tokenizer) == {"prompt": prompt}
    assert apply_chat_template({"prompt": USER, "completion": BLUE}, tokenizer) == {"prompt": prompt,
                                                                                   "completion": blue}
    assert apply_chat_template({"prompt": USER, "chosen": BLUE, "rejected": GREEN}, tokenizer) == \
        {"prompt": prompt, "chosen": blue, "rejected": green}
    assert apply_chat_template({"chosen": USER + BLUE, "rejected": USER + GREEN}, tokenizer) == \
        {"chosen": prompt + blue, "rejected": prompt + green}
    assert apply_chat_template({"prompt": USER, "completion": BLUE, "label": False}, tokenizer) == \
        {"prompt": prompt, "completion": blue, "label": False}
    # a prompt ending in the assistant's turn is continued, not closed
    open_turn = apply_chat_template({"prompt": USER + [{"role": "assistant", "content": "It is"}]}, tokenizer)
    assert open_turn == {"prompt": prompt + "It is"}
    with pytest.raises(KeyError, match="Invalid keys"):
        apply_chat_template({"prompt": USER, "chosen": BLUE}, tokenizer)
    with pytest.raises(ValueError, match="'system'"):
        apply_chat_template({"prompt": [{"role": "system", "content": "be brief"}]}, tokenizer)


def test_apply_chat_template_tools_and_kwargs(tokenizer):
    def get_weather(city: str):
        """Weather of a city.

        Args:
            city: The city.
        """

    out = apply_chat_template({"prompt": USER}, tokenizer, tools=[get_weather])
    assert out["prompt"].startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in out["prompt"]
    # a row's chat_template_kwargs and the call's reach the template
    tokenizer_template = "{{ greeting }}|{% for m in messages %}{{ m['content'] }}{% endfor %}"
    row = {"messages": USER, "chat_template_kwargs": {"greeting": "row"}}
    assert apply_chat_template(row, tokenizer, chat_template=tokenizer_template)["text"] == \
        "row|What color is the sky?"
    assert apply_chat_template(row, tokenizer, chat_template=tokenizer_template, greeting="call")["text"] == \
        "call|What color is the sky?"


def test_maybe_apply_chat_template_leaves_standard_rows(tokenizer):
    row = {"prompt": "The sky is", "completion": " blue."}
    assert maybe_apply_chat_template(row, tokenizer) is row
    assert maybe_apply_chat_template({"prompt": USER}, tokenizer)["prompt"].endswith("<|im_start|>assistant\n")


def test_extract_prompt():
    assert extract_prompt({"chosen": "The sky is blue.", "rejected": "The sky is green."}) == \
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    assert extract_prompt({"chosen": USER + BLUE, "rejected": USER + GREEN}) == \
        {"prompt": USER, "chosen": BLUE, "rejected": GREEN}
    assert maybe_extract_prompt({"chosen": USER + BLUE, "rejected": USER + GREEN})["prompt"] == USER
    explicit = {"prompt": USER, "chosen": BLUE, "rejected": GREEN}
    assert maybe_extract_prompt(explicit) is explicit
    # a string prompt beside conversations is not the prompt: it is extracted from the conversations
    mixed = {"prompt": "What color is the sky?", "chosen": USER + BLUE, "rejected": USER + GREEN}
    assert maybe_extract_prompt(mixed) == {"prompt": USER, "chosen": BLUE, "rejected": GREEN}
    assert maybe_extract_prompt({"text": "x"}) == {"text": "x"}
    data = Dataset.from_dict({"chosen": ["Q: 1+1? A: 2"], "rejected": ["Q: 1+1? A: 3"]}).map(extract_prompt)
    assert data[0] == {"chosen": " 2", "rejected": " 3", "prompt": "Q: 1+1? A:"}


def test_unpair_preference_dataset():
    data = Dataset.from_dict({"prompt": ["The sky is", "The sun is"], "chosen": [" blue.", " in the sky."],
                              "rejected": [" green.", " in the sea."]})
    out = unpair_preference_dataset(data)
    assert out.column_names == ["prompt", "completion", "label"]
    assert out[:] == {"prompt": ["The sky is", "The sun is", "The sky is", "The sun is"],
                      "completion": [" blue.", " in the sky.", " green.", " in the sea."],
                      "label": [True, True, False, False]}
    both = maybe_unpair_preference_dataset(DatasetDict(train=data, test=data))
    assert len(both["train"]) == len(both["test"]) == 4
    unpaired = Dataset.from_dict({"prompt": ["a"], "completion": ["b"], "label": [True]})
    assert maybe_unpair_preference_dataset(unpaired) is unpaired


EXAMPLES = {"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]],
            "attention_mask": [[1, 1, 1, 0, 0], [1, 0], [1, 1, 0], [1]]}


def test_pack_dataset_bfd_by_hand():
    # cut to 4: lengths 4, 2, 3, 1; longest first: [1-4] fills a bin, [8,9,10] opens one (room 1),
    # [6,7] opens one (room 2), [11] goes to the tightest fit, [8,9,10]'s bin
    out = pack_dataset(Dataset.from_dict(EXAMPLES), seq_length=4, strategy="bfd")
    assert out[:] == {"input_ids": [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]],
                      "attention_mask": [[1, 1, 1, 0], [1, 1, 0, 1], [1, 0]],
                      "seq_lengths": [[4], [3, 1], [2]]}


def test_pack_dataset_bfd_requeue_keeps_the_overflow():
    out = pack_dataset(Dataset.from_dict(EXAMPLES), seq_length=4, strategy="bfd-requeue")
    assert sorted(t for row in out["input_ids"] for t in row) == list(range(1, 12))  # no token lost
    assert out["seq_lengths"] == [[4], [3, 1], [2, 1]]
    assert out["input_ids"] == [[1, 2, 3, 4], [8, 9, 10, 5], [6, 7, 11]]
    assert out["attention_mask"] == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1]]


def test_pack_dataset_wrapped_and_errors():
    out = pack_dataset(Dataset.from_dict(EXAMPLES), seq_length=4, strategy="wrapped")
    assert out[:] == {"input_ids": [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]],
                      "attention_mask": [[1, 1, 1, 0], [0, 1, 0, 1], [1, 0, 1]]}
    both = pack_dataset(DatasetDict(train=Dataset.from_dict(EXAMPLES)), seq_length=4)
    assert both["train"]["seq_lengths"] == [[4], [3, 1], [2]]
    with pytest.raises(ValueError, match="Invalid packing strategy"):
        pack_dataset(Dataset.from_dict(EXAMPLES), 4, strategy="greedy")
    with pytest.raises(TypeError, match=r"\['text'\]"):
        pack_dataset(Dataset.from_dict({**EXAMPLES, "text": ["a", "b", "c", "d"]}), 4)
    bad = Dataset.from_dict({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1]]})
    with pytest.raises(ValueError, match="row 0: column 'attention_mask' has 2 values"):
        pack_dataset(bad, 4)


def test_truncate_dataset():
    data = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8]],
                              "attention_mask": [[0, 1, 1], [0, 0, 1, 1], [1]], "id": ["a", "b", "c"]})
    out = truncate_dataset(data, max_length=2)
    assert out[:] == {"input_ids": [[1, 2], [4, 5], [8]], "attention_mask": [[0, 1], [0, 0], [1]],
                      "id": ["a", "b", "c"]}
    assert truncate_dataset(DatasetDict(train=data), 1)["train"]["input_ids"] == [[1], [4], [8]]
