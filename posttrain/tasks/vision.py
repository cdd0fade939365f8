"""A visual question-answering task drawn here with PIL, for the vision-language trainers' learning checks.

Each row is one small image (IMAGE_SIZE pixels square, black background) and a question whose answer
can only be read from the image:

* ``color``:    one shape (square, circle or triangle); "What colour is the shape?" -> "red"
* ``count``:    1 to 4 small shapes of one colour; "How many shapes are there?" -> "3"
* ``position``: one shape in the left or the right third; "Is the shape on the left or the right?" -> "left"
* ``digit``:    one digit drawn in a random colour; "Which digit is shown?" -> "7"

Held-out images are never training images: every image is assigned to the train or the test split by
a hash of its pixels (`image_split`), and each split keeps only its own images, so no picture (not
even one drawn twice by chance) is in both.

Rows follow TRL's vision layout: conversational `prompt` (an image part and a text part) and
`completion`, the image in the `images` column (a list of one), plus `answer` and `kind`.
`vision_reward` takes TRL's reward-function arguments (prompts, completions, and the dataset's columns,
the images among them) and scores exact matches.

The tool variant (`vision_tool_dataset`, `ShowImageEnv`): the colour question with no picture in the prompt;
the picture is in the row's `picture` column, which the environment's `show_image` tool returns as an image,
so the answer can only be read from the tool's image. `vision_tool_traces` are the SFT conversations (the
call, the tool's image, the answer) and `vision_tool_reward` scores the assistant's last message.
"""

from __future__ import annotations

import hashlib
import random

from posttrain.tasks.builtin import completion_text

IMAGE_SIZE = 32
COLORS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (60, 90, 240), "yellow": (235, 215, 40)}
SHAPES = ("square", "circle", "triangle")
KINDS = ("color", "count", "position", "digit")
QUESTIONS = {"color": "What colour is the shape?", "count": "How many shapes are there?",
             "position": "Is the shape on the left or the right?", "digit": "Which digit is shown?"}
ANSWERS = {"color": tuple(COLORS), "count": ("1", "2", "3", "4"), "position": ("left", "right"),
           "digit": tuple("0123456789")}
TEST_SHARE = 26  # of 256: the share of image hashes that belong to the test split (about 10%)
DEFAULT_SIZES = (2000, 200)

__all__ = ["vision_dataset", "vision_preference_dataset", "vision_check", "vision_reward", "image_split",
           "draw_example", "KINDS", "QUESTIONS", "ANSWERS", "ShowImageEnv", "vision_tool_dataset",
           "vision_tool_traces", "vision_tool_reward"]


def _shape(draw, kind: str, box: tuple[int, int, int, int], color) -> None:
    x0, y0, x1, y1 = box
    if kind == "square":
        draw.rectangle(box, fill=color)
    elif kind == "circle":
        draw.ellipse(box, fill=color)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=color)


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # a Pillow without FreeType: the small bitmap font
        return ImageFont.load_default()


def draw_example(kind: str, rng: random.Random):
    """(image, answer) of one example of `kind`, drawn from `rng`."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (0, 0, 0))
    draw = ImageDraw.Draw(image)
    color_name = rng.choice(tuple(COLORS))
    color = COLORS[color_name]
    if kind == "color":
        side = rng.randint(8, 16)
        x, y = rng.randint(0, IMAGE_SIZE - side), rng.randint(0, IMAGE_SIZE - side)
        _shape(draw, rng.choice(SHAPES), (x, y, x + side - 1, y + side - 1), color)
        return image, color_name
    if kind == "count":
        n = rng.randint(1, 4)
        cells = rng.sample([(cx, cy) for cx in range(2) for cy in range(2)], n)  # one shape per quadrant
        for cx, cy in cells:
            side = rng.randint(5, 9)
            x = cx * 16 + rng.randint(0, 16 - side)
            y = cy * 16 + rng.randint(0, 16 - side)
            _shape(draw, rng.choice(SHAPES), (x, y, x + side - 1, y + side - 1), color)
        return image, str(n)
    if kind == "position":
        side = rng.randint(6, 10)
        answer = rng.choice(("left", "right"))
        x = rng.randint(0, 10 - side // 2) if answer == "left" else rng.randint(22 - side // 2, IMAGE_SIZE - side)
        y = rng.randint(0, IMAGE_SIZE - side)
        _shape(draw, rng.choice(SHAPES), (x, y, x + side - 1, y + side - 1), color)
        return image, answer
    if kind == "digit":
        digit = str(rng.randint(0, 9))
        draw.text((rng.randint(6, 14), rng.randint(-2, 6)), digit, fill=color, font=_font(22))
        return image, digit
    raise ValueError(f"unknown question kind {kind!r}; choose from {KINDS}")


def image_split(image) -> str:
    """'train' or 'test': the split an image belongs to, by a hash of its pixels."""
    return "test" if hashlib.sha256(image.tobytes()).digest()[0] < TEST_SHARE else "train"


def _row(image, question: str, answer: str, kind: str) -> dict:
    return {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
            "completion": [{"role": "assistant", "content": answer}],
            "images": [image], "answer": answer, "kind": kind}


def _examples(split: str, size: int | None, kinds, seed: int) -> list[tuple]:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    kinds = tuple(kinds)
    if unknown := [k for k in kinds if k not in KINDS]:
        raise ValueError(f"unknown question kind(s) {unknown}; choose from {KINDS}")
    size = size or DEFAULT_SIZES[split == "test"]
    rng = random.Random(f"vision-{split}-{seed}")
    out = []
    for i in range(200 * size):
        if len(out) == size:
            return out
        kind = kinds[len(out) % len(kinds)]  # the kinds in turn: each split is balanced
        image, answer = draw_example(kind, rng)
        if image_split(image) == split:
            out.append((image, QUESTIONS[kind], answer, kind))
    raise ValueError(f"could not draw {size} distinct {split} images of kinds {kinds}; ask for fewer")


def vision_dataset(split: str = "train", size: int | None = None, kinds=KINDS, seed: int = 0):
    """The visual task's rows (see the module docstring): prompt, completion, images, answer, kind."""
    from datasets import Dataset

    return Dataset.from_list([_row(*example) for example in _examples(split, size, kinds, seed)])


def vision_preference_dataset(split: str = "train", size: int | None = None, kinds=KINDS, seed: int = 0,
                              unpaired: bool = False):
    """Preference rows for the visual task: prompt, chosen (the right answer), rejected (a wrong answer of the
    same kind), images, answer, kind. With `unpaired`: prompt, completion, label (alternately right and wrong)."""
    from datasets import Dataset

    rng = random.Random(f"vision-preference-{split}-{seed}")
    rows = []
    for i, (image, question, answer, kind) in enumerate(_examples(split, size, kinds, seed)):
        row = _row(image, question, answer, kind)
        wrong = [{"role": "assistant", "content": rng.choice([a for a in ANSWERS[kind] if a != answer])}]
        if unpaired:
            row.update(completion=row["completion"] if i % 2 == 0 else wrong, label=i % 2 == 0)
        else:
            row["chosen"], row["rejected"] = row.pop("completion"), wrong
        rows.append(row)
    return Dataset.from_list(rows)


def vision_check(completion, answer: str) -> bool:
    """Exact match: the completion (text or messages; case, spaces and a final full stop ignored) is the answer."""
    return completion_text(completion).strip().rstrip(".").strip().lower() == str(answer).strip().lower()


def vision_reward(prompts=None, completions=None, answer=None, images=None, **kwargs) -> list[float]:
    """1.0 when a completion is its row's answer (`vision_check`), else 0.0: a TRL reward function.

    It receives what TRL passes (prompts, completions, completion_ids and the dataset's columns: `answer`,
    `images`, `kind`); the images must be as many as the completions when given.
    """
    if completions is None or answer is None:
        raise ValueError("vision_reward needs the completions and the dataset's 'answer' column")
    if images is not None and len(images) != len(completions):
        raise ValueError(f"vision_reward got {len(images)} image lists for {len(completions)} completions")
    return [float(vision_check(c, a)) for c, a in zip(completions, answer)]


# --------------------------------------------------------------------------- the picture behind a tool

TOOL_QUESTION = "What colour is the shape? Use show_image."


class ShowImageEnv:
    """The colour question with the picture behind a tool: `reset(picture=..., **row)` keeps the row's hidden
    picture, and `show_image` returns it as an image part. With `show_results=False` the tool answers
    "unavailable" instead (the same episodes without the picture: the baseline the tool must beat); `calls`
    counts the calls of the episode."""

    def __init__(self, show_results: bool = True):
        self.show_results, self.picture, self.calls = show_results, None, 0

    def reset(self, picture=None, **row) -> None:
        self.picture, self.calls = picture, 0

    def show_image(self):
        """Show the picture."""
        self.calls += 1
        if not self.show_results or self.picture is None:
            return "unavailable"
        return {"type": "image", "image": self.picture}


def vision_tool_dataset(split: str = "train", size: int | None = None, seed: int = 0):
    """Prompt-only rows of the colour question without its picture: prompt (text only), picture (the hidden
    image, for `ShowImageEnv`), answer, kind; the same pictures as `vision_dataset(split, size, ("color",), seed)`."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": TOOL_QUESTION}], "picture": image,
                               "answer": answer, "kind": kind}
                              for image, _, answer, kind in _examples(split, size, ("color",), seed)])


def vision_tool_traces(split: str = "train", size: int | None = None, seed: int = 0):
    """SFT conversations for the tool variant: `messages` (the question, a `show_image` call, the tool's message
    holding the picture as an image part, the answer), `images` (the picture) and `tools` (the environment's
    schema as a JSON string), one per `vision_tool_dataset` row of the same split and seed."""
    import json

    from datasets import Dataset

    from posttrain.data.tools import environment_tools, tool_schemas

    tools = json.dumps(tool_schemas(environment_tools(ShowImageEnv())))
    call = {"type": "function", "function": {"name": "show_image", "arguments": {}}}
    return Dataset.from_list([{"messages": [
        {"role": "user", "content": [{"type": "text", "text": TOOL_QUESTION}]},
        {"role": "assistant", "content": [], "tool_calls": [call]},
        {"role": "tool", "name": "show_image", "content": [{"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ], "images": [image], "tools": tools} for image, _, answer, _ in _examples(split, size, ("color",), seed)])


def vision_tool_reward(completions=None, answer=None, **kwargs) -> list[float]:
    """1.0 when the assistant's last message of an episode is its row's colour (`vision_check`), else 0.0."""
    if completions is None or answer is None:
        raise ValueError("vision_tool_reward needs the completions and the dataset's 'answer' column")
    from posttrain.tasks.environments import last_answer_text

    return [float(vision_check(last_answer_text(c), a)) for c, a in zip(completions, answer)]
