"""TRL's reward functions (posttrain.tasks.rewards) on worked examples, the math-answer reader, and a GRPO run
that takes them as reward_funcs."""

import math
import pickle

import pytest

from posttrain import (accuracy_reward, get_cosine_scaled_reward, get_repetition_penalty_reward,
                       get_soft_overlong_punishment, reasoning_accuracy_reward, think_format_reward)
from posttrain.tasks.math_answers import answers_equal, extract_answer, parse_answer


def msg(text):
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize("gold, written, equal", [
    (r"\frac{1}{3}", r"\frac{1}{3}", True), (r"\frac{1}{3}", r"\frac{1}{2}", False), ("0.5", r"\frac12", True),
    ("1000", "1,000", True), (r"2\sqrt{2}", r"\sqrt{8}", True), (r"\sqrt[3]{27}", "3", True),
    ("x^2+2x+1", "(x+1)^2", True), ("(1, 2)", "(1,2)", True), ("(1, 2)", "(2,1)", False),
    (r"5 \text{ cm}", "5", True), (r"90^\circ", "90", True), ("x = 4", "4", True),
    (r"\pi/2", r"\dfrac{\pi}{2}", True), ("0.75", r"\tfrac{3}{4}", True), (r"50\%", "50", True),
    (r"\ln 8", r"3\ln 2", True), ("-3", "3", False),
])
def test_answers_compared_as_math(gold, written, equal):
    assert answers_equal(parse_answer(gold), parse_answer(written)) is equal


def test_answer_extraction_and_unreadable_answers():
    assert extract_answer(r"first \boxed{1} then \boxed{\frac{2}{3}} done") == r"\frac{2}{3}"  # the last box
    assert extract_answer(r"so $x = 2$ and finally \(7\).") == "7"
    assert extract_answer("The answer is 42") is None  # no box or math span: nothing is read
    assert extract_answer("42", anchored=False) == "42"  # a gold solution may be bare
    assert parse_answer(r"\begin{pmatrix}1\end{pmatrix}") is None
    assert parse_answer('__import__("os").system("x")') is None  # never evaluated
    assert parse_answer("exit()") is None


def test_accuracy_reward_trl_example():
    solutions = [r"\frac{1}{3}", r"\frac{1}{3}", r"\begin{pmatrix}1\end{pmatrix}", "4"]
    completions = [msg(r"My answer is \boxed{\frac{1}{3}}"), msg(r"My answer is \boxed{\frac{1}{2}}"),
                   msg(r"\boxed{1}"), "The answer is $2+2$."]  # a plain-string completion reads the same
    logged = {}
    rewards = accuracy_reward(completions, solutions, log_extra=lambda k, v: logged.__setitem__(k, v))
    assert rewards == [1.0, 0.0, None, 1.0]  # None: the gold cannot be read, the example is skipped
    assert logged["solution"] == solutions
    assert logged["gold_parsed"][2] == "[unparseable]" and logged["answer_parsed"][2] == "[skipped]"
    assert logged["answer_parsed"][1] == "[1/2]"
    with pytest.raises(ValueError, match="2 completions but 1 solutions"):
        accuracy_reward(completions[:2], solutions[:1])


def test_reasoning_accuracy_reward_trl_example():
    solutions = [r"\frac{1}{3}"] * 4
    completions = [msg(r"<think> Reasoning content </think> The final answer is \boxed{\frac{1}{3}}"),
                   msg(r"<think> Reasoning content </think> The final answer is \boxed{\frac{1}{2}}"),
                   msg(r"<think> Reasoning with partial answers \boxed{\frac{1}{3}} but no final answer"),
                   msg(r"<think> \boxed{\frac{1}{3}} </think> so the answer is \boxed{\frac{1}{2}}")]
    assert reasoning_accuracy_reward(completions, solutions) == [1.0, 0.0, 0.0, 0.0]
    assert reasoning_accuracy_reward([msg(r"a [END] \boxed{\frac13}")], solutions[:1],
                                     reasoning_delimiters=["[END]"]) == [1.0]


def test_think_format_reward():
    completions = [msg("<think>\nThis is my reasoning.\n</think>\nThis is my answer."),
                   msg("<think>\nThis is my reasoning.\nThis is my answer."),
                   msg("<think>a</think><think>b</think>"), msg("Answer first <think>x</think>"),
                   "<think></think>ok"]
    assert think_format_reward(completions) == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_cosine_scaled_reward_by_hand():
    reward = get_cosine_scaled_reward(max_len=100)
    completions = [msg(r"\boxed{\frac{1}{3}}"), msg(r"\boxed{\frac{1}{2}}")] * 3
    solution = [r"\frac{1}{3}"] * 6
    ids = [[1] * 50, [1] * 50, [1] * 0, [1] * 0, [1] * 150, [1] * 150]
    # L = 50: cos(pi/2) = 0 -> midpoints 0.75 and -0.75; L = 0: the short ends (1.0 correct, -1.0 wrong);
    # L >= max_len: the long ends (0.5 correct, -0.5 wrong)
    assert reward(completions, solution, ids) == pytest.approx([0.75, -0.75, 1.0, -1.0, 0.5, -0.5])
    quarter = reward(completions[:1], solution[:1], [[1] * 25])[0]
    assert quarter == pytest.approx(0.5 + 0.25 * (1 + math.cos(math.pi / 4)))
    assert reward([msg("x")], [r"\begin{pmatrix}1\end{pmatrix}"], [[1]]) == [None]
    assert reward.__name__ == "cosine_scaled_reward"
    with pytest.raises(ValueError, match="max_len"):
        get_cosine_scaled_reward(max_len=0)


def test_repetition_penalty_by_hand():
    penalty = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    # [5]*5: bigrams (5,5) x4, one unique -> (1 - 1/4) * -1; [1,2,1,2]: (1,2),(2,1),(1,2) -> (1 - 2/3) * -1
    assert penalty([[1, 2, 3, 4], [5, 5, 5, 5, 5], [1, 2, 1, 2], [7]]) == pytest.approx([0.0, -0.75, -1 / 3, 0.0])
    assert get_repetition_penalty_reward(3, -0.5)([[1, 1, 1, 1]]) == pytest.approx([-0.25])  # (1 - 1/2) * -0.5
    with pytest.raises(ValueError, match="ngram_size"):
        get_repetition_penalty_reward(ngram_size=0)
    with pytest.raises(ValueError, match="should not be positive"):
        get_repetition_penalty_reward(max_penalty=0.5)


def test_soft_overlong_punishment_by_hand():
    punish = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert punish([[1] * 80, [1] * 90, [1] * 100, [1] * 101, [1] * 10]) == [0.0, -0.5, -1.0, -1.0, 0.0]
    assert get_soft_overlong_punishment(10, 0)([[1] * 10, [1] * 11]) == [0.0, -1.0]
    assert pickle.loads(pickle.dumps(punish))([[1] * 95]) == [-0.75]  # picklable, as TRL's are
    with pytest.raises(ValueError, match="soft_punish_cache"):
        get_soft_overlong_punishment(10, 11)


def test_rewards_as_grpo_reward_funcs(tmp_path):
    """posttrain's GRPO calls them with its completions, completion_ids, the dataset's `solution` column and
    its log_extra hook; each function's mean reaches the logs."""
    from datasets import Dataset

    from posttrain import GRPOConfig, GRPOTrainer

    extra = {}

    def accuracy(completions, solution, log_extra=None, **kwargs):  # accuracy_reward, recording what it logs
        assert log_extra is not None and "completion_ids" in kwargs
        return accuracy_reward(completions, solution, log_extra=lambda k, v: (extra.__setitem__(k, v),
                                                                                log_extra(k, v)), **kwargs)

    data = Dataset.from_dict({"prompt": ["What is 1+1?", "What is 2+2?"] * 2, "solution": ["2", "4"] * 2})
    funcs = [accuracy, think_format_reward, get_soft_overlong_punishment(8, 4), get_repetition_penalty_reward(2)]
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_steps=1,
                      max_completion_length=8, logging_steps=1, report_to=[], disable_tqdm=True,
                      log_completions=True)
    trainer = GRPOTrainer("posttrain/tiny-qwen2", funcs, args=args, train_dataset=data)
    trainer.train()
    logs = trainer.state.log_history[0]
    for name in ("accuracy", "think_format_reward", "soft_overlong_punishment_reward", "repetition_penalty_reward"):
        assert math.isfinite(logs[f"rewards/{name}/mean"])
    # 8-token completions with a 4-token cache: at least -0.75 each (-1 past 8 tokens)
    assert -1.0 <= logs["rewards/soft_overlong_punishment_reward/mean"] <= 0
    # one prompt's 4 completions, each with that prompt's solution
    assert extra["solution"] in (["2"] * 4, ["4"] * 4) and len(extra["answer_parsed"]) == 4
    import json
    import os

    with open(os.path.join(tmp_path, "completions.jsonl")) as f:  # the logged columns reach the table
        rows = [json.loads(line) for line in f]
    assert [r["solution"] for r in rows] == extra["solution"] and "gold_parsed" in rows[0]


def test_trl_reward_names_resolve():
    """The names TRL's grpo.py script takes in --reward_funcs name the same functions here."""
    from posttrain.rollout.rewards import resolve_reward_func

    assert resolve_reward_func("accuracy_reward") is accuracy_reward
    assert resolve_reward_func("reasoning_accuracy_reward") is reasoning_accuracy_reward
    assert resolve_reward_func("think_format_reward") is think_format_reward
    punish = resolve_reward_func("get_soft_overlong_punishment")  # TRL's script settings: 1280 tokens, 256 cache
    assert punish([[1] * 1024, [1] * 1152, [1] * 1281]) == [0.0, -0.5, -1.0]
