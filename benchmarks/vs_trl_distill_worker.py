"""One benchmark run of a distillation-family workload (distillation, GKD, GOLD, IW-OPD, SDPO) by one library: TRL
1.16 or posttrain. Started by vs_trl.py.

    python benchmarks/vs_trl_distill_worker.py SPEC.json      # writes the result JSON to SPEC["out"]

The spec, the result and the step clock are vs_trl_worker.py's (imported from it: it imports no library at
module level), so vs_trl.py summarises these runs as it does the others. Both sides get the same student (the
causal LM folder), the same teacher object (SmolLM2 with seeded noise on every weight, made once by vs_trl.py:
the same tokenizer, other distributions) and the same prompts; the completions are the student's own samples
(lmbda=1), so the work of a step is: sample, one teacher forward, one student forward and backward.
TRL's DistillationTrainer is `trl.DistillationTrainer`, its GKDTrainer `trl.experimental.gkd.GKDTrainer`
(an SFT-based trainer that reads a `messages` column: the GKD workload's rows are prompt + a short answer,
which with lmbda=1 only fixes the prompts). Samples per step are the completions the teacher scored: on TRL's side
the rows its decoder body ran on (a forward pre-hook), on posttrain's the rows of its teacher forwards
(`completion_logits` / `completion_logprobs` without gradients), which pack the completions that share a prompt
into one sequence.
GOLD (`trl.experimental.gold`) reads `messages` rows as GKD and runs its ULD loss (`use_uld_loss=True`) with the
teacher's tokenizer given by path (the same vocabulary here: every token aligns one to one, but the text
re-encoding and the grouped sorted-probability loss run on both sides). IW-OPD (`trl.experimental.iw_opd`) is
the sampled-token importance-weighted objective on the student's samples of the `messages` rows' prompts (TRL's
IW-OPD reads that column). SDPO (`trl.experimental.sdpo`) has no teacher model (its teacher is an EMA of the
student shown a successful peer): it gets a reward function instead, 1.0 for a completion of at least 60
characters, and its samples per step are the completions the reward scored.
"""

from __future__ import annotations

import importlib
import json

from vs_trl_worker import common_args, start, train_and_measure, write_result

# kind -> (TRL module, posttrain module, class prefix)
TRAINERS = {"distillation": ("trl", "posttrain.trainers.distillation", "Distillation"),
            "gkd": ("trl.experimental.gkd", "posttrain.trainers.gkd", "GKD"),
            "gold": ("trl.experimental.gold", "posttrain.trainers.gold", "GOLD"),
            "iw_opd": ("trl.experimental.iw_opd", "posttrain.trainers.iw_opd", "IWOPD"),
            "sdpo": ("trl.experimental.sdpo", "posttrain.trainers.sdpo", "SDPO")}
# the posttrain modules whose teacher forwards (`completion_logits` / `completion_logprobs` without gradients) count
TEACHER_FORWARDS = ("posttrain.trainers.distillation", "posttrain.trainers.iw_opd", "posttrain.trainers.gold")


def trainer_classes(side: str, kind: str):
    trl_module, ours, prefix = TRAINERS[kind]
    lib = importlib.import_module(trl_module if side == "trl" else ours)
    return getattr(lib, f"{prefix}Config"), getattr(lib, f"{prefix}Trainer")


# posttrain's options that TRL 1.16's DistillationConfig lacks, at the value that is TRL's fixed behaviour
# (lmbda 1.0: every completion sampled by the student; loss_top_k 0: the divergence over the whole vocabulary)
TRL_FIXED = {"lmbda": 1.0, "loss_top_k": 0}


def trl_fields(Config, config: dict) -> dict:
    """`config` without the keys TRL's `Config` has no field for, which must then hold TRL's fixed behaviour."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(Config)}
    for key in set(config) - names:
        if key not in TRL_FIXED or config[key] != TRL_FIXED[key]:
            raise SystemExit(f"{Config.__name__} of TRL has no field {key!r}: the runs would not do the same work")
    return {k: v for k, v in config.items() if k in names}


def long_enough(completions, **kwargs) -> list[float]:
    """SDPO's reward: 1.0 for a completion of at least 60 characters (its text, or its last message's content)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(t) >= 60) for t in texts]


def count_teacher_rows(side: str, teacher, scored: list) -> None:
    """Append to `scored` the rows of each teacher forward: posttrain's (packed) teacher calls, TRL's decoder."""
    import torch

    if side == "trl":
        teacher.get_decoder().register_forward_pre_hook(
            lambda module, a, kw: scored.append((kw.get("input_ids") if kw.get("input_ids") is not None
                                                 else kw["inputs_embeds"]).shape[0]), with_kwargs=True)
        return
    for name in TEACHER_FORWARDS:  # its teacher's forward packs the rows that share a prompt: the completions scored
        module = importlib.import_module(name)
        for fn in ("completion_logits", "completion_logprobs"):
            if hasattr(module, fn):
                def counted(model, mb, *a, _inner=getattr(module, fn), **kwargs):
                    if not torch.is_grad_enabled():  # the teacher's forward (the student's trains with gradients)
                        scored.append((mb if isinstance(mb, torch.Tensor) else mb["completion_ids"]).shape[0])
                    return _inner(model, mb, *a, **kwargs)
                setattr(module, fn, counted)


def build(spec: dict):
    """(trainer, rows the teacher scored per call)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    side, kind = spec["side"], spec["trainer"]
    Config, Trainer = trainer_classes(side, kind)
    config = dict(spec["config"])
    if kind == "gold":  # the teacher's tokenizer, by path (TRL's GOLD loads it from there)
        config["teacher_tokenizer_name_or_path"] = spec["models"]["teacher"]
    args = Config(**common_args(spec), **trl_fields(Config, config) if side == "trl" else config)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    data = Dataset.from_list(json.load(open(spec["data"])))
    scored: list[int] = []
    if kind == "sdpo":  # self-distillation: no teacher model; the samples are the completions the reward scored
        def reward(completions, **kwargs):
            scored.append(len(completions))
            return long_enough(completions)
        return Trainer(model=spec["model"], reward_funcs=[reward], args=args, train_dataset=data,
                       processing_class=tokenizer), scored
    teacher = AutoModelForCausalLM.from_pretrained(spec["models"]["teacher"], dtype=torch.float32)
    if side == "posttrain":  # its one-row check that the output layer is plain, made here: not a sample
        from posttrain.forward.logprobs import plain_lm_head

        plain_lm_head(teacher, torch.zeros(1, 8, dtype=torch.long))
    count_teacher_rows(side, teacher, scored)
    trainer = Trainer(model=spec["model"], teacher_model=teacher, args=args, train_dataset=data,
                      processing_class=tokenizer)
    return trainer, scored


def main():
    spec = start()
    trainer, scored = build(spec)
    samples: list[int] = []  # rows the teacher scored in each step

    from transformers import TrainerCallback

    class PerStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            samples.append(sum(scored))
            scored.clear()

    trainer.add_callback(PerStep())
    write_result(spec, {**train_and_measure(trainer, spec), "samples": samples})


if __name__ == "__main__":
    main()
