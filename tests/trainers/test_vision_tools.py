"""Tool turns that return images, in GRPO on the tiny VLM from TRL-style code: an environment whose `zoom` tool
returns a piece of the row's image (`reset(**row)` receives the `images` column). The rollouts are scripted to call
the tool (`ScriptedEpisodes`); the rest is the trainer's path: the tool's image is fed with its features, the
training forward gets every image of a row (the prompt's, then the tool's), the tool turns stay out of the loss,
and a run killed with SIGKILL resumes bit-identically."""

import os

import pytest
import torch
from tests.helpers.online import online_args
from tests.helpers.resume import assert_same_run, killed_at_save, logged_numbers, run_fields, trained_state

from posttrain.data.tools import environment_tools, tool_schemas
from posttrain.forward.vision import PIXELS
from posttrain.rollout.multiturn import Episodes
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

VLM = "posttrain/tiny-llava"


class ZoomEnv:
    """Zooms into the row's image: `reset(**row)` keeps it, `zoom` returns its centre, enlarged, as an image."""

    def reset(self, images=None, **row):
        self.image = images[0]
        self.zooms = 0

    def zoom(self):
        """Zoom into the centre of the picture."""
        self.zooms += 1
        w, h = self.image.size
        return [{"type": "image", "image": self.image.crop((w // 4, h // 4, 3 * w // 4, 3 * h // 4)).resize((w, h))},
                {"type": "text", "text": "zoomed"}]


def image_prompts(n: int = 4):
    from posttrain.tasks.vision import vision_dataset

    return vision_dataset("train", size=n, kinds=("color",)).remove_columns("completion")


def zooms_reward(completion_ids, environments, **kwargs):
    """The zooms each episode took, and its first token id / 1024: rewards that differ within a group."""
    return [env.zooms + ids[0] / 1024 for env, ids in zip(environments, completion_ids)]


class ScriptedEpisodes(Episodes):
    """Episodes whose rows' first turn calls `zoom`: the random tiny VLM cannot write a tool call (fitting one
    to is slow and brittle), so each row's first turn is read as the call, ended by EOS, and everything after it
    is real: the environment's tool runs, its image is rendered, expanded, fed and trained on."""

    def __call__(self, rows, tokens):
        eos = self.tokenizer.eos_token_id
        return super().__call__(rows, [t if self.iterations[i] else t[:-1] + [eos] for i, t in zip(rows, tokens)])

    def read_turn(self, i, text):
        if self.iterations[i]:
            return super().read_turn(i, text)
        call = {"type": "function", "function": {"name": "zoom", "arguments": {}}}
        return {"role": "assistant", "content": text, "tool_calls": [call]}, [call], []


def scripted(trainer):
    """`trainer` with its rollouts' episodes scripted (`ScriptedEpisodes`) and every sampled token ending a turn."""
    import dataclasses

    made = trainer.tooling.episodes

    def episodes(*args, **kwargs):
        out = made(*args, **kwargs)
        out[0].__class__ = ScriptedEpisodes
        return out

    trainer.tooling.episodes = episodes
    every_token = tuple(range(len(trainer.processing_class.tokenizer)))
    trainer.sampling = dataclasses.replace(trainer.sampling, stop_token_ids=every_token)
    return trainer


def grpo(model=VLM, **fields):
    """GRPO on the tiny VLM (or `model`) with the zoom environment, scripted to call it: 2 completions per prompt,
    room for the 1-token call, the tool turn (34 tokens on the tiny LLaVA) and a 1-token answer."""
    overrides = {key: fields.pop(key) for key in list(fields) if key not in run_fields("", 0, 1)}
    small = online_args(fields["output_dir"], num_generations=2, per_device_train_batch_size=2,
                        gradient_accumulation_steps=1, max_completion_length=40, max_tool_calling_iterations=1, beta=0.1)
    args = GRPOConfig(**{**small, **overrides, **fields})
    return scripted(GRPOTrainer(model, zooms_reward, args=args, train_dataset=image_prompts(),
                                environment_factory=ZoomEnv))


def test_grpo_feeds_tool_images_trains_and_resumes_after_sigkill(tmp_path):
    full = grpo(**run_fields(tmp_path / "full", 2, 1))
    before = {n: p.detach().clone() for n, p in full.model.named_parameters()}
    full.train()
    logged = {k: v for entry in full.state.log_history for k, v in entry.items()}
    assert logged["tools/calls_per_completion"] > 0 and logged["tools/failure_rate"] == 0
    moved = {n for n, p in full.model.named_parameters() if not torch.equal(p, before[n])}
    assert any("language_model" in n for n in moved) and any("vision_tower" in n for n in moved)
    # the generation batch's rows called the tool: each holds two images (the prompt's, the zoom)
    assert torch.cat([mb[PIXELS + "pixel_values.count"] for mb in full.experience]).tolist() == [2, 2]
    expected_state, expected_logs = trained_state(full), logged_numbers(full, 1)
    del full
    killed_at_save(tmp_path, os.path.dirname(__file__), "from test_vision_tools import grpo",
                   "grpo(**run_fields(output_dir, 2, 1))", step=1)
    resumed = grpo(**run_fields(tmp_path / "killed", 2, 1))
    resumed.train(resume_from_checkpoint=True)
    assert_same_run(resumed, expected_state, expected_logs, max_steps=2, stop_at=1)


def test_grpo_feeds_tool_images_on_idefics3(tmp_path, one_thread):
    """The second architecture, Idefics3 (its tool turn marked with <fake_token_around_image><global-img>): each row
    holds the prompt's and the zoom's images, and one step trains the language model and the tower. (Images split
    into different numbers of crops: tests/rollout/test_tool_images.py.)"""
    from tests.helpers.vision import tiny_idefics3

    trainer = grpo(tiny_idefics3(tmp_path / "idefics3"), output_dir=str(tmp_path / "run"), max_steps=1)
    assert type(trainer.policy).__name__ == "Idefics3ForConditionalGeneration"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logged = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert logged["tools/calls_per_completion"] == 1 and logged["tools/failure_rate"] == 0
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert any("text_model" in n for n in moved) and any("vision_model" in n for n in moved)
    pixels = torch.cat([mb[PIXELS + "pixel_values"] for mb in trainer.experience])
    assert pixels.shape[:3] == (2, 2, 1)  # per row: the prompt's and the zoom's images, (1, 3, 32, 32) each
    assert torch.cat([mb[PIXELS + "pixel_values.count"] for mb in trainer.experience]).tolist() == [2, 2]


def test_the_image_tool_task_hides_the_picture_behind_the_tool(tmp_path, one_thread):
    """vision_tool_dataset's prompts hold no image; ShowImageEnv's tool returns the row's picture (or "unavailable");
    the SFT traces put that picture in the tool message, and only the answer and the call are trained on."""
    from posttrain.data.collate import IGNORE_INDEX
    from posttrain.tasks.vision import (ShowImageEnv, vision_dataset, vision_tool_dataset, vision_tool_reward,
                                        vision_tool_traces)
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    rows, plain = vision_tool_dataset("test", 4), vision_dataset("test", 4, kinds=("color",))
    assert "images" not in rows.column_names and isinstance(rows[0]["prompt"][0]["content"], str)
    assert [r["answer"] for r in rows] == [r["answer"] for r in plain]  # the same pictures as the visual task's
    env = ShowImageEnv()
    env.reset(**rows[0])
    assert env.show_image()["image"].tobytes() == plain[0]["images"][0].tobytes() and env.calls == 1
    assert ShowImageEnv(show_results=False).show_image() == "unavailable"
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "show_image"}}]}
    said = [[call, {"role": "tool", "content": [{"type": "image"}]}, {"role": "assistant", "content": a}]
            for a in ("Red.", "blue")]
    assert vision_tool_reward(said, ["red", "red"]) == [1.0, 0.0]
    traces = vision_tool_traces("test", 4)
    sft = SFTTrainer(VLM, train_dataset=traces, args=SFTConfig(output_dir=str(tmp_path), max_steps=1,
                                                               assistant_only_loss=True, report_to="none"))
    batch = sft.data_collator([sft.train_dataset[0]])
    tok = sft.processing_class.tokenizer
    image = batch["input_ids"][0] == tok.convert_tokens_to_ids("<image>")
    assert int(image.sum()) == 16 and batch["model_inputs"]["pixel_values"].shape == (1, 3, 32, 32)
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    target = tok.decode([t for t, y in zip(ids, labels) if y != IGNORE_INDEX])
    call_text = '<tool_call>{"name": "show_image", "arguments": {}}</tool_call><|im_end|>'
    assert target == f'{call_text}{rows[0]["answer"]}<|im_end|>'
