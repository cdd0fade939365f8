"""Vision-language models: the built-in tiny VLM, SFT / DPO / KTO / Reward runs that train every parameter,
image tokens never in the loss, completion-only and assistant-only masks, the reference seeing the same
pixels, freezing parts, LoRA on the language model only, a second architecture, and clear refusals."""

import pytest
import torch
from datasets import Dataset
from tests.helpers.vision import tiny_idefics3

from posttrain.data.collate import IGNORE_INDEX
from posttrain.data.multimodal import VisionDataError
from posttrain.models import loading
from posttrain.tasks.vision import vision_dataset, vision_preference_dataset
from posttrain.trainers.dpo import DPOConfig, DPOTrainer
from posttrain.trainers.kto import KTOConfig, KTOTrainer
from posttrain.trainers.sft import SFTConfig, SFTTrainer

VLM = "posttrain/tiny-llava"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def fields(tmp_path, **kw):
    return {**dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                   logging_steps=1, disable_tqdm=True, seed=0, report_to="none", dataloader_pin_memory=False), **kw}


# LLaVA reads its vision tower's last hidden states before the tower's final layer norm (vision_feature_layer=-1), so
# that norm takes no part in the forward and gets no gradient: the one trainable part that cannot change
UNUSED = ("vision_tower.post_layernorm.",)


def changed(before: dict, model) -> list[str]:
    """Names of the trainable parameters (those the forward uses) that did NOT change."""
    return [n for n, p in model.named_parameters()
            if p.requires_grad and not any(u in n for u in UNUSED) and torch.equal(before[n], p.detach())]


def snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def processor():
    return loading.load_processor(None, VLM)


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory) -> str:
    """Folder of a second architecture built from a config: a tiny Idefics3 (SmolVLM's family: SigLIP-style
    tower, pixel-shuffle connector, Llama), whose processor surrounds each image's tokens with marker tokens
    (<fake_token_around_image><global-img>...) that the chat template never wrote."""
    return tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


# ------------------------------------------------------------------ the tiny VLM


def test_the_tiny_vlm_loads_offline_with_a_processor_that_needs_no_torchvision(processor):
    model = loading.load_vision_lm(VLM)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert model.config._name_or_path == VLM
    assert type(processor).__name__ == "LlavaProcessor"
    assert type(processor.image_processor).__name__.endswith("Pil")  # the PIL backend
    row = vision_dataset("test", 1)[0]
    text = processor.tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], images=[row["images"]], return_tensors="pt", add_special_tokens=False)
    assert int((out["input_ids"] == processor.image_token_id).sum()) == 16  # (32 / 8)^2 patches
    assert out["pixel_values"].shape == (1, 3, 32, 32)
    logits = model(**out).logits
    assert torch.isfinite(logits).all() and logits.shape[1] == out["input_ids"].shape[1]


# ------------------------------------------------------------------ SFT


def test_vision_sft_trains_every_parameter_and_never_targets_image_tokens(tmp_path, processor):
    data = vision_dataset("train", 16)
    trainer = SFTTrainer(VLM, args=SFTConfig(**fields(tmp_path)), train_dataset=data)
    assert trainer.vision and trainer.processing_class is not None
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    image = batch["input_ids"] == processor.image_token_id
    assert int(image.sum()) == 4 * 16 and bool((batch["labels"][image] == IGNORE_INDEX).all())
    assert batch["model_inputs"]["pixel_values"].shape == (4, 3, 32, 32)
    # completion-only by default: the targets are the answers and the end of turn (as for text rows)
    tok = processor.tokenizer
    targets = [tok.decode([t for t in row.tolist() if t != IGNORE_INDEX]) for row in batch["labels"]]
    assert targets == [f"{data[i]['answer']}<|im_end|>\n" for i in range(4)]
    before = snapshot(trainer.model)
    trainer.train()
    assert changed(before, trainer.model) == []
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_vision_sft_masks_for_messages_rows_assistant_only_and_whole_sequence(tmp_path, processor):
    def text(t):
        return [{"type": "text", "text": t}]

    rows = [{"messages": [{"role": "user", "content": [{"type": "image"}, *text("Colour?")]},
                          {"role": "assistant", "content": text("red")},
                          {"role": "user", "content": text("Sure?")}, {"role": "assistant", "content": text("yes")}],
             "images": [vision_dataset("train", 1)[0]["images"][0]]}]
    tok = processor.tokenizer

    def targets(**kw):
        trainer = SFTTrainer(VLM, args=SFTConfig(**fields(tmp_path, **kw)), train_dataset=Dataset.from_list(rows))
        labels = trainer.data_collator([trainer.train_dataset[0]])["labels"][0]
        return tok.decode([t for t in labels.tolist() if t != IGNORE_INDEX]), labels

    assistant, _ = targets(assistant_only_loss=True)
    assert assistant == "red<|im_end|>yes<|im_end|>"
    everything, labels = targets()
    assert "Colour?" in everything and "<image>" not in everything  # all text, no image token


def test_a_dataset_with_images_and_a_text_only_model_is_refused(tmp_path):
    data = vision_dataset("train", 4)
    for trainer, config in ((SFTTrainer, SFTConfig), (DPOTrainer, DPOConfig)):
        rows = data if trainer is SFTTrainer else vision_preference_dataset("train", 4)
        with pytest.raises(VisionDataError, match="column 'images' holds images.*text-only model"):
            trainer("posttrain/tiny-qwen2", args=config(**fields(tmp_path)), train_dataset=rows)


def test_vision_sft_refuses_packing_padding_free_and_mismatched_rows(tmp_path):
    data = vision_dataset("train", 4)
    for option in ("packing", "padding_free"):
        with pytest.raises(ValueError, match=f"{option}=True: vision-language rows are not packed"):
            SFTTrainer(VLM, args=SFTConfig(**fields(tmp_path, **{option: True})), train_dataset=data)
    rows = data.to_list()
    rows[2]["images"] = rows[2]["images"] * 2
    with pytest.raises(VisionDataError, match=r"train data, row 2, prompt \+ completion: 1 image placeholder.*2 image"):
        SFTTrainer(VLM, args=SFTConfig(**fields(tmp_path)), train_dataset=Dataset.from_list(rows))
    with pytest.raises(VisionDataError, match="max_length=10 would cut into the tokens of an image"):
        trainer = SFTTrainer(VLM, args=SFTConfig(**fields(tmp_path, max_length=10)), train_dataset=data)
        trainer.data_collator([trainer.train_dataset[0]])


def test_freezing_the_vision_tower_and_projector_and_lora_on_the_language_model_only(tmp_path):
    from peft import LoraConfig

    data = vision_dataset("train", 8)
    trainer = SFTTrainer(VLM, args=SFTConfig(**fields(tmp_path, freeze_vision_tower=True)), train_dataset=data)
    frozen = [n for n, p in trainer.model.named_parameters() if not p.requires_grad]
    assert frozen and all("vision_tower" in n for n in frozen)
    assert any(p.requires_grad for n, p in trainer.model.named_parameters() if "multi_modal_projector" in n)
    before = snapshot(trainer.model)
    trainer.train()
    assert changed(before, trainer.model) == []
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in frozen)

    args = SFTConfig(**fields(tmp_path, freeze_multi_modal_projector=True))
    trainer = SFTTrainer(VLM, args=args, train_dataset=data)
    assert all(not p.requires_grad for n, p in trainer.model.named_parameters() if "multi_modal_projector" in n)

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = SFTTrainer(VLM, args=SFTConfig(**fields(tmp_path)), train_dataset=data, peft_config=lora)
    adapted = [n for n, _ in trainer.model.named_parameters() if "lora_" in n]
    assert adapted and not [n for n in adapted if "vision_tower" in n]
    with pytest.raises(ValueError, match="freeze_vision_tower=True, but Qwen2ForCausalLM is a text-only model"):
        SFTTrainer("posttrain/tiny-qwen2", args=SFTConfig(**fields(tmp_path, freeze_vision_tower=True)),
                   train_dataset=vision_dataset("train", 2).remove_columns(["images"]).map(
                       lambda r: {"prompt": r["prompt"][0]["content"][1]["text"], "completion": r["answer"]},
                       remove_columns=["prompt", "completion"]))


# ------------------------------------------------------------------ DPO and KTO


def test_vision_dpo_trains_every_parameter_and_the_reference_sees_the_same_pixels(tmp_path, processor):
    data = vision_preference_dataset("train", 8)
    trainer = DPOTrainer(VLM, args=DPOConfig(**fields(tmp_path, beta=0.1)), train_dataset=data)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert batch["input_ids"].shape[0] == 4 and batch["model_inputs"]["pixel_values"].shape[0] == 4
    tok = processor.tokenizer
    scored = [tok.decode(row[mask.bool()]) for row, mask in zip(batch["input_ids"], batch["completion_mask"])]
    assert scored[:2] == [f"{data[i]['answer']}<|im_end|>\n" for i in range(2)]
    # before any step the policy is the reference: identical log-probs on the same pixels, different without them
    inputs = {k: v for k, v in batch.items()}
    policy = trainer.reference_logps(inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"],
                                     inputs["model_inputs"])
    from posttrain.forward.completions import completion_logps
    with torch.no_grad():
        own = completion_logps(trainer.model, inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"],
                               model_inputs=inputs["model_inputs"])[0]
        blind = completion_logps(trainer.model, inputs["input_ids"], inputs["attention_mask"],
                                 inputs["completion_mask"], model_inputs={"pixel_values": torch.zeros_like(
                                     inputs["model_inputs"]["pixel_values"])})[0]
    assert torch.allclose(policy, own, atol=1e-5) and not torch.allclose(own, blind, atol=1e-4)
    before = snapshot(trainer.model)
    trainer.train()
    assert changed(before, trainer.model) == []
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)


def test_vision_dpo_with_precomputed_reference_log_probs(tmp_path):
    data = vision_preference_dataset("train", 8)
    trainer = DPOTrainer(VLM, args=DPOConfig(**fields(tmp_path, precompute_ref_log_probs=True)), train_dataset=data)
    assert trainer.ref_model is None and "ref_chosen_logps" in trainer.train_dataset.column_names
    live = DPOTrainer(VLM, args=DPOConfig(**fields(tmp_path)), train_dataset=data)
    batch = live.data_collator([live.train_dataset[i] for i in range(4)])
    ref = live.reference_logps(batch["input_ids"], batch["attention_mask"], batch["completion_mask"],
                               batch["model_inputs"])
    stored = torch.tensor(trainer.train_dataset["ref_chosen_logps"][:4] + trainer.train_dataset["ref_rejected_logps"][:4])
    assert torch.allclose(ref, stored, atol=1e-4)
    before = snapshot(trainer.model)
    trainer.train()
    assert changed(before, trainer.model) == []


def test_vision_kto_trains_every_parameter_from_pairs_and_from_unpaired_rows(tmp_path):
    for data in (vision_preference_dataset("train", 8), vision_preference_dataset("train", 8, unpaired=True)):
        trainer = KTOTrainer(VLM, args=KTOConfig(**fields(tmp_path)), train_dataset=data)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
        assert batch["input_ids"].shape[0] == 8  # 4 rows and their 4 mismatched KL rows
        before = snapshot(trainer.model)
        trainer.train()
        assert changed(before, trainer.model) == []
        kls = [e["kl"] for e in trainer.state.log_history if "kl" in e]
        assert kls and all(k >= 0 for k in kls)
    trainer = KTOTrainer(VLM, args=KTOConfig(**fields(tmp_path, precompute_ref_log_probs=True)),
                         train_dataset=vision_preference_dataset("train", 8, unpaired=True))
    assert {"ref_logps", "ref_kl_logps", "kl_completion"} <= set(trainer.train_dataset.column_names)
    trainer.train()


# ------------------------------------------------------------------ resume


def vision_sft(**run):
    """A vision SFT trainer on 16 visual-task rows (shuffled batches: the data position is checkpointed too)."""
    args = SFTConfig(**{**fields(run["output_dir"]), **run, "per_device_train_batch_size": 2})
    return SFTTrainer(VLM, args=args, train_dataset=vision_dataset("train", 16))


def test_vision_sft_resumes_bit_identically_after_sigkill(tmp_path):
    import os

    from tests.helpers.resume import assert_same_run, killed_at_save, logged_numbers, run_fields, trained_state

    full = vision_sft(**run_fields(tmp_path / "full", 3, 2))
    full.train()
    expected_state, expected_logs = trained_state(full), logged_numbers(full, 2)
    del full
    killed_at_save(tmp_path, os.path.dirname(__file__), "from test_vision import vision_sft",
                   "vision_sft(**run_fields(output_dir, 3, 2))")
    resumed = vision_sft(**run_fields(tmp_path / "killed", 3, 2))
    resumed.train(resume_from_checkpoint=True)
    assert_same_run(resumed, expected_state, expected_logs, max_steps=3, stop_at=2)


# ------------------------------------------------------------------ a second architecture


def test_a_second_architecture_idefics3_trains_with_sft_dpo_and_kto(tmp_path, idefics3):
    proc = loading.load_processor(None, idefics3)
    data = vision_dataset("train", 8)
    trainer = SFTTrainer(idefics3, args=SFTConfig(**fields(tmp_path)), train_dataset=data)
    assert type(trainer.model).__name__ == "Idefics3ForConditionalGeneration"
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    targets = [proc.tokenizer.decode([t for t in row.tolist() if t != IGNORE_INDEX]) for row in batch["labels"]]
    assert targets == [f"{data[i]['answer']}<|im_end|>\n" for i in range(2)]  # markers and image tokens untrained
    assert "pixel_attention_mask" in batch["model_inputs"]
    before = snapshot(trainer.model)
    trainer.train()
    assert changed(before, trainer.model) == []
    pairs = vision_preference_dataset("train", 8)
    for trainer in (DPOTrainer(idefics3, args=DPOConfig(**fields(tmp_path)), train_dataset=pairs),
                    KTOTrainer(idefics3, args=KTOConfig(**fields(tmp_path)), train_dataset=pairs)):
        before = snapshot(trainer.model)
        trainer.train()
        assert changed(before, trainer.model) == []


# ------------------------------------------------------------------ Reward


def test_vision_reward_model_is_the_vlm_body_under_a_score_head_and_trains_every_parameter(tmp_path):
    from posttrain.models.loading import UntrainedHeadWarning, load_sequence_classifier
    from posttrain.trainers.reward import RewardConfig, RewardTrainer

    pairs = vision_preference_dataset("train", 8)
    with pytest.warns(UntrainedHeadWarning, match="new, randomly initialised score head"):
        trainer = RewardTrainer(VLM, args=RewardConfig(**fields(tmp_path)), train_dataset=pairs)
    model = trainer.model
    assert type(model).__name__ == "VisionScorer" and model.config.num_labels == 1
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    with torch.no_grad():
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       **batch["model_inputs"]).logits
        blind = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      pixel_values=torch.zeros_like(batch["model_inputs"]["pixel_values"])).logits
    assert scores.shape == (4, 1) and not torch.allclose(scores, blind)  # the score reads the image
    before = snapshot(model)
    trainer.train()
    assert changed(before, model) == []
    assert [e for e in trainer.state.log_history if "accuracy" in e]
    trainer.save_model(str(tmp_path / "rm"))
    again = load_sequence_classifier(str(tmp_path / "rm"))
    assert type(again).__name__ == "VisionScorer"
    assert all(torch.equal(p, again.state_dict()[n]) for n, p in model.state_dict().items())


# ------------------------------------------------------------------ command line


@pytest.mark.parametrize("command, dataset", [("sft", "vision"), ("dpo", "vision/preference"),
                                              ("kto", "vision/unpaired_preference"), ("reward", "vision/preference")])
def test_the_cli_trains_the_tiny_vlm_on_the_visual_task_and_saves_a_loadable_model(tmp_path, command, dataset):
    from transformers import AutoConfig, AutoProcessor

    from posttrain import cli

    out = tmp_path / command
    trainer = cli.run([command, "--model_name_or_path", VLM, "--dataset_name", dataset, "--output_dir", str(out),
                       "--max_steps", "1", "--per_device_train_batch_size", "2", "--disable_tqdm", "true"])
    assert trainer.state.global_step == 1 and trainer.vision
    assert AutoConfig.from_pretrained(out).model_type == "llava"
    assert type(AutoProcessor.from_pretrained(out)).__name__ == "LlavaProcessor"  # the processor is saved too
    card = (out / "README.md").read_text()  # the model card says it reads images, and what of the model trained
    assert "pipeline_tag: image-text-to-text" in card and "- vision-language" in card
    assert "- freeze_vision_tower: False" in card and "- freeze_multi_modal_projector: False" in card


def test_vision_sft_on_a_streamed_dataset(tmp_path):
    data = vision_dataset("train", 8).to_iterable_dataset()
    trainer = SFTTrainer(VLM, args=SFTConfig(**fields(tmp_path)), train_dataset=data)
    before = snapshot(trainer.model)
    trainer.train()
    assert trainer.state.global_step == 2 and changed(before, trainer.model) == []
