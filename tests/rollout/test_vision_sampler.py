"""The online engine's pixel path on the tiny VLM: the sampler prefills each prompt's images once per group and
decodes from a KV cache that holds the image tokens; the training forward passes the pixels, encoding each
distinct prompt's images once; prompts with the same text and different images are never merged."""

import pytest
import torch
from tests.helpers.vision import tiny_vlm_with_visible_images

from posttrain.forward.completions import completion_logprobs
from posttrain.forward.vision import IMAGE_GROUP, forward_inputs, prompt_inputs, row_inputs
from posttrain.rollout.generate import SamplingConfig, generate
from posttrain.rollout.images import encode_image_prompts


@pytest.fixture(scope="module")
def vlm():
    return tiny_vlm_with_visible_images()


def rows(n: int, same_text: bool = False):
    from posttrain.tasks.vision import vision_dataset

    data = vision_dataset("train", size=n, kinds=("color",) if same_text else ("color", "count"))
    return [data[i] for i in range(n)]


class TowerCalls:
    """Counts the vision tower's forwards and the images each one encoded."""

    def __init__(self, model):
        self.images = []
        def count(module, args, kwargs, output):
            self.images.append(len(args[0] if args else kwargs["pixel_values"]))

        self.handle = model.model.vision_tower.register_forward_hook(count, with_kwargs=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def test_sampler_encodes_each_prompt_once_and_decodes_from_the_image_tokens(vlm):
    model, processor = vlm
    ids, vision = encode_image_prompts(processor, rows(2))
    assert all(v["pixel_values"].shape[0] == 1 for v in vision)  # one image per prompt
    tok = processor.tokenizer
    with TowerCalls(model) as calls:
        out = generate(model, ids, SamplingConfig(max_new_tokens=5, num_generations=4), pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id, generator=torch.Generator().manual_seed(0), vision=vision)
    assert calls.images == [2]  # one tower forward, 2 images: not 8 (one per sample)
    assert out.vision[IMAGE_GROUP].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]

    # the sampler's log-probs are those of a full forward of [prompt | completion] with the pixels: the cache held
    # the image tokens (without the pixels, the log-probs differ)
    with TowerCalls(model) as calls, torch.no_grad():
        logp, _ = completion_logprobs(model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask,
                                      vision=out.vision)
    assert calls.images == [2]  # the training forward: each distinct prompt's image once, not once per completion
    mask = out.completion_mask.bool()
    torch.testing.assert_close(logp[mask], out.logprobs[mask], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        blind, _ = completion_logprobs(model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
    assert (blind[mask] - out.logprobs[mask]).abs().max() > 1e-3


def test_prompts_with_the_same_text_and_other_images_stay_apart(vlm):
    model, processor = vlm
    data = rows(2, same_text=True)
    ids, vision = encode_image_prompts(processor, data)
    assert ids[0] == ids[1] and not torch.equal(vision[0]["pixel_values"], vision[1]["pixel_values"])
    tok = processor.tokenizer
    out = generate(model, ids, SamplingConfig(max_new_tokens=4, num_generations=2), pad_token_id=tok.pad_token_id,
                   eos_token_id=tok.eos_token_id, generator=torch.Generator().manual_seed(1), vision=vision)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask,
                                      vision=out.vision)
    mask = out.completion_mask.bool()
    torch.testing.assert_close(logp[mask], out.logprobs[mask], atol=1e-5, rtol=1e-5)
    # each row scored alone with its own image gives the same
    for r in range(len(ids) * 2):
        with torch.no_grad():
            alone, _ = completion_logprobs(model, out.prompt_ids[r:r + 1], out.prompt_mask[r:r + 1],
                                           out.completion_ids[r:r + 1], out.completion_mask[r:r + 1],
                                           vision={k: v[r:r + 1] for k, v in out.vision.items()})
        torch.testing.assert_close(alone[mask[r:r + 1]], logp[r][mask[r]], atol=1e-5, rtol=1e-5)


def test_row_inputs_pad_and_forward_inputs_unpad():
    a = {"pixel_values": torch.arange(2 * 3).float().view(2, 3), "image_sizes": torch.tensor([[4, 4], [5, 5]])}
    b = {"pixel_values": torch.full((1, 3), -1.0), "image_sizes": torch.tensor([[6, 6]])}
    assert torch.equal(prompt_inputs([a, b])["pixel_values"], torch.cat([a["pixel_values"], b["pixel_values"]]))
    rows_ = row_inputs([a, b, {}], group=2, first_group=5)
    assert rows_[IMAGE_GROUP].tolist() == [5, 5, 6, 6, 7, 7]
    assert rows_["pixels.pixel_values"].shape == (6, 2, 3, 1)  # a trailing 1: never 2-D, never trimmed as columns
    assert rows_["pixels.pixel_values.count"].tolist() == [2, 2, 1, 1, 0, 0]
    got = forward_inputs(rows_, torch.tensor([3, 0, 4]))  # prompt b, prompt a, the prompt without images
    assert torch.equal(got["pixel_values"], torch.cat([b["pixel_values"], a["pixel_values"]]))
    assert got["image_sizes"].tolist() == [[6, 6], [4, 4], [5, 5]]


def test_generate_refuses_images_for_a_different_number_of_prompts(vlm):
    model, processor = vlm
    ids, vision = encode_image_prompts(processor, rows(2))
    with pytest.raises(ValueError, match="got 1 prompts' images"):
        generate(model, ids, SamplingConfig(max_new_tokens=2), pad_token_id=0, eos_token_id=1, vision=vision[:1])


def test_suppressed_tokens_are_never_sampled_and_log_probs_stay_the_whole_distributions(vlm):
    model, processor = vlm
    ids, vision = encode_image_prompts(processor, rows(2))
    tok = processor.tokenizer

    def sample(**kw):
        return generate(model, ids, SamplingConfig(max_new_tokens=3, do_sample=False, **kw),
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, vision=vision)

    free = sample()
    first = tuple(sorted(set(free.completion_ids[:, 0].tolist())))
    held = sample(suppress_token_ids=first)
    assert not set(held.completion_ids[:, 0].tolist()) & set(first)
    with torch.no_grad():  # the kept log-prob is under softmax(logits / T) over every token, as the trainer computes it
        logp, _ = completion_logprobs(model, held.prompt_ids, held.prompt_mask, held.completion_ids,
                                      held.completion_mask, vision=held.vision)
    mask = held.completion_mask.bool()
    torch.testing.assert_close(logp[mask], held.logprobs[mask], atol=1e-5, rtol=1e-5)
