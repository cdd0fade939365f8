"""Learning with a tool that returns an image (slow): the colour question comes without its picture, and only the
environment's `show_image` tool shows it (`posttrain.tasks.vision.ShowImageEnv`). The tiny LLaVA is fine-tuned on
tool-call traces (the call, the tool's image, the answer), then trained with GRPO using the tool; on held-out pictures
it answers far better than chance when it sees the tool's image, and not at all when the tool's result is withheld.

Measured with this recipe (100 held-out pictures, one episode each at temperature 0.7), results withheld / SFT /
GRPO: 0.00 / 0.61 / 0.74 (seed 0, one thread; docs/vision.md). The colour is learned late in SFT: 80 steps gave 0.28,
100 gave 0.48-0.50, 120 gave 0.77. GRPO's lift is not steady at this size: 20 steps at lr 3e-4 gave 0.63 -> 0.63 in
another run, and lr 1e-3 lowered it (0.50 -> 0.24), so the test asserts the tool's use, not GRPO's lift."""

import functools

import pytest
from transformers import set_seed

from posttrain import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from posttrain.tasks.vision import ShowImageEnv, vision_tool_dataset, vision_tool_reward, vision_tool_traces

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

RECIPE = dict(sft_steps=110, sft_lr=4e-3, rl_steps=10, rl_lr=3e-4, temperature=0.7, eval_size=100)
CHANCE = 0.25  # four colours, balanced


def test_sft_then_grpo_with_an_image_tool_beats_the_tool_withheld_baseline(tmp_path):
    cfg, common = RECIPE, dict(seed=0, save_strategy="no", report_to="none", disable_tqdm=True,
                               lr_scheduler_type="constant")
    set_seed(0)
    sft = SFTTrainer("posttrain/tiny-llava", train_dataset=vision_tool_traces("train", 400),
                     args=SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=cfg["sft_steps"],
                                    learning_rate=cfg["sft_lr"], per_device_train_batch_size=16,
                                    assistant_only_loss=True, logging_steps=10, **common))
    sft.train()
    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), max_steps=cfg["rl_steps"], learning_rate=cfg["rl_lr"],
                      per_device_train_batch_size=16, num_generations=4, max_completion_length=96, beta=0.0,
                      temperature=cfg["temperature"], max_tool_calling_iterations=2, num_generations_eval=1,
                      per_device_eval_batch_size=cfg["eval_size"], logging_steps=5, **common)
    test = vision_tool_dataset("test", cfg["eval_size"])

    def trainer(model, show_results: bool = True):
        return GRPOTrainer(model=model, processing_class=sft.processing_class, args=args,
                           reward_funcs=vision_tool_reward, train_dataset=vision_tool_dataset("train", 400),
                           environment_factory=functools.partial(ShowImageEnv, show_results=show_results))

    rl = trainer(sft.model)
    before = rl.evaluate(test)
    rl.train()
    after = rl.evaluate(test)
    withheld = trainer(rl.model, show_results=False).evaluate(test)  # the same model, the picture not shown
    print({"withheld": withheld["eval_reward"], "sft": before["eval_reward"], "grpo": after["eval_reward"]})
    logged = [entry for entry in rl.state.log_history if "tools/calls_per_completion" in entry]
    assert logged and all(entry["tools/calls_per_completion"] > 0.9 for entry in logged)  # sampled at temperature
    assert after["eval_tools/calls_per_completion"] > 0.95  # (nearly) every held-out episode looked at its picture
    assert before["eval_reward"] > CHANCE + 0.2 and after["eval_reward"] > CHANCE + 0.2, (before, after)
    # without the tool's image the colour is not known (the model calls the tool again rather than guess)
    assert withheld["eval_reward"] < CHANCE, withheld
