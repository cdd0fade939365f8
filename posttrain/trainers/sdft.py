"""SDFT: Self-Distillation Fine-Tuning ("Self-Distillation Enables Continual Learning", 2026; TRL's experimental
SDFTTrainer).

The model is its own teacher: the student samples a completion of the prompt, and the teacher is the same model
shown the prompt together with privileged context (a demonstration, the answer, feedback: the dataset's
`privileged_context` column, joined to the prompt by `teacher_prompt_template`). The student learns, on its own
samples, the next-token distributions it would have had with the context in view, so it takes in a
demonstration's knowledge without being trained on the demonstration's tokens, and forgets less of what it
knew. Which model is the teacher: `teacher_model_kind="base"` the student's initial weights (frozen),
`"live"` the current student, `"ema"` an exponential moving average of the student (moved towards it by
`teacher_update_rate` every `teacher_sync_steps` optimizer steps).

The distillation preset (`posttrain.trainers.distillation`), fully on-policy: each completion gets a second
prompt, the teacher's (`teacher_inputs`), and the loss is the registered generalised JSD between the student's
distributions (its own prompt) and the teacher's (its prompt) at the same completion tokens, with
`distillation_alpha` as the interpolation (0: forward KL, 1: reverse KL), over the full vocabulary
(`distillation_mode="full_logits"`), the top-k support (`"topk_logits"`, `distillation_topk`,
`distillation_add_tail`) or the sampled token (`"sampled_token"`); the first `num_loss_tokens_to_skip` tokens of
each completion are left out of it.

Departures from TRL: `distillation_is_clip` is accepted and has no effect (one optimizer step per generation batch:
the importance ratio is 1); `generate_from_teacher` and TRL's reference-KL `beta` > 0 are refused; a chat prompt's
privileged context joins its last user message through the template.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from posttrain.core.divergences import sampled_reverse_kl, token_divergence
from posttrain.data.collate import pad as pad_rows
from posttrain.data.tokenize import encode_prompt
from posttrain.forward.completions import completion_logits, completion_logprobs
from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer

TEACHER_KINDS = ("base", "live", "ema")
MODES = ("full_logits", "topk_logits", "sampled_token")


@dataclass
class SDFTConfig(DistillationConfig):
    """TRL's SDFTConfig fields and defaults (its self-distillation fields included) on the distillation preset."""

    learning_rate: float = field(default=5e-5, metadata={"help": "Initial AdamW learning rate (TRL's SDFTConfig "
                                 "keeps transformers' default)."})
    lmbda: float = field(default=1.0, metadata={"help": "Always 1: SDFT distils on the student's own samples."})
    beta: float = field(default=0.0, metadata={"help": "TRL's reference-model KL coefficient: only 0 (no reference "
                        "model); the divergence's interpolation is distillation_alpha."})
    max_prompt_length: int | None = field(default=512, metadata={"help": "Keep the last this many prompt tokens "
                                          "(the teacher's prompt: the last this many plus the context's)."})
    max_completion_length: int = field(default=256, metadata={"help": "Most tokens generated per completion."})
    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass (1.0: off)."})
    teacher_model_kind: str = field(default="base", metadata={"help": "The teacher: 'base' the initial student "
                                    "(frozen), 'live' the current student, 'ema' a moving average of the student."})
    teacher_update_rate: float = field(default=0.05, metadata={"help": "With 'ema': the fraction of the way the "
                                       "teacher moves to the student at each update."})
    teacher_sync_steps: int = field(default=1, metadata={"help": "With 'ema': optimizer steps between teacher "
                                    "updates."})
    generate_from_teacher: bool = field(default=False, metadata={"help": "Sample from the teacher's prompt: only "
                                        "False (the student's prompt)."})
    teacher_prompt_template: str = field(default="{prompt}\n\n{privileged_context}", metadata={"help": "The "
                                         "teacher's prompt from the student's and the row's privileged_context."})
    num_loss_tokens_to_skip: int = field(default=0, metadata={"help": "The first this many completion tokens are "
                                         "left out of the loss."})
    distillation_mode: str = field(default="topk_logits", metadata={"help": "'full_logits' (the whole vocabulary), "
                                   "'topk_logits' (distillation_topk tokens) or 'sampled_token' (the reverse KL on the "
                                   "sampled tokens: needs distillation_alpha=1.0)."})
    distillation_alpha: float = field(default=0.5, metadata={"help": "The generalised JSD's interpolation: 0.0 "
                                      "forward KL(teacher || student), 0.5 JSD, 1.0 reverse KL."})
    distillation_topk: int | None = field(default=100, metadata={"help": "The top-k support of 'topk_logits'."})
    distillation_add_tail: bool = field(default=False, metadata={"help": "With a top-k support: one more outcome "
                                        "for the rest of the mass (else both renormalised on the support)."})
    distillation_is_clip: float | None = field(default=2.0, metadata={"help": "Accepted for TRL compatibility: with "
                                               "one optimizer step per generation batch the ratio it clips is 1."})
    distillation_weight: float = field(default=1.0, metadata={"help": "Weight of the self-distillation loss."})

    def _check(self):
        super()._check()
        if self.teacher_model_kind not in TEACHER_KINDS:
            raise ValueError(f"teacher_model_kind={self.teacher_model_kind!r}: choose one of {TEACHER_KINDS}")
        if self.distillation_mode not in MODES:
            raise ValueError(f"distillation_mode={self.distillation_mode!r}: choose one of {MODES}")
        if "{prompt}" not in self.teacher_prompt_template or "{privileged_context}" not in self.teacher_prompt_template:
            raise ValueError(f"teacher_prompt_template={self.teacher_prompt_template!r} must contain both {{prompt}} "
                             "and {privileged_context}")
        if self.lmbda != 1.0 or self.beta != 0.0 or self.generate_from_teacher:
            raise ValueError(f"lmbda={self.lmbda}, beta={self.beta}, generate_from_teacher={self.generate_from_teacher}"
                             ": SDFT samples from the student's prompt (lmbda=1.0, generate_from_teacher=False) and "
                             "has no reference model (beta=0.0)")
        if not 0.0 <= self.distillation_alpha <= 1.0 or not 0.0 <= self.teacher_update_rate <= 1.0:
            raise ValueError(f"distillation_alpha={self.distillation_alpha} and teacher_update_rate="
                             f"{self.teacher_update_rate} must be in [0, 1]")
        if self.num_loss_tokens_to_skip < 0 or self.teacher_sync_steps < 1 or self.distillation_weight < 0:
            raise ValueError(f"num_loss_tokens_to_skip={self.num_loss_tokens_to_skip} must be >= 0, "
                             f"teacher_sync_steps={self.teacher_sync_steps} >= 1, distillation_weight="
                             f"{self.distillation_weight} >= 0")
        if self.distillation_mode == "sampled_token" and self.distillation_alpha != 1.0:
            raise ValueError(f"distillation_mode='sampled_token' is the reverse KL: it needs distillation_alpha=1.0 "
                             f"(got {self.distillation_alpha}); use 'full_logits' or 'topk_logits' for other values")
        if self.distillation_mode == "topk_logits" and not (self.distillation_topk or 0) > 0:
            raise ValueError("distillation_mode='topk_logits' needs distillation_topk > 0")
        if self.use_teacher_server:
            raise ValueError("SDFT's teacher is the student itself: use_teacher_server must be False")


class SDFTTrainer(DistillationTrainer):
    """SDFT on the distillation preset. Signature as TRL's: `SDFTTrainer(model, args=None, train_dataset=None,
    eval_dataset=None, processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None)`."""

    config_class = SDFTConfig
    _tag = "sdft"
    _name = "SDFT"
    _citation = """@article{sdft2026,
    title   = {{Self-Distillation Enables Continual Learning}},
    journal = {arXiv preprint arXiv:2601.19897},
    year    = 2026
}"""
    checkpointed = DistillationTrainer.checkpointed + ("_ema_teacher",)

    def __init__(self, model, args: SDFTConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None, **kwargs):
        super().__init__(model, None, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         peft_config=peft_config, **kwargs)
        if self.args.teacher_model_kind == "ema":
            if self.teacher_model is None:
                raise ValueError("teacher_model_kind='ema' keeps a copy of the weights: not with a PEFT student "
                                 "(its teacher is the adapter-disabled model); use 'base' or 'live'")
            from transformers import TrainerCallback

            trainer = self

            class EMATeacher(TrainerCallback):
                def on_step_end(self, args, state, control, **kw):
                    if state.global_step % trainer.args.teacher_sync_steps == 0:
                        trainer.update_ema_teacher()

            self.add_callback(EMATeacher())

    @property
    def _ema_teacher(self):
        """The moving-average teacher's weights (saved with each checkpoint); None for the other kinds."""
        return self.teacher_model if self.args.teacher_model_kind == "ema" else None

    @torch.no_grad()
    def update_ema_teacher(self):
        """teacher <- teacher + rate (student - teacher), parameter by parameter."""
        student = dict(self.accelerator.unwrap_model(self.model).named_parameters())
        for name, param in self.teacher_model.named_parameters():
            param.lerp_(student[name].detach().to(param.dtype), self.args.teacher_update_rate)

    @contextlib.contextmanager
    def teacher(self):
        if self.args.teacher_model_kind != "live":
            with super().teacher() as teacher:
                yield teacher
            return
        with torch.no_grad():
            yield self.policy

    def teacher_inputs(self, inputs: dict, prompts: list, columns: dict) -> dict:
        """The teacher's prompts: each completion's prompt with its row's privileged_context, by the template."""
        if "privileged_context" not in columns:
            raise ValueError("SDFT's teacher reads the dataset's 'privileged_context' column (what the teacher sees "
                             f"besides the prompt); train_dataset has {sorted(columns)}")
        args, tok = self.args, self.processing_class
        rows = [encode_prompt(tok, _with_context(p, c, args.teacher_prompt_template))
                for p, c in zip(prompts, columns["privileged_context"])]
        if args.max_prompt_length:
            rows = [ids[-args.max_prompt_length - (len(ids) - len(own)):]
                    for ids, own in zip(rows, (encode_prompt(tok, p) for p in prompts))]
        pad = tok.pad_token_id
        return {"teacher_prompt_ids": pad_rows(rows, pad, side="left"),
                "teacher_prompt_mask": pad_rows([[1] * len(r) for r in rows], 0, side="left")}

    def divergence(self, model, mb: dict):
        """Per-token divergence (B, C) between the student on its prompt and the teacher on its own: the generalised
        JSD(distillation_alpha) on the full vocabulary or the top-k support, or the sampled tokens' reverse KL."""
        args = self.args
        mask = mb["loss_mask"]
        if args.num_loss_tokens_to_skip:
            mask = mask * (torch.arange(mask.shape[1], device=mask.device) >= args.num_loss_tokens_to_skip)
        teacher_mb = {**mb, "prompt_ids": mb["teacher_prompt_ids"], "prompt_mask": mb["teacher_prompt_mask"]}
        if args.distillation_mode == "sampled_token":  # TRL's: log-probs of the sampled tokens only
            student = self.sampled_logprobs(model, mb)
            with self.teacher() as teacher:
                target = self.sampled_logprobs(teacher, teacher_mb)
            per_token = torch.where(mask.bool(), sampled_reverse_kl(student, target), 0.0)
            return per_token.float() * args.distillation_weight
        student = completion_logits(model, mb)
        with self.teacher() as teacher:
            target = completion_logits(teacher, teacher_mb)
        top_k = (args.distillation_topk or 0) if args.distillation_mode == "topk_logits" else 0
        per_token = token_divergence(student, target, mask, "generalized_jsd", beta=args.distillation_alpha,
                                     temperature=args.temperature, top_k=top_k, add_tail=args.distillation_add_tail)
        return per_token.float() * args.distillation_weight

    def sampled_logprobs(self, model, mb: dict) -> torch.Tensor:
        """(B, C) `model`'s log-probs of the completion tokens after `mb`'s prompts, at `temperature`."""
        logp, _ = completion_logprobs(model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                                      mb["completion_mask"], self.args.temperature)
        return logp


def _with_context(prompt, context: str, template: str):
    """The teacher's prompt: a text prompt through the template; a chat prompt with its last user message so."""
    if isinstance(prompt, str):
        return template.format(prompt=prompt, privileged_context=context)
    messages = [dict(m) for m in prompt]
    last = max(i for i, m in enumerate(messages) if m.get("role") == "user")
    messages[last]["content"] = template.format(prompt=messages[last]["content"], privileged_context=context)
    return messages
