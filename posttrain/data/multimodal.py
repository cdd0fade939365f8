"""Image-text rows: TRL's layouts for vision-language models, checked, and turned into model inputs.

A vision row is conversational: its messages' content is a string or a list of parts
(``{"type": "image"}``, ``{"type": "text", "text": ...}``), and its images sit in an ``images``
column (a list per row, several allowed) or an ``image`` column (one per row). An image is a PIL
image, a file path, raw bytes, or the ``{"bytes", "path"}`` dict a `datasets.Image` column stores.
Messages whose content is all strings get one image placeholder per image at the start of their
first user message, as TRL's `prepare_multimodal_messages` does.

Encoding (`encode_vision_batch`) leaves the image work to the model's processor: the chat template
renders each conversation with one placeholder per image, the processor expands every placeholder
into the model's image tokens and turns the images into pixel values. Which tokens are trained on
is decided on the rendered text, by the same rules as for text-only rows
(`posttrain.data.tokenize`: completion-only, assistant-only), and carried over to the expanded
sequence token by token; whatever the processor added (image tokens, image boundary markers) is
never a target.
"""

from __future__ import annotations

import copy
import io
import os
from collections.abc import Mapping
from typing import Any

IMAGE_COLUMNS = ("images", "image")
CONVERSATION_COLUMNS = ("messages", "prompt", "completion", "chosen", "rejected")

__all__ = ["IMAGE_COLUMNS", "VisionDataError", "prepare_multimodal_messages", "load_image", "row_images",
           "count_image_parts", "check_vision_row", "has_image_column", "image_column", "is_vision_model", "refuse_text_only",
           "expand_mask", "encode_vision_batch", "prepare_vision_dataset"]


class VisionDataError(ValueError):
    """A vision row that cannot be used as it is; the message names the row and the column."""


# --------------------------------------------------------------------------- messages and images

def _as_parts(content) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])


def prepare_multimodal_messages(messages: list[dict[str, Any]], images: list) -> list[dict[str, Any]]:
    """A deep copy of `messages` in the structured form, each image part holding its image (TRL's helper).

    Every string content becomes ``[{"type": "text", "text": ...}]``; when no message has image parts yet,
    one ``{"type": "image"}`` per image goes before the text of the first user message. Then the image
    parts, in order, receive `images` (``part["image"] = image``). `tool` messages and an assistant's
    None content (beside ``tool_calls``) are left as they are. Raises ValueError when the number of image
    parts differs from the number of images.
    """
    messages = copy.deepcopy(list(messages))
    placed = count_image_parts(messages) > 0
    for message in messages:
        role = message.get("role")
        if role == "tool" or (role == "assistant" and message.get("content") is None):
            continue
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"invalid role {role!r} in a message; expected 'system', 'user', 'assistant' or 'tool'")
        parts = _as_parts(message.get("content"))
        if role == "user" and not placed:
            parts = [{"type": "image"} for _ in images] + parts
            placed = True
        message["content"] = parts
    found = count_image_parts(messages)
    if found != len(images):
        raise ValueError(f"the messages hold {found} image placeholder(s) ({{'type': 'image'}} parts) but "
                         f"{len(images)} image(s) were given; give one image per placeholder")
    remaining = iter(images)
    for message in messages:
        if message.get("role") != "tool" and isinstance(message.get("content"), list):
            for part in message["content"]:
                if isinstance(part, Mapping) and part.get("type") == "image":
                    part["image"] = next(remaining)
    return messages


def count_image_parts(messages) -> int:
    """How many ``{"type": "image"}`` parts a list of messages holds."""
    if not isinstance(messages, (list, tuple)):
        return 0
    return sum(1 for m in messages if isinstance(m, Mapping) and isinstance(m.get("content"), (list, tuple))
               for part in m["content"] if isinstance(part, Mapping) and part.get("type") == "image")


def load_image(value, where: str = "image"):
    """`value` as an RGB PIL image: a PIL image, a file path, bytes, or a {"bytes", "path"} dict."""
    from PIL import Image

    if isinstance(value, Mapping):  # a datasets.Image column read without decoding
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, (str, os.PathLike)):
            image = Image.open(os.path.expanduser(os.fspath(value)))
        else:
            raise VisionDataError(f"{where}: expected a PIL image, a file path, bytes or a {{'bytes', 'path'}} dict, "
                                  f"got {type(value).__name__}")
        return image if image.mode == "RGB" else image.convert("RGB")
    except (OSError, Image.DecompressionBombError) as err:
        raise VisionDataError(f"{where}: cannot open the image ({type(err).__name__}: {err})") from None


def row_images(row: Mapping, i: int | None = None, load: bool = True) -> list:
    """The images of a row, in order: its `images` list or its one `image` ([] when it has none)."""
    where = "row" if i is None else f"row {i}"
    if row.get("images") is not None and row.get("image") is not None:
        raise VisionDataError(f"{where}: both an 'images' and an 'image' column; keep one of them")
    if row.get("images") is not None:
        values, column = row["images"], "images"
        if not isinstance(values, (list, tuple)):
            values = [values]  # one image where a list was expected: taken as a list of one
    elif row.get("image") is not None:
        values, column = [row["image"]], "image"
    else:
        return []
    return [load_image(v, f"{where}, column {column!r}, image {k}") if load else v for k, v in enumerate(values)]


def _conversations(row: Mapping) -> dict[str, list]:
    """The message lists a row renders, by name: prompt + each answer, or its `messages`."""
    if row.get("messages") is not None:
        return {"messages": list(row["messages"])}
    prompt = list(row.get("prompt") or [])
    answers = {c: list(row[c]) for c in ("completion", "chosen", "rejected") if row.get(c) is not None}
    if not answers:
        return {"prompt": prompt}
    return {f"prompt + {c}": prompt + a for c, a in answers.items()}


def check_vision_row(row: Mapping, i: int) -> None:
    """Refuse, naming row `i`, a vision row that is not conversational or whose image placeholders in any of
    its conversations (prompt + completion, prompt + chosen, ...) are not as many as its images."""
    images = row_images(row, i, load=False)
    for name, messages in _conversations(row).items():
        if not messages or not all(isinstance(m, Mapping) and "role" in m for m in messages):
            raise VisionDataError(
                f"row {i}, {name}: rows with images must be conversational (lists of {{'role', 'content'}} "
                f"messages, content a string or a list of {{'type': 'image'}} / {{'type': 'text', 'text': ...}} "
                f"parts): the chat template is what places the images in the text")
        found = count_image_parts(messages)
        strings_only = all(isinstance(m.get("content"), str) or m.get("content") is None for m in messages)
        if found != len(images) and not (found == 0 and strings_only):
            raise VisionDataError(
                f"row {i}, {name}: {found} image placeholder(s) ({{'type': 'image'}} parts) but {len(images)} "
                f"image(s) in the row's 'images'/'image' column; give one image per placeholder")


# --------------------------------------------------------------------------- models and datasets

def has_image_column(dataset) -> bool:
    """Whether a dataset (or a list of rows) has an `images` or `image` column."""
    return image_column(dataset) is not None


def is_vision_model(model) -> bool:
    """Whether `model` (an object, or a PEFT wrapper of one) reads images: its config has a vision tower."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    return config is not None and getattr(config, "vision_config", None) is not None


def image_column(dataset) -> str | None:
    """The dataset's image column: `images` or `image` (None when it has neither)."""
    names = getattr(dataset, "column_names", None)
    if names is None:
        first = next(iter(dataset), None)
        names = list(first) if isinstance(first, Mapping) else []
    return next((c for c in IMAGE_COLUMNS if c in (names or ())), None)


def refuse_text_only(model, trainer: str, column: str = "images") -> None:
    """A dataset with images given to a text-only model (an object, or a name): the images would be ignored."""
    if isinstance(model, str) or not is_vision_model(model):
        name = model if isinstance(model, str) else (getattr(getattr(model, "config", None), "_name_or_path", "")
                                                     or type(model).__name__)
        raise VisionDataError(
            f"{trainer}: column {column!r} holds images, but {name!r} is a text-only model that would ignore them; "
            f"pass a vision-language model (AutoModelForImageTextToText, e.g. 'posttrain/tiny-llava') with its "
            f"processor, or drop the column")


# --------------------------------------------------------------------------- encoding

def image_token_ids(processor) -> set[int]:
    """Ids of the tokens that stand for image content in `processor`'s expanded sequences."""
    ids = set()
    for name in ("image_token_id", "video_token_id"):
        value = getattr(processor, name, None)
        if isinstance(value, int):
            ids.add(value)
    tokenizer = getattr(processor, "tokenizer", processor)
    for name in ("image_token", "boi_token", "eoi_token", "fake_image_token", "global_image_token"):
        token = getattr(processor, name, None)
        if isinstance(token, str):
            found = tokenizer.convert_tokens_to_ids(token)
            if isinstance(found, int) and found != tokenizer.unk_token_id:
                ids.add(found)
    return ids


def expand_mask(text_ids: list[int], text_mask: list[int], ids: list[int], image_ids: set[int]) -> list[int]:
    """The loss mask of `text_ids` carried over to `ids`, the processor's expansion of the same text.

    The processor only inserts tokens (each image placeholder becomes the image's tokens, some processors
    add boundary markers), so `text_ids` is a subsequence of `ids`: matched in order, each of its tokens
    keeps its mask value; inserted tokens and every image token get 0 (never a target). Raises
    VisionDataError when `text_ids` is not found in order in `ids` (the processor changed the text).
    """
    out, j = [], 0
    for token in ids:
        if j < len(text_ids) and token == text_ids[j]:
            out.append(0 if token in image_ids else int(text_mask[j]))
            j += 1
        else:
            out.append(0)
    if j != len(text_ids):
        raise VisionDataError(
            f"the processor's tokens do not contain the chat template's tokens in order (matched {j} of "
            f"{len(text_ids)}): it changes the text besides expanding the image placeholders, so the trained "
            f"tokens cannot be located")
    return out


def encode_vision_batch(processor, texts: list[str], images: list[list], text_ids: list[list[int]],
                        text_masks: list[list[int]], max_length: int | None = None,
                        rows: list[int] | None = None) -> dict:
    """One processor call for a batch of rendered conversations and their images.

    texts: each conversation rendered by the chat template (one placeholder per image); images: each
    row's images (PIL); text_ids / text_masks: the same conversations tokenised without the expansion and
    their loss masks. Returns the processor's tensors (input_ids (B, T) right-padded, attention_mask,
    pixel_values, and whatever else the model reads, e.g. image_grid_thw) plus `loss_mask` (B, T).
    `max_length` cuts rows from the right; a cut that would fall within or before an image's tokens raises
    VisionDataError naming the row (the model needs every image token of an image it is given).
    """
    import torch

    kwargs = {"images": images} if any(images) else {}
    try:
        out = processor(text=texts, padding=True, padding_side="right", return_tensors="pt",
                        add_special_tokens=False, **kwargs)
    except (ValueError, TypeError) as err:
        where = f"rows {rows[0]}-{rows[-1]}" if rows else "a batch"
        raise VisionDataError(f"{where}: the processor could not encode the texts and images ({err})") from None
    out = dict(out)
    attention = out["attention_mask"].bool()
    image_ids = image_token_ids(processor)
    masks = torch.zeros_like(out["input_ids"])
    for b in range(len(texts)):
        ids = out["input_ids"][b][attention[b]].tolist()
        try:
            masks[b, : len(ids)] = torch.tensor(expand_mask(text_ids[b], text_masks[b], ids, image_ids))
        except VisionDataError as err:
            raise VisionDataError(f"row {rows[b] if rows else b}: {err}") from None
    out["loss_mask"] = masks
    if max_length is not None and out["input_ids"].shape[1] > max_length:
        is_image = torch.zeros_like(attention)
        for token in image_ids:
            is_image |= out["input_ids"] == token
        cut = is_image[:, max_length:].any(1)
        if bool(cut.any()):
            b = int(cut.nonzero()[0])
            raise VisionDataError(
                f"row {rows[b] if rows else b}: max_length={max_length} would cut into the tokens of an image "
                f"(its sequence has {int(attention[b].sum())} tokens with the images expanded); raise max_length or "
                f"make the images smaller through the processor (e.g. its size or max_pixels)")
        for key in ("input_ids", "attention_mask", "loss_mask", "token_type_ids", "mm_token_type_ids"):
            if key in out and out[key].dim() == 2:
                out[key] = out[key][:, :max_length]
    return out


# --------------------------------------------------------------------------- datasets

LAYOUTS = {"sft": (("messages",), ("prompt", "completion")), "paired": (("prompt", "chosen", "rejected"),),
           "unpaired": (("prompt", "completion", "label"),)}


def prepare_vision_dataset(dataset, layout: str, name: str = "train"):
    """A vision dataset checked row by row (`check_vision_row`, naming the bad row) and given a `row_index`
    column (what the collators name in their errors); the images stay as they are, processed batch by batch.

    layout: "sft" (messages, or prompt + completion), "paired" (prompt, chosen, rejected) or "unpaired"
    (prompt, completion, label). A streamed dataset is checked as its rows are read."""
    from datasets import IterableDataset

    columns = getattr(dataset, "column_names", None) or list(next(iter(dataset), {}))
    options = LAYOUTS[layout]
    if not any(set(option) <= set(columns) for option in options):
        wanted = " or ".join("(" + ", ".join(option) + ")" for option in options)
        raise VisionDataError(f"{name} data: a vision dataset for this trainer needs the columns {wanted} beside "
                              f"'images' or 'image'; its columns are {columns}")

    def check(row, i):
        try:
            check_vision_row(row, i)
        except VisionDataError as err:
            raise VisionDataError(f"{name} data, {err}") from None
        return {"row_index": i}

    if isinstance(dataset, IterableDataset):
        return dataset.map(check, with_indices=True)
    for i, row in enumerate(dataset):
        check(row, i)
    return dataset.add_column("row_index", list(range(len(dataset))))
