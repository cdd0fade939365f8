"""A tool that returns an image. For a text-only model an image result (a PIL image, an image content part, a list
of parts holding one) stops the rollout with an error naming the tool, instead of showing the model the image's
repr; results that merely mention images still pass. For a vision-language model the result becomes image parts
of the tool message: the processor expands their placeholders, the sampler feeds the images' features where it
feeds the tool turn, and the rollout keeps each row's prompt and tool images, in order, for the training forward,
whose log-probs then equal the sampler's; the tool's tokens, image tokens included, are out of the loss. Checked on
the tiny LLaVA and on a tiny Idefics3 (SmolVLM's family) whose processor splits each image into a number of crops
that follows its shape and writes marker tokens around them."""

import io
import json

import pytest
import torch
from PIL import Image
from tests.helpers.vision import tiny_idefics3, tiny_vlm_with_visible_images

from posttrain.data.tokenize import continuation_text
from posttrain.data.tools import tool_schemas
from posttrain.forward.completions import completion_logprobs
from posttrain.forward.vision import IMAGE_GROUP, PIXELS
from posttrain.models.loading import load_tokenizer
from posttrain.rollout.generate import SamplingConfig, generate
from posttrain.rollout.images import encode_image_prompts, encode_tool_turn
from posttrain.rollout.multiturn import Episodes, engine_turns
from posttrain.rollout.tools import ToolImageError, run_tool_call

PICTURE = Image.new("RGB", (8, 8), (200, 30, 30))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models decoding one token per step: one thread is faster than two that wait on each other on a busy
    machine (the Idefics3 rollout took 13 s with two on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def zoom(factor: int):
    """Zoom into the picture.

    Args:
        factor: How much to enlarge it.
    """
    return PICTURE.resize((8 * factor, 8 * factor))


@pytest.mark.parametrize("result", [PICTURE, {"type": "image", "image": PICTURE}, {"image": "crop.png"},
                                    [{"type": "text", "text": "here"}, {"type": "image"}]])
def test_an_image_result_is_refused_naming_the_tool(result):
    def crop(x: int):
        """Crop.

        Args:
            x: Where.
        """
        return result

    with pytest.raises(ToolImageError, match=r"tool 'crop' returned an image.*return text"):
        run_tool_call({"name": "crop", "arguments": {"x": 1}}, {"crop": crop})


@pytest.mark.parametrize("result", [{"type": "text", "text": "an image of a cat"}, ["image", "pixels"], {"size": 3}])
def test_results_that_are_not_images_are_text(result):
    message, error = run_tool_call({"name": "f", "arguments": {}}, {"f": lambda: result})
    assert error is None and message["content"] == json.dumps(result)


def test_a_rollout_whose_tool_returns_an_image_stops_naming_the_tool():
    tok = load_tokenizer("posttrain/tiny-qwen2")
    prompt = [{"role": "user", "content": "zoom in"}]
    episodes = Episodes(tok, [prompt], [{"zoom": zoom}], [tool_schemas([zoom])], max_iterations=1, timeout=5)
    call = '<tool_call>{"name": "zoom", "arguments": {"factor": 2}}</tool_call>'
    with pytest.raises(ToolImageError, match="tool 'zoom' returned an image"):
        episodes([0], [tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]])


# ----------------------------------------------------------------------------------- vision-language models
@pytest.fixture(scope="module")
def vlm():
    return tiny_vlm_with_visible_images()


WIDE = Image.new("RGB", (48, 20), (30, 200, 90))  # Idefics3 with splitting: 2 crops and the global view


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    """The tiny Idefics3 (eval mode) whose processor splits images, its connector scaled by 8 (as the LLaVA's
    projector: the random tower's features then move the logits visibly), and its processor."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_idefics3(tmp_path_factory.mktemp("idefics3"), splitting=True)
    model = AutoModelForImageTextToText.from_pretrained(path)
    with torch.no_grad():
        for p in model.model.connector.parameters():
            p.mul_(8.0)
    return model.eval(), AutoProcessor.from_pretrained(path)


def picture_rows(n: int = 2):
    from posttrain.tasks.vision import vision_dataset

    data = vision_dataset("train", size=n, kinds=("color",))
    return [data[i] for i in range(n)]


def crop(x: int):
    """Crop the picture.

    Args:
        x: The left edge.
    """
    return [{"type": "image", "image": PICTURE.crop((x, 0, x + 4, 4))}, {"type": "text", "text": "the crop"}]


def _call(tok, name: str = "crop", **arguments):
    text = "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_image_results_become_image_parts(tmp_path):
    path = tmp_path / "crop.png"
    PICTURE.save(path)
    buffer = io.BytesIO()
    PICTURE.convert("L").save(buffer, format="PNG")
    for result in (PICTURE, {"type": "image", "image": str(path)}, {"image": buffer.getvalue()},
                   ["here", {"type": "image", "image": PICTURE}, {"type": "text", "text": "x" * 50}]):
        message, error = run_tool_call({"name": "f", "arguments": {}}, {"f": lambda: result}, images=True,
                                       max_result_chars=20)
        assert error is None and message["role"] == "tool"
        images = [p["image"] for p in message["content"] if p["type"] == "image"]
        assert len(images) == 1 and images[0].mode == "RGB" and images[0].size == (8, 8)
        assert all(len(p["text"]) < 70 for p in message["content"] if p["type"] == "text")  # text parts are capped
    # an image that cannot be opened, or a part without its image: an error text for the model, not a crash
    for bad in ({"type": "image", "image": b"not a png"}, {"type": "image"}):
        message, error = run_tool_call({"name": "f", "arguments": {}}, {"f": lambda: bad}, images=True)
        assert error is not None and error.startswith("Error:") and "f" in error
        assert message["content"] == [{"type": "text", "text": error}]


def test_episodes_feed_a_tool_image_through_the_processor(vlm):
    _, processor = vlm
    tok = processor.tokenizer
    prompt = picture_rows(1)[0]["prompt"]
    schemas = tool_schemas([crop])
    episodes = Episodes(tok, [prompt], [{"crop": crop}], [schemas], max_iterations=1, timeout=5, processor=processor)
    turn = _call(tok, x=2)
    (fed,) = episodes([0], [turn])
    ids, vision = fed
    image_id = tok.convert_tokens_to_ids("<image>")
    assert ids.count(image_id) == 16 and vision["pixel_values"].shape == (1, 3, 32, 32)  # 16 tokens per image
    message = episodes.turns[0][1]
    assert message["role"] == "tool" and [p["type"] for p in message["content"]] == ["image", "text"]
    text = continuation_text(tok, prompt + episodes.turns[0][:1], [message], tools=schemas)
    assert text.count("<image>") == 1 and ids == encode_tool_turn(processor, text, [PICTURE], ["crop"])[0]
    assert episodes.start[0] == len(turn) + len(ids)  # the next turn is read after the fed ids


def test_idefics3_tool_turn_is_split_and_marked_as_its_processor_does(idefics3):
    _, processor = idefics3
    tok = processor.tokenizer

    def wide():
        """Show the wide picture."""
        return WIDE

    prompt = picture_rows(1)[0]["prompt"]
    schemas = tool_schemas([wide])
    episodes = Episodes(tok, [prompt], [{"wide": wide}], [schemas], max_iterations=1, timeout=5, processor=processor)
    (fed,) = episodes([0], [_call(tok, "wide")])
    ids, vision = fed
    text = continuation_text(tok, prompt + episodes.turns[0][:1], [episodes.turns[0][1]], tools=schemas)
    expected = processor(text=[text], images=[[WIDE]], return_tensors="pt", add_special_tokens=False)
    assert ids == expected["input_ids"][0].tolist()
    shown = tok.decode(ids)
    assert shown.count("<fake_token_around_image>") == 4 and "<row_1_col_2><image>" in shown  # 2 crops
    assert "<global-img><image>" in shown and ids.count(processor.image_token_id) == 3 * 4
    assert vision["pixel_values"].shape == (1, 3, 3, 32, 32) and vision["pixel_attention_mask"].shape == (1, 3, 32, 32)


def test_images_per_episode_are_capped_with_an_error_for_the_model(vlm):
    _, processor = vlm
    tok = processor.tokenizer

    def two(x: int):
        """Two crops.

        Args:
            x: The left edge.
        """
        return [PICTURE, PICTURE.rotate(90)]

    episodes = Episodes(tok, [[{"role": "user", "content": "look"}]], [{"two": two}], [tool_schemas([two])],
                        max_iterations=2, timeout=5, processor=processor, max_images=1)
    (fed,) = episodes([0], [_call(tok, "two", x=1)])
    assert isinstance(fed, list)  # no image fed: the result is an error text
    content = episodes.turns[0][1]["content"]
    assert "may hold at most 1 (max_tool_images)" in content and episodes.failures == [1] and episodes.images == [0]


def test_a_template_that_drops_tool_images_is_refused_naming_the_tool(vlm):
    from transformers import AutoProcessor

    from posttrain.models.tiny import tiny_model_path

    processor = AutoProcessor.from_pretrained(tiny_model_path("tiny-llava"))
    processor.tokenizer.chat_template = processor.tokenizer.chat_template.replace("{{ '<image>' }}", "")
    tok = processor.tokenizer
    episodes = Episodes(tok, [[{"role": "user", "content": "look"}]], [{"crop": crop}], [tool_schemas([crop])],
                        max_iterations=1, timeout=5, processor=processor)
    with pytest.raises(ToolImageError, match=r"\['crop'\] returned 1 image.*does not render the image parts"):
        episodes([0], [_call(tok, x=1)])


TOOL_TURN = "<|im_end|>\n<|im_start|>tool\n<image>the crop<|im_end|>\n<|im_start|>assistant\n"


class ImageScript:
    """continue_turn that feeds one tool turn with `image` after each row's first turn and ends the row after its
    second (every token ends a turn of the random model: no tool call is parsed, the script stands for one)."""

    def __init__(self, processor, image):
        self.processor, self.image, self.seen = processor, image, set()

    def __call__(self, rows, tokens):
        out = []
        for i in rows:
            out.append(None if i in self.seen else encode_tool_turn(self.processor, TOOL_TURN, [self.image], ["crop"]))
            self.seen.add(i)
        return out


def _image_rollout(vlm, image, max_new_tokens: int = 80):
    model, processor = vlm
    tok = processor.tokenizer
    ids, vision = encode_image_prompts(processor, picture_rows(1))
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, num_generations=2, stop_token_ids=tuple(range(len(tok))))
    return generate(model, ids, sampling, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                    generator=torch.Generator().manual_seed(3), vision=vision,
                    continue_turn=ImageScript(processor, image))


# model -> (its tool image, the image tokens it becomes): the LLaVA's 16; Idefics3's 4 per crop, 2 crops and the
# global view, while the prompt's 32x32 picture becomes 4 crops and the global view (64 pixels: 2x2 crops)
TOOL_IMAGES = {"vlm": (PICTURE, 16), "idefics3": (WIDE, 12)}


@pytest.fixture(scope="module", params=sorted(TOOL_IMAGES))
def image_rollout(request):
    """(model, processor, a rollout whose rows were each fed one tool image, the image tokens of that image)."""
    model, processor = request.getfixturevalue(request.param)
    image, tokens = TOOL_IMAGES[request.param]
    return model, processor, _image_rollout((model, processor), image), tokens


def test_sampler_logprobs_equal_the_training_forward_with_tool_images(image_rollout):
    model, processor, r, tokens = image_rollout
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    images = r.completion_ids == image_id
    assert images.sum(1).tolist() == [tokens, tokens]  # each row was fed one tool image
    assert (r.tool_mask[images] == 1).all()  # its image tokens are fed: out of the loss, the KL and the entropy
    loss_mask = r.completion_mask * (1 - r.tool_mask)
    assert loss_mask[images].sum() == 0 and loss_mask.sum() > 0
    # each row's images: its prompt's, then its tool's; each row its own image group (no prompt packing)
    assert r.vision[PIXELS + "pixel_values" + ".count"].tolist() == [2, 2]
    assert r.vision[IMAGE_GROUP].unique().numel() == 2
    with torch.no_grad():
        logp, _ = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                      vision=r.vision)
    sampled = loss_mask.bool()
    after = sampled & (torch.cumsum(images, 1) > 0)  # sampled tokens after the tool image
    assert after.sum() > 0
    torch.testing.assert_close(r.logprobs[sampled], logp[sampled], atol=1e-4, rtol=1e-4)


def test_changing_the_tool_image_changes_the_logprobs_after_it(image_rollout):
    model, processor, r, _ = image_rollout
    other = dict(r.vision)
    pixels = other[PIXELS + "pixel_values"].clone()
    pixels[:, 1] = -pixels[:, 1]  # the tool's image (each row's second), negated
    other[PIXELS + "pixel_values"] = pixels
    with torch.no_grad():
        same, _ = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                      vision=r.vision)
        moved, _ = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                       vision=other)
    seen = torch.cumsum(r.completion_ids == processor.tokenizer.convert_tokens_to_ids("<image>"), 1) > 0
    before = r.completion_mask.bool() & ~seen
    after = r.completion_mask.bool() & seen & (r.tool_mask == 0)
    torch.testing.assert_close(same[before], moved[before])
    assert (same[after] - moved[after]).abs().max() > 1e-3


def test_a_tool_turn_with_images_that_does_not_fit_ends_the_row_truncated(vlm):
    r = _image_rollout(vlm, PICTURE, max_new_tokens=34)  # the 34-token tool turn cannot follow the 1-token first turn
    assert r.is_truncated.all() and r.tool_mask.sum() == 0
    assert r.vision[PIXELS + "pixel_values" + ".count"].tolist() == [1, 1]  # the prompt's image only


def test_an_engine_without_image_features_refuses_tool_images(vlm):
    _, processor = vlm

    def generate_turn(prompts, sampling):
        from posttrain.rollout.multiturn import rollout_from_func

        n = len(prompts) * sampling.num_generations
        rollout, _ = rollout_from_func({"prompt_ids": [p for p in prompts for _ in range(sampling.num_generations)],
                                        "completion_ids": [[1, 2]] * n, "logprobs": [[-1.0, -1.0]] * n}, n, 0, 2)
        return rollout

    with pytest.raises(ToolImageError, match="use_vllm=False"):
        engine_turns(generate_turn, [[5, 6]], SamplingConfig(max_new_tokens=50, num_generations=1),
                     ImageScript(processor, PICTURE), pad_token_id=0, eos_token_id=2)


def test_a_model_with_grid_rotary_positions_refuses_tool_images_naming_its_type():
    """Qwen2-VL's positions (mrope) lay an image's tokens on its grid; the sampler feeds a tool turn one position per
    token, so a tool image there would be seen at other positions than in the training forward: refused."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from posttrain.rollout.backends import ModelForward

    config = Qwen2VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3], rope_theta=1e4)),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=1),
        image_token_id=60)
    backend = ModelForward(Qwen2VLForConditionalGeneration(config))
    pixels = {"pixel_values": torch.zeros(4, 3 * 4 * 4), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    with pytest.raises(ToolImageError, match=r"'qwen2_vl' model \(Qwen2VLForConditionalGeneration\).*mrope"):
        backend.image_embeddings([60, 5], pixels)
