"""Built-in datasets and the verifiable tasks' checker and rewards."""

import pytest

from posttrain.data.formats import detect_format, validate
from posttrain.tasks import builtin


@pytest.mark.parametrize("layout", builtin.ZEN_LAYOUTS)
@pytest.mark.parametrize("conversational", [False, True])
def test_zen_layouts_are_valid_and_detected(layout, conversational):
    ds = builtin.zen(layout, conversational=conversational)
    assert len(ds) == 19
    info = validate(ds)
    assert info.name == layout and info.conversational == conversational


def test_zen_preference_rows_differ():
    ds = builtin.zen("preference")
    # "Beautiful is better than ugly." has 5 words: cut after 2
    assert ds[0]["prompt"] == "Beautiful is"
    assert ds[0]["chosen"] == " better than ugly."
    assert all(r["chosen"] != r["rejected"] for r in ds)


def test_task_splits_are_disjoint_deterministic_and_correct():
    train = builtin.task_dataset("reverse", "train", size=500)
    test = builtin.task_dataset("reverse", "test")
    assert len(train) == 500 and len(test) == 200
    assert not set(train["prompt"]) & set(test["prompt"])
    assert builtin.task_dataset("reverse", "test")["prompt"] == test["prompt"]
    row = train[0]
    digits = row["prompt"].split()[1]
    assert row["answer"] == digits[::-1] and row["completion"] == " " + row["answer"]
    add = builtin.task_dataset("add", "test", size=50)
    for r in add:
        _, a, b, _ = r["prompt"].split()
        assert int(r["answer"]) == int(a) + int(b)
    assert detect_format(builtin.task_dataset("reverse", "test", conversational=True)).conversational


def test_checker_and_rewards_by_hand():
    assert builtin.check(" 1274", "1274") and not builtin.check("1274 5", "1274")
    assert builtin.check([{"role": "assistant", "content": "1274"}], "1274")
    assert builtin.exact_match_reward([" 1274", "1247"], answer=["1274", "1274"]) == [1.0, 0.0]
    # "1247" vs "1274": 2 of 4 positions -> 0.8 * 2/4 = 0.4; "12745": 4/4 hits, 1 extra -> 0.8 - 0.1 = 0.7
    assert builtin.digit_match_reward(["1247", "12745", "1274"], answer=["1274"] * 3) == pytest.approx([0.4, 0.7, 1.0])


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown task"):
        builtin.task_dataset("sort")
    with pytest.raises(KeyError):
        builtin.load_builtin("nope")
    assert len(builtin.load_builtin("zen/preference")) == 19


def test_final_answer_reward_by_hand():
    from posttrain.tasks.builtin import TASK_CHECKERS, final_answer_reward

    completions = ["12", "The answer is 12.", "3 + 9 = 12", " 12 ", "I do not know", "To add 3 and 9,",
                   [{"role": "assistant", "content": "9 + 3 = 12"}], "120", "12 or 13"]
    expected = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert final_answer_reward(completions, ["12"] * 9) == expected
    assert TASK_CHECKERS["quick-add"]("4 + 4 = 8", "8") and not TASK_CHECKERS["quick-add"]("8 + 4 =", "8")
