"""GRPO and RLOO on a vision-language model, from TRL-style code: prompt-only rows with an `images` column.

Every trainable parameter moves (the vision tower's included), the reward functions receive the images
(TRL's `images` keyword), the vision tower encodes each prompt's images once per group (in the sampler and
in the training forward), resuming is bit-identical after a stop and after SIGKILL, and bad input is
refused with the row named."""

import os

import pytest
import torch
from tests.helpers.online import ONLINE_METRICS, online_args, train_and_check
from tests.helpers.resume import (assert_resumes_identically, assert_same_run, killed_at_save, logged_numbers,
                                  run_fields, trained_state)

from tests.trainers.test_vision import idefics3  # noqa: F401 (the second architecture, a fixture)

from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

VLM = "posttrain/tiny-llava"


def image_prompts(n: int = 8, split: str = "train"):
    from posttrain.tasks.vision import vision_dataset

    return vision_dataset(split, size=n).remove_columns("completion")


SEEN = {}  # what the reward function was given last


def image_reward(completion_ids, images=None, **kwargs):
    """A reward that varies between samples of a random tiny model; it keeps the images it was given."""
    SEEN["images"] = images
    return [float(ids[0] % 5) if ids else 0.0 for ids in completion_ids]


def grpo(n_prompts: int = 8, **fields):
    """GRPO on the tiny VLM, 4 completions per prompt, 2 prompts per optimizer step, a KL term."""
    overrides = {key: fields.pop(key) for key in list(fields) if key not in run_fields("", 0, 1)}
    args = GRPOConfig(**{**online_args(fields["output_dir"], num_generations=4, beta=0.1), **overrides, **fields})
    return GRPOTrainer(VLM, image_reward, args=args, train_dataset=image_prompts(n_prompts))


def freeze_unread(trainer) -> list[str]:
    """Stop training the parameters no forward reads, and return their names: LLaVA takes the vision tower's
    hidden states, not its pooled output, so the tower's `post_layernorm` gets no gradient from any loss."""
    from posttrain.rollout.images import encode_image_prompts

    policy = trainer.policy
    ids, vision = encode_image_prompts(trainer.processing_class, [image_prompts(1)[0]])
    policy(input_ids=torch.tensor(ids), **vision[0]).logits.sum().backward()
    unread = [n for n, p in policy.named_parameters() if p.grad is None]
    for n, p in policy.named_parameters():
        p.grad = None
        if n in unread:
            p.requires_grad_(False)
    return unread


class TowerImages:
    """The number of images each forward of `model`'s vision tower encoded."""

    def __init__(self, model):
        self.images = []

        def count(module, args, kwargs, output):
            self.images.append(len(args[0] if args else kwargs["pixel_values"]))

        self.handle = model.model.vision_tower.register_forward_hook(count, with_kwargs=True)


def test_grpo_trains_every_parameter_and_rewards_see_the_images(tmp_path):
    from PIL import Image

    trainer = grpo(output_dir=str(tmp_path), max_steps=2)
    assert freeze_unread(trainer) == ["model.vision_tower.post_layernorm.weight", "model.vision_tower.post_layernorm.bias"]
    tower = TowerImages(trainer.policy)
    train_and_check(trainer, reward_names=("image_reward",))
    images = SEEN["images"]
    assert len(images) == 8 and all(isinstance(row, list) and isinstance(row[0], Image.Image) for row in images)
    assert images[0] is images[3]  # a group's completions share their prompt's images
    # per step: the sampler encodes the 2 prompts' images once each (not once per completion: 8), then the
    # training forward each micro-batch of 4 completions of one prompt: 1 image, not 4 (the reference is a copy)
    assert tower.images == [2, 1, 1] * 2


def test_rloo_trains_every_parameter_of_a_vlm(tmp_path):
    args = RLOOConfig(**online_args(tmp_path, num_generations=4, beta=0.05, max_steps=2))
    trainer = RLOOTrainer(VLM, image_reward, args=args, train_dataset=image_prompts(8))
    freeze_unread(trainer)
    train_and_check(trainer, reward_names=("image_reward",))


def test_vlm_evaluate_samples_with_the_images(tmp_path):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, beta=0.0, max_steps=1))
    trainer = GRPOTrainer(VLM, image_reward, args=args, train_dataset=image_prompts(8),
                          eval_dataset=image_prompts(4, "test"))
    metrics = trainer.evaluate()
    assert len(SEEN["images"]) == 4 and all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


def test_vlm_grpo_resumes_identically(tmp_path):
    # 8 prompts = 4 steps an epoch: stopped after step 1, resumed from checkpoint-1
    assert_resumes_identically(lambda **f: grpo(8, **f), tmp_path, max_steps=3, stop_at=1)


def test_vlm_grpo_resumes_inside_a_generation_batch(tmp_path):
    # 2 optimizer steps per generation batch: the checkpoint keeps the micro-batches not yet trained on, images and all
    assert_resumes_identically(lambda **f: grpo(8, steps_per_generation=4, **f), tmp_path, max_steps=3, stop_at=1)


def test_vlm_grpo_resumes_after_sigkill(tmp_path):
    full = grpo(**run_fields(tmp_path / "full", 3, 2))
    full.train()
    expected_state, expected_logs = trained_state(full), logged_numbers(full, 2)
    del full
    killed_at_save(tmp_path, os.path.dirname(__file__), "from test_online_vision import grpo",
                   "grpo(**run_fields(output_dir, 3, 2))")
    resumed = grpo(**run_fields(tmp_path / "killed", 3, 2))
    resumed.train(resume_from_checkpoint=True)
    assert_same_run(resumed, expected_state, expected_logs, max_steps=3, stop_at=2)


def test_text_only_model_refuses_an_image_dataset(tmp_path):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4))
    with pytest.raises(ValueError, match="text-only model"):
        GRPOTrainer("posttrain/tiny-qwen2", image_reward, args=args, train_dataset=image_prompts(8))


def test_placeholders_that_do_not_match_the_images_name_the_row(tmp_path):
    data = image_prompts(8)
    rows = [data[i] for i in range(8)]
    rows[5]["images"] = rows[5]["images"] * 2  # two images, one placeholder
    from datasets import Dataset

    args = GRPOConfig(**online_args(tmp_path, num_generations=4))
    with pytest.raises(ValueError, match=r"row 5.*1 image placeholder\(s\).*2 image\(s\)"):
        GRPOTrainer(VLM, image_reward, args=args, train_dataset=Dataset.from_list(rows))


def test_image_prompt_longer_than_max_prompt_length_is_refused(tmp_path):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_prompt_length=8, max_steps=1))
    trainer = GRPOTrainer(VLM, image_reward, args=args, train_dataset=image_prompts(8))
    with pytest.raises(ValueError, match="max_prompt_length=8.*not cut"):
        trainer.train()


@pytest.mark.parametrize("command", ["grpo", "rloo"])
def test_cli_trains_the_tiny_vlm_on_the_visual_task(tmp_path, command):
    from posttrain.cli import run

    trainer = run([command, "--model_name_or_path", VLM, "--dataset_name", "vision", "--reward_funcs", "exact_match",
                   "--output_dir", str(tmp_path), "--max_steps", "1", "--per_device_train_batch_size", "4",
                   "--gradient_accumulation_steps", "1", "--num_generations", "4", "--max_completion_length", "4",
                   "--report_to", "none", "--disable_tqdm", "true"])
    assert trainer.state.global_step == 1 and trainer.vision
    assert (tmp_path / "processor_config.json").exists()  # the processor is saved with the model


def test_a_second_architecture_idefics3_trains_with_grpo(tmp_path, idefics3):
    from posttrain.forward.completions import completion_logprobs

    args = GRPOConfig(**online_args(tmp_path, num_generations=4, beta=0.1))
    trainer = GRPOTrainer(idefics3, image_reward, args=args, train_dataset=image_prompts(8))
    assert type(trainer.policy).__name__ == "Idefics3ForConditionalGeneration"
    batch = trainer._collate([trainer.train_dataset[i] for i in range(2)])
    assert batch["vision"][0]["pixel_values"].dim() == 5  # Idefics3's (1, images, 3, H, W) per prompt
    rollout = trainer.sample_completions(batch["prompt_ids"], vision=batch["vision"])
    with torch.no_grad():  # the sampler decoded from the image tokens the training forward sees
        logp, _ = completion_logprobs(trainer.policy, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                      rollout.completion_mask, vision=rollout.vision)
    mask = rollout.completion_mask.bool()
    torch.testing.assert_close(logp[mask], rollout.logprobs[mask], atol=1e-5, rtol=1e-5)
    freeze_unread(trainer)
    train_and_check(trainer, reward_names=("image_reward",))


def test_grpo_on_a_streamed_image_dataset(tmp_path):
    # TRL's GRPO takes an IterableDataset; the images travel with the streamed rows to the sampler and the rewards
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, beta=0.0, max_steps=2))
    trainer = GRPOTrainer(VLM, image_reward, args=args, train_dataset=image_prompts(8).to_iterable_dataset())
    before = trainer.policy.get_output_embeddings().weight.detach().clone()
    trainer.train()
    assert trainer.state.global_step == 2 and len(SEEN["images"]) == 8
    assert not torch.equal(before, trainer.policy.get_output_embeddings().weight)
