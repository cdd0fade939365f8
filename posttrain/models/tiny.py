"""Offline tokenizer and deterministic tiny models, for tests, examples and the demo.

Nothing here touches the network. The tokenizer is a byte-level BPE shipped with the package
(`tiny_tokenizer.json`), with digits split one per token so arithmetic-style tasks stay
learnable; it was trained once with `train_tokenizer` and is loaded, never retrained, so every
machine gets the same ids. The models are small Qwen2- and Llama-style configs whose weights
come from a fixed seed. Each is built once into a cache folder (``$POSTTRAIN_CACHE`` or
``~/.cache/posttrain``) and then loaded with the ordinary ``from_pretrained`` calls.
"""

from __future__ import annotations

import codecs
import hashlib
from pathlib import Path

from posttrain.cache import build_in, cache_dir
from posttrain.data.chat import CHATML_TEMPLATE, IM_END, IM_START, vision_chat_template

PAD_TOKEN = "<|endoftext|>"

# name -> (architecture, config overrides). Small enough for CPU tests, big enough to learn
# the built-in tasks in minutes.
TINY_MODELS = {
    "tiny-qwen2": ("qwen2", dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)),
    "tiny-llama": ("llama", dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)),
    "small-qwen2": ("qwen2", dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2)),
}
# Vision-language models: name -> (architecture, vision-tower overrides). The language model is
# tiny-qwen2's config; images are IMAGE_SIZE pixels square, cut into PATCH-pixel patches, so each
# image becomes (IMAGE_SIZE // PATCH)^2 = 16 image tokens. LLaVA is the architecture because its
# processor runs on the PIL image-processing backend: transformers 5's Qwen2-VL, SmolVLM and
# Idefics3 processors also load a video processor that needs torchvision, which posttrain does not
# depend on.
IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH = 32, 8
TINY_VLMS = {
    "tiny-llava": ("llava", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)),
}
SEED = 1234
VOCAB_SIZE = 1024
TOKENIZER_FILE = Path(__file__).with_name("tiny_tokenizer.json")  # package data (pyproject.toml)


def build_tokenizer():
    """The shipped byte-level BPE tokenizer, wrapped for transformers (ChatML template, right padding)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(TOKENIZER_FILE)), pad_token=PAD_TOKEN, eos_token=IM_END,
        additional_special_tokens=[IM_START], model_max_length=2048,
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.padding_side = "right"
    return fast


def _tiny_config(name: str, tokenizer, num_labels: int | None = None):
    from transformers import AutoConfig

    arch, overrides = TINY_MODELS[name]
    config = AutoConfig.for_model(
        arch, vocab_size=len(tokenizer), max_position_embeddings=1024, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, **overrides,
    )
    if num_labels is not None:
        config.num_labels = num_labels
    return config


def tiny_model_path(name: str, task: str = "causal-lm") -> Path:
    """Folder of the tiny model `name` (a key of TINY_MODELS), built on first use.

    task: "causal-lm" or "seq-cls" (the sequence-classification twin: same body, one-output score head).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if name in TINY_VLMS:
        return tiny_vlm_path(name)
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {sorted(TINY_MODELS) + sorted(TINY_VLMS)}")
    suffix = "" if task == "causal-lm" else "-seqcls"

    def build(folder: Path):
        tokenizer = build_tokenizer()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            if task == "causal-lm":
                model = AutoModelForCausalLM.from_config(_tiny_config(name, tokenizer))
            else:
                model = AutoModelForSequenceClassification.from_config(_tiny_config(name, tokenizer, num_labels=1))
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    # The folder name carries a hash of everything the folder is built from, so a folder built
    # from another tokenizer (earlier versions trained theirs per Python release) is never reused.
    recipe = TOKENIZER_FILE.read_bytes() + repr((CHATML_TEMPLATE, TINY_MODELS[name], SEED, task)).encode()
    key = hashlib.sha256(recipe).hexdigest()[:12]
    return build_in(cache_dir() / f"{name}{suffix}-{key}", build)


# --------------------------------------------------------------------------- the tiny vision-language model

def build_vlm_processor(tokenizer=None):
    """The tiny VLM's processor: the shipped tokenizer with an `<image>` token, the vision chat template
    (ChatML whose content may be a list of image and text parts) and a PIL-backend CLIP image processor
    that resizes every image to IMAGE_SIZE pixels square (no torchvision needed)."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = tokenizer or build_tokenizer()
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = vision_chat_template(IMAGE_TOKEN)
    images = CLIPImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_center_crop=False)
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=tokenizer.chat_template, image_token=IMAGE_TOKEN)


def _tiny_vlm_config(name: str, tokenizer):
    from transformers import AutoConfig, CLIPVisionConfig

    arch, vision = TINY_VLMS[name]
    text = _tiny_config("tiny-qwen2", tokenizer)
    return AutoConfig.for_model(
        arch, vision_config=CLIPVisionConfig(**vision), text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), projector_hidden_act="gelu",
        vision_feature_select_strategy="default", vision_feature_layer=-1, tie_word_embeddings=True,
        image_seq_length=(IMAGE_SIZE // PATCH) ** 2, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id)


def tiny_vlm_path(name: str = "tiny-llava") -> Path:
    """Folder of the tiny vision-language model `name` (a key of TINY_VLMS) with its processor, built on first use."""
    import torch
    from transformers import AutoModelForImageTextToText

    def build(folder: Path):
        processor = build_vlm_processor()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = AutoModelForImageTextToText.from_config(_tiny_vlm_config(name, processor.tokenizer))
        model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
        model.save_pretrained(folder)
        processor.save_pretrained(folder)

    recipe = TOKENIZER_FILE.read_bytes() + repr((vision_chat_template(IMAGE_TOKEN), TINY_VLMS[name],
                                                 TINY_MODELS["tiny-qwen2"], IMAGE_SIZE, PATCH, SEED)).encode()
    key = hashlib.sha256(recipe).hexdigest()[:12]
    return build_in(cache_dir() / f"{name}-{key}", build)


# --------------------------------------------------------------------------- regenerating the tokenizer

def _training_text() -> list[str]:
    import contextlib
    import io

    import pydoc_data.topics

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    zen = codecs.decode(this.s, "rot13")
    pages = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    digits = " ".join(f"{i}+{j}={i + j}" for i in range(10) for j in range(10))
    return [zen] * 20 + pages + [digits]


def train_tokenizer():
    """Train the byte-level BPE that `tiny_tokenizer.json` holds; only used to rewrite that file.

    `python -m posttrain.models.tiny` rewrites it. The training text includes the running Python's
    pydoc pages, which change between Python releases (3.11.2 and 3.11.7 give different merges),
    so the file, not this function, is the tokenizer: rewriting it changes every tiny model.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD_TOKEN, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    return tok


if __name__ == "__main__":
    train_tokenizer().save(str(TOKENIZER_FILE), pretty=True)
    print(f"wrote {TOKENIZER_FILE}")
