"""Bad values refused by the data layer, naming the row and the column: margins that are not finite
numbers, ranked rows that give no pair, online prompts that are not text or cannot start a generation."""

import math

import pytest
from datasets import Dataset

from posttrain.data.formats import FormatError, ranked_to_preference, to_canonical, validate
from posttrain.data.tokenize import TokenizeError, check_prompts, encode_prompt
from posttrain.models.loading import load_tokenizer


def pairs(margins):
    return [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "margin": m} for m in margins]


@pytest.mark.parametrize("bad, got", [(math.nan, "float nan"), (math.inf, "float inf"), (-math.inf, "float -inf"),
                                      (None, "None")])
def test_margin_must_be_a_finite_number(bad, got):
    rows = pairs([1.0, 0.5, bad])
    for data in (rows, Dataset.from_list(rows)):
        with pytest.raises(FormatError, match=f"row 2, column 'margin': expected a finite number, got {got}"):
            validate(data)


def test_margin_string_column_is_refused_and_good_margins_pass():
    with pytest.raises(FormatError, match="row 0, column 'margin': expected a finite number, got str 'big'"):
        to_canonical(Dataset.from_list(pairs(["big", "small"])))
    assert validate(Dataset.from_list(pairs([0, 1.5, -2.0]))).name == "preference"


@pytest.mark.parametrize("key, values", [("ranks", [1, 1, 1]), ("scores", [0.5, 0.5, 0.5])])
def test_ranked_row_of_ties_is_refused(key, values):
    rows = [{"prompt": "p", "responses": [" a", " b", " c"], key: [0, 1, 2] if key == "ranks" else [3, 2, 1]},
            {"prompt": "q", "responses": [" a", " b", " c"], key: values}]
    for data in (rows, Dataset.from_list(rows)):
        with pytest.raises(FormatError, match=f"row 1, column '{key}': .* all responses tie"):
            ranked_to_preference(data)
        with pytest.raises(FormatError, match=f"row 1, column '{key}'"):
            to_canonical(data)
    # the best response alone needs no pair: ties are fine there
    best, _ = to_canonical(rows, target="prompt_completion")
    assert [r["completion"] for r in best] == [" a", " a"]


def test_ranked_row_with_one_response_is_refused():
    rows = [{"prompt": "p", "responses": [" a"], "ranks": [0]}]
    with pytest.raises(FormatError, match="row 0, column 'ranks': .* the only response"):
        to_canonical(rows)


TOKENIZER = load_tokenizer("posttrain/tiny-qwen2")


@pytest.mark.parametrize("bad, got", [(None, "None"), (42, "int 42"), (["just", "words"], "list"),
                                      ([{"role": "user"}], "'content' is missing")])
def test_online_prompts_must_be_text_or_messages(bad, got):
    rows = [{"prompt": "reverse 12 =", "answer": "21"}, {"prompt": bad, "answer": "1"}]
    data = Dataset.from_list(rows) if bad is None else rows  # arrow cannot mix the other types in a column
    with pytest.raises(TokenizeError, match=f"train_dataset: row 1, column 'prompt': .*{got}"):
        check_prompts(data, TOKENIZER)


def test_empty_prompt_needs_a_token_to_start_from():
    data = Dataset.from_list([{"prompt": "a"}, {"prompt": ""}])
    assert encode_prompt(TOKENIZER, "") == []  # Qwen2-style: no BOS
    with pytest.raises(TokenizeError, match="eval_dataset: row 1, column 'prompt': the prompt is the empty string"):
        check_prompts(data, TOKENIZER, "eval_dataset")

    class WithBOS:  # a tokenizer that starts every text with a BOS token: the empty prompt is allowed
        chat_template = None

        def __call__(self, text):
            return {"input_ids": [1] + [ord(c) for c in text]}

    check_prompts(data, WithBOS())
    check_prompts(Dataset.from_list([{"input_ids": [1, 2]}]), TOKENIZER)  # tokenised prompts: not checked here
