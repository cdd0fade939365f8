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

__all__ = ["vision_parts", "freeze_vision_parts", "language_model_only_lora"]


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
