"""A tool that returns an image: posttrain's rollouts feed tool results to the model as text tokens, so an image
result (a PIL image, an image content part, a list of parts holding one) stops the rollout with an error naming
the tool, instead of showing the model the image's repr; results that merely mention images still pass."""

import json

import pytest
from PIL import Image

from posttrain.data.tools import tool_schemas
from posttrain.models.loading import load_tokenizer
from posttrain.rollout.multiturn import Episodes
from posttrain.rollout.tools import ToolImageError, run_tool_call

PICTURE = Image.new("RGB", (8, 8), (200, 30, 30))


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
