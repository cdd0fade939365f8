"""Learning shown with tool environments: the demo's tools stage (a short SFT on tool-call traces, then
GRPO with the environment) raises held-out accuracy on the calculator task and the held-out reward of
guess-the-number, and the calculator task is not solved when the tool's results are withheld."""

from transformers import set_seed

from posttrain import demo

# Held-out figures before -> after GRPO (200 sampled episodes each: standard error about 0.035), measured
# with this code for seeds 0-3 (README.md). Calculator: 0.39 -> 0.495, 0.24 -> 0.51, 0.30 -> 0.54,
# 0.355 -> 0.515; with the results withheld 0.0 on every seed. Guess-the-number: 0.215 -> 0.275,
# 0.24 -> 0.395, 0.265 -> 0.365, 0.29 -> 0.345: every seed rises, seeds 0 and 3 by less than twice the
# standard error, so that test runs seed 1. The margins are about twice the standard error.
CALCULATOR_MARGIN = 0.07
GUESS_NUMBER_MARGIN = 0.07
GUESS_NUMBER_SEED = 1


def test_grpo_with_a_calculator_raises_held_out_accuracy(tmp_path, one_thread):
    plan = demo.DemoPlan(output_dir=str(tmp_path), seed=0)
    set_seed(0)
    (metric, before, after), without_tool, episode = demo.run_calculator(plan)
    assert metric == "held-out accuracy"
    assert after > before + CALCULATOR_MARGIN, (before, after)
    # the same SFT model, the same held-out pairs, the tool answering "unavailable": products are not guessed
    assert without_tool < 0.05 < before, (without_tool, before)
    assert episode[0]["content"].startswith("What is ")
    assert episode[1]["tool_calls"][0]["function"]["name"] == "calculate"
    assert (tmp_path / "calculator" / "log_history.json").exists()


def test_grpo_with_an_environment_raises_the_held_out_reward(tmp_path, one_thread):
    plan = demo.DemoPlan(output_dir=str(tmp_path), seed=GUESS_NUMBER_SEED)
    set_seed(GUESS_NUMBER_SEED)
    (metric, before, after), episode = demo.run_guess_number(plan)
    assert metric == "held-out reward"
    assert after > before + GUESS_NUMBER_MARGIN, (before, after)
    assert episode[0] == {"role": "user", "content": "Find my number from 1 to 4."} and len(episode) > 1
    assert (tmp_path / "guess_number" / "log_history.json").exists()
