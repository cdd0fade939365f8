"""Format detection, row validation and conversions, on hand-written rows with exact outputs."""

import numpy as np
import pytest
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from posttrain.data.formats import (
    FormatError,
    FormatInfo,
    conversational_to_text,
    detect_format,
    implicit_to_explicit_preference,
    instruction_to_prompt_completion,
    is_conversational,
    preference_to_unpaired,
    ranked_to_preference,
    to_canonical,
    validate,
)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def ds(*rows):
    return Dataset.from_list(list(rows))


# --------------------------------------------------------------------------- detection

STANDARD = {
    "language_modeling": ({"text": "Beautiful is better than ugly."}, ("text",)),
    "prompt_only": ({"prompt": "The sky is", "answer": "blue"}, ("prompt",)),
    "prompt_completion": (
        {"prompt": "The sky is", "completion": " blue."},
        ("prompt", "completion"),
    ),
    "preference": (
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "margin": 1.0},
        ("prompt", "chosen", "rejected"),
    ),
    "implicit_prompt_preference": (
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        ("chosen", "rejected"),
    ),
    "unpaired_preference": (
        {"prompt": "The sky is", "completion": " blue.", "label": True},
        ("prompt", "completion", "label"),
    ),
    "ranked": (
        {"prompt": "Sky?", "responses": ["blue", "green"], "ranks": [0, 1]},
        ("prompt", "responses", "ranks"),
    ),
    "instruction": (
        {"instruction": "Add.", "input": "2+2", "output": "4"},
        ("instruction", "output", "input"),
    ),
}
CONVERSATIONAL = {
    "language_modeling": ({"messages": [user("Hi"), assistant("Hello")]}, ("messages",)),
    "prompt_only": ({"prompt": [user("Sky colour?")]}, ("prompt",)),
    "prompt_completion": (
        {"prompt": [user("Sky colour?")], "completion": [assistant("Blue.")]},
        ("prompt", "completion"),
    ),
    "preference": (
        {
            "prompt": [user("Sky colour?")],
            "chosen": [assistant("Blue.")],
            "rejected": [assistant("Green.")],
        },
        ("prompt", "chosen", "rejected"),
    ),
    "implicit_prompt_preference": (
        {
            "chosen": [user("Sky colour?"), assistant("Blue.")],
            "rejected": [user("Sky colour?"), assistant("Green.")],
        },
        ("chosen", "rejected"),
    ),
    "unpaired_preference": (
        {"prompt": [user("Sky colour?")], "completion": [assistant("Blue.")], "label": False},
        ("prompt", "completion", "label"),
    ),
    "ranked": (
        {
            "prompt": [user("Sky?")],
            "responses": [[assistant("blue")], [assistant("green")]],
            "scores": [2.0, 1.0],
        },
        ("prompt", "responses", "scores"),
    ),
}


@pytest.mark.parametrize(
    "name, conversational",
    [(name, False) for name in STANDARD] + [(name, True) for name in CONVERSATIONAL],
)
def test_detect_format(name, conversational):
    row, columns = (CONVERSATIONAL if conversational else STANDARD)[name]
    expected = FormatInfo(name, conversational, columns)
    assert detect_format(ds(row)) == expected
    assert detect_format([row]) == expected
    assert validate(ds(row)) == expected


def test_detect_from_column_names_and_precedence():
    assert detect_format(["prompt", "chosen", "rejected", "id"]).name == "preference"
    assert detect_format(["instruction", "output"]).columns == ("instruction", "output")
    assert detect_format(["messages"]) == FormatInfo("language_modeling", True, ("messages",))
    # ultrachat-style: a 'prompt' next to the full conversation is language modelling data
    assert detect_format(["prompt", "prompt_id", "messages"]).name == "language_modeling"
    assert detect_format(["prompt", "completion", "label"]).name == "unpaired_preference"


def test_unknown_columns_raise_with_columns_and_layouts():
    with pytest.raises(FormatError) as e:
        detect_format(ds({"question": "q", "reply": "r"}))
    message = str(e.value)
    assert "['question', 'reply']" in message
    assert (
        "preference: prompt, chosen, rejected" in message
        and "instruction: instruction, output [, input]" in message
    )


def test_is_conversational():
    assert is_conversational([user("hi")])
    assert is_conversational(({"role": "system", "content": ""},))
    assert not is_conversational("hi")
    assert not is_conversational([])
    assert not is_conversational([{"role": "user"}])
    assert not is_conversational(["hi"])
    assert not is_conversational(None)


# --------------------------------------------------------------------------- validation

RANKED = {"prompt": "p", "responses": ["a", "b"], "ranks": [0, 1]}
MALFORMED = [
    # (good row, bad row, column, fragment of the message)
    ({"text": "ok"}, {"text": ""}, "text", "non-empty string"),
    ({"prompt": "p", "completion": "c"}, {"prompt": None, "completion": "c"}, "prompt", "got None"),
    (
        {"prompt": "p", "completion": "c"},
        {"prompt": "p", "completion": ""},
        "completion",
        "got an empty str",
    ),
    (
        {"prompt": "p", "chosen": "a", "rejected": "b"},
        {"prompt": "p", "chosen": None, "rejected": "b"},
        "chosen",
        "expected a non-empty string or a list of {'role','content'} messages, got None",
    ),
    (
        {"prompt": "p", "chosen": "a", "rejected": "b"},
        {"prompt": "p", "chosen": "a", "rejected": ""},
        "rejected",
        "empty",
    ),
    (
        {"prompt": "p", "chosen": "a", "rejected": "b"},
        {"prompt": "p", "chosen": "a", "rejected": 3},
        "rejected",
        "got int 3",
    ),
    (
        {"prompt": "p", "completion": "c", "label": True},
        {"prompt": "p", "completion": "c", "label": 1},
        "label",
        "0/1 integers",
    ),
    (
        {"prompt": "p", "completion": "c", "label": True},
        {"prompt": "p", "completion": "c", "label": "yes"},
        "label",
        "bool",
    ),
    (
        {"prompt": "p", "completion": "c", "label": True},
        {"prompt": "p", "completion": "c", "label": None},
        "label",
        "None",
    ),
    (
        RANKED,
        {"prompt": "p", "responses": ["a", "b", "c"], "ranks": [0, 1]},
        "ranks",
        "'responses' has 3",
    ),
    (
        {"prompt": "p", "responses": ["a"], "scores": [1.0]},
        {"prompt": "p", "responses": ["a"], "scores": [float("nan")]},
        "scores",
        "finite numbers",
    ),
    (RANKED, {"prompt": "p", "responses": ["a", "b"], "ranks": [0, True]}, "ranks", "element 1"),
    (RANKED, {"prompt": "p", "responses": ["a", ""], "ranks": [0, 1]}, "responses", "response 1"),
    (RANKED, {"prompt": "p", "responses": [], "ranks": []}, "responses", "non-empty list"),
    # a Dataset fills a missing key with None, a list row reports it missing: both name the key
    ({"prompt": [user("q")]}, {"prompt": [{"role": "user"}]}, "prompt", "message 0: 'content'"),
    ({"prompt": [user("q")]}, {"prompt": [{"content": "q"}]}, "prompt", "message 0: 'role'"),
    (
        {"prompt": [user("q")]},
        {"prompt": [user("q"), {"role": "assistant", "content": 5}]},
        "prompt",
        "message 1: 'content' must be a string",
    ),
    (
        {"messages": [user("q")]},
        {"messages": "just text"},
        "messages",
        "list of {'role','content'} messages",
    ),
    (
        {"instruction": "i", "output": "o"},
        {"instruction": "i", "output": None},
        "output",
        "non-empty string",
    ),
    (
        {"instruction": "i", "input": "x", "output": "o"},
        {"instruction": "i", "input": 7, "output": "o"},
        "input",
        "int 7",
    ),
    (
        {"chosen": "The sky is blue", "rejected": "The sky is red"},
        {"chosen": "Yes", "rejected": "No"},
        "chosen",
        "share no prompt",
    ),
    (
        {"chosen": [user("q"), assistant("a")], "rejected": [user("q"), assistant("b")]},
        {"chosen": [assistant("a")], "rejected": [assistant("b")]},
        "chosen",
        "share no prompt",
    ),
]


def _arrow_can_hold(rows):
    try:
        Dataset.from_list(rows)
    except Exception:  # e.g. an int label next to bools: only a list of rows can hold that
        return False
    return True


@pytest.mark.parametrize(
    "good, bad, column, fragment, as_dataset",
    [(*case, False) for case in MALFORMED]
    + [(*case, True) for case in MALFORMED if _arrow_can_hold([case[0], case[1]])],
)
def test_malformed_row_names_row_and_column(good, bad, column, fragment, as_dataset):
    rows = [good, good, bad]
    data = Dataset.from_list(rows) if as_dataset else rows
    with pytest.raises(FormatError) as e:
        validate(data)
    message = str(e.value)
    assert message.startswith(f"row 2, column '{column}'"), message
    assert fragment in message, message
    validate(data, max_rows=2)  # the bad row lies beyond the checked rows


def test_numpy_bool_label_is_accepted():
    validate([{"prompt": "p", "completion": "c", "label": np.bool_(False)}])


def test_missing_key_in_a_list_row():
    rows = [{"prompt": "p", "completion": "c"}, {"prompt": "p"}]
    with pytest.raises(FormatError, match=r"row 1, column 'completion'.*missing from this row"):
        validate(rows)


def test_mixing_standard_and_conversational_is_refused():
    rows = [
        {"prompt": "p", "completion": "c"},
        {"prompt": "p", "completion": "c"},
        {"prompt": [user("p")], "completion": [assistant("c")]},
    ]
    with pytest.raises(FormatError) as e:
        validate(rows)
    assert "mixes standard and conversational" in str(e.value)
    assert "row 0, column 'prompt' is standard but row 2, column 'prompt' is conversational" in str(
        e.value
    )

    # within one row, in a Dataset (Arrow keeps each column to one type)
    with pytest.raises(FormatError, match=r"mixes .* row 0, column 'completion' is conversational"):
        validate(ds({"prompt": "p", "completion": [assistant("c")]}))
    with pytest.raises(
        FormatError, match="row 0, column 'responses': mixes string and message-list"
    ):
        validate([{"prompt": "p", "responses": ["a", [assistant("b")]], "ranks": [0, 1]}])


# --------------------------------------------------------------------------- conversions


def test_instruction_to_prompt_completion():
    data = ds(
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5", "id": 0},
        {"instruction": "Say hi.", "input": "", "output": "hi", "id": 1},
    )
    assert instruction_to_prompt_completion(data).to_list() == [
        {"prompt": "Add the numbers.\n\n2 and 3", "completion": "5", "id": 0},
        {"prompt": "Say hi.", "completion": "hi", "id": 1},
    ]
    assert instruction_to_prompt_completion([{"instruction": "Say hi.", "output": "hi"}]) == [
        {"prompt": "Say hi.", "completion": "hi"}
    ]


def test_ranked_to_preference_with_ranks():
    data = ds(
        {
            "prompt": "I have a cold.",
            "responses": ["rest", "take medicine", "see a doctor"],
            "ranks": [1, 2, 0],
            "id": 7,
        }
    )
    assert ranked_to_preference(data).to_list() == [
        {"prompt": "I have a cold.", "chosen": "see a doctor", "rejected": "rest", "id": 7},
        {
            "prompt": "I have a cold.",
            "chosen": "see a doctor",
            "rejected": "take medicine",
            "id": 7,
        },
        {"prompt": "I have a cold.", "chosen": "rest", "rejected": "take medicine", "id": 7},
    ]


def test_ranked_to_preference_with_scores_skips_ties():
    rows = [
        {"prompt": "p", "responses": ["a", "b", "c"], "scores": [0.5, 2.0, 0.5]},
        {"prompt": "q", "responses": ["x", "y"], "scores": [1, 1]},  # all tied: no pairs, an error
    ]
    assert ranked_to_preference(rows[:1]) == [
        {"prompt": "p", "chosen": "b", "rejected": "a"},
        {"prompt": "p", "chosen": "b", "rejected": "c"},
    ]
    assert len(ranked_to_preference(Dataset.from_list(rows[:1]))) == 2
    with pytest.raises(FormatError, match="row 1, column 'scores': .* all responses tie"):
        ranked_to_preference(Dataset.from_list(rows))


def test_ranked_conversational():
    row = CONVERSATIONAL["ranked"][0]
    assert ranked_to_preference([row]) == [
        {"prompt": [user("Sky?")], "chosen": [assistant("blue")], "rejected": [assistant("green")]}
    ]


@pytest.mark.parametrize(
    "chosen, rejected, prompt, chosen_rest, rejected_rest",
    [
        ("Q: 2+2?\nA: 4", "Q: 2+2?\nA: 5", "Q: 2+2?\nA:", " 4", " 5"),
        ("The cat sat", "The cats sat", "The", " cat sat", " cats sat"),  # divergence inside a word
        (
            "Hello world",
            "Hello world!",
            "Hello",
            " world",
            " world!",
        ),  # one is a prefix of the other
        ("Say it  loud", "Say it  softly", "Say it", "  loud", "  softly"),
        ("a b\nc", "a b\nd", "a b", "\nc", "\nd"),  # the prefix already ends after whitespace
        (
            [user("Hi"), assistant("Hello"), user("Sky?"), assistant("Blue")],
            [user("Hi"), assistant("Hello"), user("Sky?"), assistant("Red")],
            [user("Hi"), assistant("Hello"), user("Sky?")],
            [assistant("Blue")],
            [assistant("Red")],
        ),
        (  # shared assistant turns at the end stay with the completions
            [user("Sky?"), assistant("Let me see."), assistant("Blue")],
            [user("Sky?"), assistant("Let me see."), assistant("Red")],
            [user("Sky?")],
            [assistant("Let me see."), assistant("Blue")],
            [assistant("Let me see."), assistant("Red")],
        ),
        (
            [user("Sky?"), assistant("Blue")],
            [user("Sky?"), assistant("Blue")],
            [user("Sky?")],
            [assistant("Blue")],
            [assistant("Blue")],
        ),
    ],
)
def test_implicit_to_explicit_preference(chosen, rejected, prompt, chosen_rest, rejected_rest):
    out = implicit_to_explicit_preference(
        ds({"chosen": chosen, "rejected": rejected, "id": 3})
    ).to_list()
    assert out == [{"prompt": prompt, "chosen": chosen_rest, "rejected": rejected_rest, "id": 3}]


def test_implicit_without_shared_prompt_raises_with_row():
    rows = [
        {"chosen": "The sky is blue", "rejected": "The sky is red"},
        {"chosen": "Yes", "rejected": "No"},
    ]
    with pytest.raises(FormatError, match="row 1, column 'chosen'.*share no prompt"):
        implicit_to_explicit_preference(rows)


def test_preference_to_unpaired():
    data = ds({"prompt": "p", "chosen": "good", "rejected": "bad", "id": 1})
    assert preference_to_unpaired(data).to_list() == [
        {"prompt": "p", "completion": "good", "label": True, "id": 1},
        {"prompt": "p", "completion": "bad", "label": False, "id": 1},
    ]


def test_conversion_functions_refuse_other_formats():
    with pytest.raises(FormatError, match="expected a preference dataset, got prompt_completion"):
        preference_to_unpaired([{"prompt": "p", "completion": "c"}])


def test_to_canonical_defaults():
    data, info = to_canonical(ds({"instruction": "i", "output": "o", "answer": "a"}))
    assert info == FormatInfo("prompt_completion", False, ("prompt", "completion"))
    assert data.to_list() == [{"prompt": "i", "completion": "o", "answer": "a"}]

    data, info = to_canonical(
        [{"chosen": [user("q"), assistant("a")], "rejected": [user("q"), assistant("b")]}]
    )
    assert info == FormatInfo("preference", True, ("prompt", "chosen", "rejected"))
    assert data == [
        {"prompt": [user("q")], "chosen": [assistant("a")], "rejected": [assistant("b")]}
    ]

    canonical = ds({"prompt": "p", "completion": "c"})
    assert to_canonical(canonical)[0] is canonical


def test_to_canonical_validates_first():
    with pytest.raises(FormatError, match="row 1, column 'label'"):
        to_canonical(
            [
                {"prompt": "p", "completion": "c", "label": True},
                {"prompt": "p", "completion": "c", "label": 0},
            ]
        )


def test_to_canonical_targets():
    pref = ds({"prompt": "The sky is", "chosen": " blue.", "rejected": " red.", "id": 1})
    data, info = to_canonical(pref, "unpaired_preference")
    assert info == FormatInfo("unpaired_preference", False, ("prompt", "completion", "label"))
    assert [r["label"] for r in data] == [True, False]

    data, info = to_canonical(pref, "prompt_completion")
    assert data.to_list() == [{"prompt": "The sky is", "completion": " blue.", "id": 1}]

    data, info = to_canonical(pref, "language_modeling")
    assert info == FormatInfo("language_modeling", False, ("text",))
    assert data.to_list() == [{"text": "The sky is blue.", "id": 1}]

    conv = [
        {"prompt": [user("Sky?")], "chosen": [assistant("Blue")], "rejected": [assistant("Red")]}
    ]
    data, info = to_canonical(conv, "language_modeling")
    assert info == FormatInfo("language_modeling", True, ("messages",))
    assert data == [{"messages": [user("Sky?"), assistant("Blue")]}]

    unpaired = [
        {"prompt": "p", "completion": "good", "label": True},
        {"prompt": "p", "completion": "bad", "label": False},
    ]
    assert to_canonical(unpaired, "prompt_completion")[0] == [{"prompt": "p", "completion": "good"}]


def test_to_canonical_from_ranked_keeps_one_row_per_prompt():
    ranked = ds(
        {
            "prompt": "I have a cold.",
            "responses": ["rest", "take medicine", "see a doctor"],
            "ranks": [1, 2, 0],
            "answer": "doctor",
        }
    )
    data, info = to_canonical(ranked, "prompt_only")
    assert info == FormatInfo("prompt_only", False, ("prompt",))
    assert data.to_list() == [{"prompt": "I have a cold.", "answer": "doctor"}]
    data, _ = to_canonical(ranked, "prompt_completion")
    assert data.to_list() == [
        {"prompt": "I have a cold.", "completion": "see a doctor", "answer": "doctor"}
    ]
    data, _ = to_canonical(ranked, "unpaired_preference")
    assert len(data) == 6  # the three pairs, each split in two


def test_to_canonical_impossible_or_unknown_target():
    with pytest.raises(
        FormatError, match="cannot convert a prompt_completion dataset to preference"
    ):
        to_canonical([{"prompt": "p", "completion": "c"}], "preference")
    with pytest.raises(
        FormatError, match="cannot convert a language_modeling dataset to prompt_only.*none"
    ):
        to_canonical([{"text": "t"}], "prompt_only")
    with pytest.raises(FormatError, match="unknown target format 'dpo'"):
        to_canonical([{"text": "t"}], "dpo")


# --------------------------------------------------------------------------- chat templates

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(chat_template=CHATML):
    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "Sky", "?", "Blue", "Red"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", chat_template=chat_template
    )


def test_conversational_to_text():
    tok = make_tokenizer()
    prompt = "<|im_start|>user\nSky?<|im_end|>\n<|im_start|>assistant\n"

    lm = conversational_to_text(ds({"messages": [user("Sky?"), assistant("Blue")], "id": 1}), tok)
    assert lm.to_list() == [
        {
            "text": "<|im_start|>user\nSky?<|im_end|>\n<|im_start|>assistant\nBlue<|im_end|>\n",
            "id": 1,
        }
    ]

    pref = ds(
        {"prompt": [user("Sky?")], "chosen": [assistant("Blue")], "rejected": [assistant("Red")]}
    )
    assert conversational_to_text(pref, tok).to_list() == [
        {"prompt": prompt, "chosen": "Blue<|im_end|>\n", "rejected": "Red<|im_end|>\n"}
    ]

    unpaired = [{"prompt": [user("Sky?")], "completion": [assistant("Blue")], "label": True}]
    assert conversational_to_text(unpaired, tok) == [
        {"prompt": prompt, "completion": "Blue<|im_end|>\n", "label": True}
    ]

    ranked = [CONVERSATIONAL["ranked"][0]]
    out = conversational_to_text(ranked, tok)
    assert out[0]["responses"] == ["blue<|im_end|>\n", "green<|im_end|>\n"] and out[0][
        "scores"
    ] == [2.0, 1.0]

    implicit = [
        {"chosen": [user("Sky?"), assistant("Blue")], "rejected": [user("Sky?"), assistant("Red")]}
    ]
    assert conversational_to_text(implicit, tok)[0]["rejected"] == (
        "<|im_start|>user\nSky?<|im_end|>\n<|im_start|>assistant\nRed<|im_end|>\n"
    )

    standard = [{"prompt": "p", "completion": "c"}]
    assert conversational_to_text(standard, tok) is standard


def test_conversational_to_text_refuses_a_non_prefix_template():
    counting = (
        "{{ messages | length }}:" + CHATML
    )  # the prompt's rendering starts "1:", the conversation's "2:"
    data = [{"prompt": [user("Sky?")], "completion": [assistant("Blue")]}]
    with pytest.raises(
        FormatError, match="row 0, column 'completion'.*does not start with the prompt"
    ):
        conversational_to_text(data, make_tokenizer(counting))
