"""Vision rows: TRL's prepare_multimodal_messages, image loading, row checks, the vision chat template, the mask
carried over the processor's expansion, and the visual task's splits and reward."""

import io

import pytest
from PIL import Image

from posttrain.data.multimodal import (VisionDataError, check_vision_row, expand_mask, load_image,
                                       prepare_multimodal_messages, row_images)
from posttrain.tasks import vision as task

RED = Image.new("RGB", (8, 8), (255, 0, 0))
BLUE = Image.new("RGB", (8, 8), (0, 0, 255))


def test_prepare_multimodal_messages_places_the_images_in_the_first_user_message():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is it?"},
                {"role": "assistant", "content": "A square."}, {"role": "user", "content": "Colour?"}]
    out = prepare_multimodal_messages(messages, [RED, BLUE])
    assert out[0]["content"] == [{"type": "text", "text": "Be brief."}]
    assert out[1]["content"] == [{"type": "image", "image": RED}, {"type": "image", "image": BLUE},
                                 {"type": "text", "text": "What is it?"}]
    assert out[2]["content"] == [{"type": "text", "text": "A square."}]
    assert out[3]["content"] == [{"type": "text", "text": "Colour?"}]
    assert messages[1]["content"] == "What is it?"  # a deep copy: the input is unchanged


def test_prepare_multimodal_messages_fills_existing_placeholders_in_order_and_counts_them():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]},
                {"role": "assistant", "content": "b"}, {"role": "user", "content": [{"type": "image"}]}]
    out = prepare_multimodal_messages(messages, [RED, BLUE])
    assert out[0]["content"][1]["image"] is RED and out[2]["content"][0]["image"] is BLUE
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\).*but 1 image"):
        prepare_multimodal_messages(messages, [RED])
    tool = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [{}]},
            {"role": "tool", "name": "f", "content": "7"}]
    out = prepare_multimodal_messages(tool, [])
    assert out[1]["content"] is None and out[2]["content"] == "7"


def test_images_load_from_pil_paths_bytes_and_dicts(tmp_path):
    path = tmp_path / "red.png"
    RED.save(path)
    data = io.BytesIO()
    BLUE.save(data, format="PNG")
    for value, colour in ((RED, (255, 0, 0)), (str(path), (255, 0, 0)), (data.getvalue(), (0, 0, 255)),
                          ({"bytes": None, "path": str(path)}, (255, 0, 0)), ({"bytes": data.getvalue()}, (0, 0, 255))):
        image = load_image(value)
        assert image.mode == "RGB" and image.getpixel((0, 0)) == colour
    gray = load_image(Image.new("L", (2, 2)))
    assert gray.mode == "RGB"
    with pytest.raises(VisionDataError, match="cannot open the image"):
        load_image(str(tmp_path / "missing.png"), "row 3, column 'images', image 0")
    with pytest.raises(VisionDataError, match="expected a PIL image.*got int"):
        load_image(7)
    assert row_images({"image": RED}) == [RED] and row_images({"images": [RED, BLUE]}) == [RED, BLUE]
    assert row_images({"prompt": "x"}) == []
    with pytest.raises(VisionDataError, match="row 2: both an 'images' and an 'image' column"):
        row_images({"images": [RED], "image": RED}, 2)


def test_rows_whose_placeholders_and_images_differ_are_refused_naming_the_row():
    user = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    answer = [{"role": "assistant", "content": "x"}]
    check_vision_row({"prompt": user, "completion": answer, "images": [RED, BLUE]}, 0)
    with pytest.raises(VisionDataError, match=r"row 5, prompt \+ completion: 2 image placeholder\(s\).*1 image"):
        check_vision_row({"prompt": user, "completion": answer, "images": [RED]}, 5)
    with pytest.raises(VisionDataError, match=r"row 1, prompt \+ rejected: 3 image placeholder"):
        check_vision_row({"prompt": user, "chosen": answer, "images": [RED, BLUE],
                          "rejected": [{"role": "assistant", "content": [{"type": "image"}]}]}, 1)
    # string content: TRL places one placeholder per image itself
    check_vision_row({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
                      "image": RED}, 0)
    with pytest.raises(VisionDataError, match="row 4, prompt \\+ completion: rows with images must be conversational"):
        check_vision_row({"prompt": "text", "completion": " x", "images": [RED]}, 4)


def test_the_mask_follows_the_tokens_through_the_processors_expansion():
    # text: [user, <img>, q, ans, eos] with the answer trained; the processor writes 3 image tokens and a marker
    IMG, MARK = 9, 8
    text_ids, text_mask = [1, IMG, 2, 3, 4], [0, 0, 0, 1, 1]
    ids = [1, MARK, IMG, IMG, IMG, MARK, 2, 3, 4]
    assert expand_mask(text_ids, text_mask, ids, {IMG, MARK}) == [0, 0, 0, 0, 0, 0, 0, 1, 1]
    # an image token is never a target, even where the text's mask says so
    assert expand_mask([IMG, 3], [1, 1], [IMG, IMG, 3], {IMG}) == [0, 0, 1]
    with pytest.raises(VisionDataError, match="matched 2 of 3"):
        expand_mask([1, 2, 3], [1, 1, 1], [1, 2, 5], {IMG})


def test_the_vision_chat_template_renders_parts_and_text_like_chatml():
    from transformers import PreTrainedTokenizerFast

    from posttrain.data.chat import vision_chat_template
    from posttrain.models.tiny import build_tokenizer

    tokenizer: PreTrainedTokenizerFast = build_tokenizer()
    text = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    plain = tokenizer.apply_chat_template(text, tokenize=False)
    tokenizer.chat_template = vision_chat_template("<image>")
    assert tokenizer.apply_chat_template(text, tokenize=False) == plain  # text-only: as ChatML
    parts = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "q"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]
    rendered = tokenizer.apply_chat_template(parts, tokenize=False, add_generation_prompt=False)
    assert rendered == "<|im_start|>user\n<image>q<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"
    out = tokenizer.apply_chat_template(parts, return_dict=True, return_assistant_tokens_mask=True)
    trained = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tokenizer.decode(trained) == "a<|im_end|>"


# ------------------------------------------------------------------ the visual task

def test_the_visual_task_draws_answerable_images_and_keeps_test_images_out_of_training():
    train, test = task.vision_dataset("train", 200), task.vision_dataset("test", 60)
    assert len(train) == 200 and len(test) == 60
    assert set(train["kind"]) == set(task.KINDS) and set(test["kind"]) == set(task.KINDS)
    train_pixels = {row["images"][0].tobytes() for row in train}
    assert not train_pixels & {row["images"][0].tobytes() for row in test}
    assert all(task.image_split(row["images"][0]) == "test" for row in test)
    row = test[0]
    assert row["prompt"][0]["content"][0]["type"] == "image" and row["images"][0].size == (32, 32)
    assert row["completion"][0]["content"] == row["answer"] and row["answer"] in task.ANSWERS[row["kind"]]
    # the answer is in the picture: a colour question's image holds that colour's pixels
    colour = next(r for r in train if r["kind"] == "color")
    assert task.COLORS[colour["answer"]] in {p for _, p in colour["images"][0].getcolors(1024)}
    # the same seed gives the same pixels
    assert task.vision_dataset("train", 8)[3]["images"][0].tobytes() == train[3]["images"][0].tobytes()


def test_the_visual_preference_data_pairs_the_answer_with_a_wrong_one_of_its_kind():
    pairs = task.vision_preference_dataset("train", 40)
    for row in pairs:
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        assert chosen == row["answer"] and rejected != chosen and rejected in task.ANSWERS[row["kind"]]
    unpaired = task.vision_preference_dataset("train", 10, unpaired=True)
    assert unpaired["label"] == [True, False] * 5


def test_the_reward_takes_trls_arguments_and_scores_exact_answers():
    completions = [[{"role": "assistant", "content": "Red."}], [{"role": "assistant", "content": "blue"}], "3"]
    rewards = task.vision_reward(prompts=["p"] * 3, completions=completions, answer=["red", "red", "3"],
                                 images=[[RED]] * 3, completion_ids=[[1]] * 3, kind=["color"] * 3)
    assert rewards == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="2 image lists for 3 completions"):
        task.vision_reward(completions=completions, answer=["a"] * 3, images=[[RED]] * 2)
    assert task.vision_check(" left ", "left") and not task.vision_check("left right", "left")
