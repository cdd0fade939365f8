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


def tiny_idefics3(folder, splitting: bool = False) -> str:
    """`folder` holding a second architecture built from a config: a tiny Idefics3 (SmolVLM's family: SigLIP-style
    tower, pixel-shuffle connector, Llama) and its processor (PIL backend), whose expansion surrounds each image's
    tokens with marker tokens (<fake_token_around_image><global-img>...) that the chat template never wrote; 4 image
    tokens per 32x32 crop. splitting: the processor cuts an image into 32x32 crops plus a global view (images up to
    64 pixels: up to 2x2 crops, each crop's tokens after its <row_i_col_j> marker), so images of different shapes
    have different numbers of crops."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from posttrain.data.chat import vision_chat_template
    from posttrain.models.tiny import build_tokenizer

    tok = build_tokenizer()
    images = Idefics3ImageProcessorPil(do_image_splitting=splitting, size={"longest_edge": 64 if splitting else 32},
                                       max_image_size={"longest_edge": 32})
    proc = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4,
                             chat_template=vision_chat_template("<image>"))
    tok.chat_template = proc.chat_template
    config = Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=192,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id),
        image_token_id=proc.image_token_id, scale_factor=2, tie_word_embeddings=True, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(folder)
    proc.save_pretrained(folder)
    return str(folder)
