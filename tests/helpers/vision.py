"""The tiny VLM as the sampler tests use it."""

import torch


def tiny_vlm_with_visible_images():
    """posttrain/tiny-llava (eval mode) and its processor, its projector scaled by 8: the random tower's features
    then move the logits enough for a test to see which image a row was given."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from posttrain.models.tiny import tiny_model_path

    path = tiny_model_path("tiny-llava")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(path)
    with torch.no_grad():
        for p in model.model.multi_modal_projector.parameters():
            p.mul_(8.0)
    return model.eval(), AutoProcessor.from_pretrained(path)
