"""Vision-language models: which part is which, freezing parts, and LoRA on the language model only.

transformers' image-text models are a vision tower (an image encoder), a projector that maps its
features into the language model's embedding space, and the language model. Their attribute names
differ by family: LLaVA, Gemma 3, Mistral 3 `vision_tower` + `multi_modal_projector`; Idefics3 /
SmolVLM `vision_model` + `connector`; Qwen2-VL / Qwen2.5-VL / Qwen3-VL `visual` with its projector
`visual.merger`. The parts are found by those names at any depth.
"""

from __future__ import annotations

import dataclasses
import logging

logger = logging.getLogger(__name__)

VISION_TOWERS = ("vision_tower", "vision_model", "visual", "vision_encoder")
PROJECTORS = ("multi_modal_projector", "connector", "merger", "mm_projector", "visual_projection")

__all__ = ["vision_parts", "freeze_vision_parts", "language_model_only_lora", "vision_run", "vision_scorer",
           "load_vision_scorer", "grid_positions"]


def grid_positions(model) -> bool:
    """Whether a vision-language model places its tokens with multimodal rotary positions computed from the
    images' grids (`get_rope_index`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, ...): an image's tokens share
    positions laid out on its grid (image_grid_thw), so a token's position is not its index in the sequence."""
    return any(callable(getattr(m, "get_rope_index", None)) for m in (model, getattr(model, "model", None)))


def vision_run(model, dataset, trainer: str) -> bool:
    """Whether a trainer trains `model` as a vision-language model: it is one (an object with a vision tower,
    or a checkpoint whose config has one). A dataset with images and a text-only model is refused."""
    from posttrain.data.multimodal import image_column, is_vision_model, refuse_text_only
    from posttrain.models.loading import is_vision_checkpoint

    vision = is_vision_checkpoint(model) if isinstance(model, str) else is_vision_model(model)
    column = image_column(dataset) if dataset is not None else None
    if not vision and column is not None:
        refuse_text_only(model, trainer, column)
    return vision


def vision_parts(model, names: tuple[str, ...]) -> list[tuple[str, object]]:
    """(qualified name, module) of the outermost submodules of `model` whose own name is one of `names`."""
    found: list[tuple[str, object]] = []
    for qualified, module in model.named_modules():
        if qualified.rsplit(".", 1)[-1] in names and not any(qualified.startswith(f + ".") for f, _ in found):
            found.append((qualified, module))
    return found


def freeze_vision_parts(model, vision_tower: bool = False, projector: bool = False) -> list[str]:
    """Stop training the vision tower and/or the projector (requires_grad False); the names of the frozen
    modules are returned. A part asked for that the model does not have is an error naming what was looked for."""
    frozen = []
    for wanted, names, option in ((vision_tower, VISION_TOWERS, "freeze_vision_tower"),
                                  (projector, PROJECTORS, "freeze_multi_modal_projector")):
        if not wanted:
            continue
        parts = vision_parts(model, names)
        if not parts:
            raise ValueError(f"{option}=True, but {type(model).__name__} has no submodule named any of {list(names)}: "
                             f"it is not a vision-language model this option knows")
        for name, module in parts:
            if option == "freeze_vision_tower":  # a projector inside the tower (Qwen2-VL's merger) stays trained
                keep = {id(p) for _, m in vision_parts(module, PROJECTORS) for p in m.parameters()}
                for p in module.parameters():
                    if id(p) not in keep:
                        p.requires_grad_(False)
            else:
                module.requires_grad_(False)
            frozen.append(name)
    if frozen:
        logger.info(f"frozen (not trained): {frozen}")
    return frozen


def language_model_only_lora(peft_config, model):
    """`peft_config` whose adapters stay out of the vision tower and the projector: a LoRA config naming
    `target_modules` by name ("q_proj", "all-linear", ...) would otherwise also wrap the vision tower's
    layers of the same name. Set as peft's `exclude_modules` (a regex over the module names) where the config
    gives none; a config that sets `exclude_modules` or targets by regex is the user's choice and kept."""
    if peft_config is None or not hasattr(peft_config, "exclude_modules"):
        return peft_config
    parts = [name for name, _ in vision_parts(model, VISION_TOWERS + PROJECTORS)]
    if not parts or peft_config.exclude_modules is not None or isinstance(peft_config.target_modules, str) \
            and peft_config.target_modules != "all-linear":
        return peft_config
    pattern = "^(" + "|".join(p.replace(".", r"\.") for p in parts) + r")(\..*)?$"
    return dataclasses.replace(peft_config, exclude_modules=pattern)


# --------------------------------------------------------------------------- a VLM with a score head

def _scorer_class():
    """VisionScorer, defined on first use (transformers is imported lazily)."""
    global VisionScorer
    if "VisionScorer" in globals():
        return VisionScorer
    import torch
    from transformers import AutoModel, PreTrainedModel
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast

    class VisionScorer(PreTrainedModel):
        """A vision-language model's body (vision tower, projector, language model: `AutoModel` of its config)
        under a linear score head read at each row's last non-padding token: a reward model for image-text
        rows, as `...ForSequenceClassification` is for text. Saved and loaded with `save_pretrained` /
        `load_vision_scorer`; `config.num_labels` outputs."""

        base_model_prefix = "model"
        _supports_sdpa = True
        _supports_attention_backend = True

        def __init__(self, config, body=None):
            super().__init__(config)
            self.model = body if body is not None else AutoModel.from_config(config)
            text = getattr(config, "text_config", config)
            self.score = torch.nn.Linear(text.hidden_size, config.num_labels, bias=False)
            self.post_init()

        def get_input_embeddings(self):
            return self.model.get_input_embeddings()

        def forward(self, input_ids=None, attention_mask=None, output_hidden_states=None, **kwargs):
            kwargs.pop("use_cache", None)
            kwargs.pop("return_dict", None)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                             output_hidden_states=output_hidden_states, **kwargs)
            scores = self.score(out.last_hidden_state)  # (B, T, num_labels)
            pad = self.config.pad_token_id
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            real = input_ids != pad if pad is not None else torch.ones_like(input_ids, dtype=torch.bool)
            last = (positions * real).argmax(-1)  # each row's last token that is not padding
            return SequenceClassifierOutputWithPast(logits=scores[torch.arange(len(last)), last],
                                                    hidden_states=out.hidden_states)

    globals()["VisionScorer"] = VisionScorer
    return VisionScorer


def vision_scorer(model, num_labels: int = 1):
    """`model` as a VisionScorer: a VisionScorer object as it is; a vision-language model (object) with its body
    and a new score head of `num_labels` outputs (untrained: an UntrainedHeadWarning says so)."""
    import copy
    import warnings

    from posttrain.models.loading import UntrainedHeadWarning

    scorer_class = _scorer_class()
    if isinstance(model, scorer_class):
        return model
    config = copy.deepcopy(model.config)
    config.num_labels = num_labels
    config.architectures = [scorer_class.__name__]
    body = model.model if hasattr(model, "model") else model.get_base_model()
    scorer = scorer_class(config, body=body).to(dtype=next(model.parameters()).dtype)
    warnings.warn(f"posttrain: {getattr(config, '_name_or_path', '') or type(model).__name__!r} is trained as a "
                  f"vision-language reward model: its body with a new, randomly initialised score head "
                  f"({num_labels} output(s))", UntrainedHeadWarning, stacklevel=3)
    return scorer


def load_vision_scorer(path: str, num_labels: int = 1, **kwargs):
    """A VisionScorer saved by `save_pretrained` (a trained vision reward model), or a vision-language checkpoint
    given a new score head (`vision_scorer`)."""
    from transformers import AutoConfig

    from posttrain.models.loading import load_vision_lm, resolve

    config = AutoConfig.from_pretrained(resolve(path))
    if (config.architectures or [None])[0] == "VisionScorer":
        return _scorer_class().from_pretrained(resolve(path), config=config, **kwargs)
    return vision_scorer(load_vision_lm(path, **kwargs), num_labels)
