"""The vision-language SFT workload of vs_trl.py (`vlm_sft`): one run by TRL or by posttrain. Started by vs_trl.py.

    python benchmarks/vs_trl_vlm_worker.py SPEC.json      # writes the result JSON to SPEC["out"]

Both sides train the same LLaVA built from a config with random weights (speed needs no trained weights):
a 4-layer CLIP vision tower (hidden 256) on 64x64 images in 8x8 patches (64 image tokens per image), a GELU
projector, and SmolLM2-135M's architecture as the language model, with SmolLM2's tokenizer plus an `<image>`
token and posttrain's vision ChatML template. Its processor uses transformers' PIL image backend
(`CLIPImageProcessorPil`), as neither environment has torchvision. `prepare` (run once by vs_trl.py, in the
main environment) builds the folder and writes 256 rows of posttrain's visual task (prompt-completion
conversations, one image each, saved as PNG files) that both sides load as PIL images.

Both get the model folder, the processor saved in it as `processing_class`, the same rows, seed and
configuration (completion-only loss, no truncation); the token count of a step is the real tokens of its
batch with the images expanded (the processor's attention mask), counted in the collator both libraries call.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from vs_trl_worker import common_args, start, train_and_measure, trainer_classes, write_result

IMAGE_SIZE, PATCH, ROWS = 64, 8, 256
VISION = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=256)


def prepare(cache: Path, causal: str) -> tuple[str, str, float]:
    """(the VLM folder, the rows' JSON file, the mean attention context of a row's tokens), built once."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from posttrain.data.chat import vision_chat_template
    from posttrain.tasks.vision import vision_dataset

    folder, rows_file = cache / "llava-smollm2-random", cache / "vlm-rows.json"
    if not (folder / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(causal)
        tokenizer.add_tokens(["<image>"], special_tokens=True)
        tokenizer.chat_template = vision_chat_template("<image>")
        images = CLIPImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_center_crop=False)
        processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=tokenizer.chat_template, image_token="<image>")
        text = AutoConfig.from_pretrained(causal)
        text.vocab_size = len(tokenizer)
        config = LlavaConfig(vision_config=CLIPVisionConfig(**VISION), text_config=text,
                             image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                             vision_feature_select_strategy="default", vision_feature_layer=-1,
                             image_seq_length=(IMAGE_SIZE // PATCH) ** 2, pad_token_id=tokenizer.pad_token_id,
                             tie_word_embeddings=True)
        torch.manual_seed(0)
        model = LlavaForConditionalGeneration(config)
        tmp = Path(tempfile.mkdtemp(dir=cache))
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        tmp.rename(folder)
    if not rows_file.exists():
        pictures = cache / "vlm-images"
        pictures.mkdir(exist_ok=True)
        rows = []
        for i, row in enumerate(vision_dataset("train", ROWS)):
            path = pictures / f"{i}.png"
            row["images"][0].save(path)
            rows.append({"prompt": row["prompt"], "completion": row["completion"], "images": [str(path)]})
        rows_file.write_text(json.dumps(rows))
    tokens = 4 + (IMAGE_SIZE // PATCH) ** 2 + 20  # role markers, image tokens, question and answer: the context
    return str(folder), str(rows_file), (tokens + 1) / 2


def main():
    spec = start()
    from datasets import Dataset
    from PIL import Image
    from transformers import AutoProcessor

    side, cfg = spec["side"], spec["config"]
    Config, Trainer = trainer_classes(side, "sft")
    rows = json.load(open(spec["data"]))
    for row in rows:  # PIL images on both sides: the one image type both libraries take
        row["images"] = [Image.open(p).convert("RGB") for p in row["images"]]
    data = Dataset.from_list(rows)
    args = Config(**common_args(spec), remove_unused_columns=False, **cfg)
    processor = AutoProcessor.from_pretrained(spec["model"])
    trainer = Trainer(model=spec["model"], args=args, train_dataset=data, processing_class=processor)
    counts: list[int] = []  # real tokens of each batch, images expanded, in the order the trainer asks for them
    inner = trainer.data_collator

    def collate(batch):
        out = inner(batch)
        counts.append(int(out["attention_mask"].sum()))
        return out

    trainer.data_collator = collate
    write_result(spec, {**train_and_measure(trainer, spec), "sft_tokens": counts})


if __name__ == "__main__":
    main()
