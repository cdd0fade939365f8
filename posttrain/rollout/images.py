"""Image prompts for the online trainers (GRPO, RLOO, ...): TRL's prompt-only vision rows turned into what the
sampler and the training forward take.

A row is conversational, its images in an `images` (or `image`) column (`data.multimodal`). Each prompt is
rendered by the processor's chat template with the generation prompt, one placeholder per image, and the
processor expands the placeholders into the model's image tokens and turns the images into pixel values:
the prompt's token ids, and one dict of the processor's other tensors (`pixel_values`, `image_sizes`, ...)
per prompt, which `rollout.generate` prefills with and `forward.vision` keeps per completion.

Departures from TRL: a prompt longer than `max_prompt_length` is refused rather than cut when it has
images (cutting into an image's tokens would leave the model more image features than placeholders, and
TRL's protected-token truncation changes what the model sees); the images reach the reward functions as
the dataset column they came in (`images` or `image`), as TRL passes every column.
"""

from __future__ import annotations

from torch import Tensor

from posttrain.data.multimodal import (IMAGE_COLUMNS, VisionDataError, check_vision_row, has_image_column,
                                       prepare_multimodal_messages, row_images)
from posttrain.data.tokenize import check_prompts
from posttrain.models import loading
from posttrain.models.vision import vision_run
from posttrain.rollout.tools import ToolImageError

# processor outputs that are per token, not per image: the sampler and the packed forward place tokens
# themselves, and the models the online path supports read the image tokens from the ids
PER_TOKEN = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def has_image_prompts(rows: list[dict]) -> bool:
    """Whether a batch of prompt rows carries images (an `images` / `image` column with any image)."""
    return any(row.get(column) not in (None, []) for row in rows for column in IMAGE_COLUMNS)


def load_policy(model, processing_class, dataset, trainer: str, init_kwargs: dict):
    """(policy, processing_class, whether it reads images): a vision-language model (an object with a vision
    tower, or a checkpoint whose config has one) with its processor, else a causal LM with its tokenizer; a
    dataset with images for a text-only model is refused (`models.vision.vision_run`)."""
    if vision_run(model, dataset, trainer):
        policy = loading.load_vision_lm(model, **init_kwargs)
        return policy, loading.load_processor(processing_class, model=model if isinstance(model, str) else policy), True
    policy = loading.load_causal_lm(model, **init_kwargs)
    return policy, loading.load_tokenizer(processing_class, model=model if isinstance(model, str) else policy), False


def text_tokenizer(processing_class):
    """The tokenizer inside a vision-language model's processor, or `processing_class` itself: what the token
    ids are decoded with and where pad and EOS are read."""
    return processing_class.tokenizer if loading.is_processor(processing_class) else processing_class


def check_image_prompts(dataset, processing_class, what: str = "train_dataset") -> None:
    """Refuse, naming the row, a prompt row with images that is not conversational or whose image
    placeholders are not as many as its images; rows without an image column are checked as text prompts."""
    if not has_image_column(dataset):
        check_prompts(dataset, text_tokenizer(processing_class), what)
        return
    for i, row in enumerate(dataset):
        try:
            check_vision_row(row, i)
        except VisionDataError as err:
            raise VisionDataError(f"{what}: {err}") from None


def encode_image_prompts(processor, rows: list[dict], template_kwargs: dict | None = None,
                         max_prompt_length: int | None = None,
                         tools: list[list[dict] | None] | None = None) -> tuple[list[list[int]], list[dict[str, Tensor]]]:
    """(token ids per prompt, the processor's image tensors per prompt) for prompt rows with images.

    Each prompt is encoded alone, so its ids carry no padding and its tensors only its own images;
    a row without images gets an empty dict. tools: per row, the tool schemas the chat template shows (or None)."""
    if not loading.is_processor(processor):
        raise VisionDataError(f"rows with images need the model's processor (AutoProcessor) as processing_class, "
                              f"got {type(processor).__name__}, which cannot turn images into pixel values")
    ids, vision = [], []
    for i, row in enumerate(rows):
        images = row_images(row, i)
        messages = prepare_multimodal_messages(row["prompt"], images) if images else row["prompt"]
        schemas = {"tools": tools[i]} if tools and tools[i] else {}
        text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                       **schemas, **(template_kwargs or {}))
        out = processor(text=[text], images=[images] if images else None, return_tensors="pt",
                        add_special_tokens=False)
        row_ids = out["input_ids"][0].tolist()
        if max_prompt_length is not None and len(row_ids) > max_prompt_length and images:
            raise VisionDataError(
                f"prompt {i} of the batch is {len(row_ids)} tokens with its images' tokens, over max_prompt_length="
                f"{max_prompt_length}; a prompt with images is not cut (that would cut into the image tokens): "
                f"raise max_prompt_length (or set it to None), or make the images smaller through the processor")
        ids.append(row_ids)
        vision.append({k: v for k, v in out.items() if k not in PER_TOKEN})
    return ids, vision


def encode_tool_turn(processor, text: str, images: list, names: list[str]) -> tuple[list[int], dict[str, Tensor]]:
    """(ids, the processor's image tensors) of a tool turn with images: `text` (the chat template's continuation,
    `data.tokenize.continuation_text`, one placeholder per image part) expanded by the processor, as a prompt's
    images are. names: the tools whose results hold the images, for the error when the template writes no
    placeholder for them (it does not render image parts of `tool` messages)."""
    token = getattr(processor, "image_token", None)
    if isinstance(token, str) and text.count(token) != len(images):
        raise ToolImageError(
            f"tool(s) {sorted(set(names))} returned {len(images)} image(s), but the chat template wrote "
            f"{text.count(token)} {token!r} placeholder(s) for them: it does not render the image parts of `tool` "
            "messages, so the model could not see them; use a chat template that renders {'type': 'image'} parts "
            "in every role, or return text from the tool")
    out = processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
    return out["input_ids"][0].tolist(), {k: v for k, v in out.items() if k not in PER_TOKEN}
