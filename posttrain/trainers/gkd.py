"""GKD: Generalized Knowledge Distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes").

The distillation preset (`posttrain.trainers.distillation`) with GKD's defaults, as TRL's experimental
`GKDTrainer`: half the batches on-policy (`lmbda=0.5`), the symmetric JSD (`beta=0.5`) over the full
vocabulary, sampling at `temperature=0.9`, completions of up to `max_new_tokens=128` tokens; with `seq_kd`,
the off-policy batches are the teacher's own samples (sequence-level KD, Kim & Rush 2016) instead of the
dataset's completions. A dataset in TRL's GKD form (a `messages` column) is split into prompt (every
message but the last) and completion (the last message).

Departures from TRL: `GKDConfig` extends `DistillationConfig` (the online engine's fields), not `SFTConfig`,
so SFT's packing and text-field options do not exist here; `max_new_tokens` is `max_completion_length` by
another name (set either).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer
from posttrain.trainers.online_config import resolve_aliases


@dataclass
class GKDConfig(DistillationConfig):
    """TRL's GKDConfig fields and defaults on the distillation preset."""

    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature, and the temperature of both "
                               "models' softmax in the loss."})
    lmbda: float = field(default=0.5, metadata={"help": "Probability that a generation batch is on-policy (the "
                         "student's samples); otherwise off-policy (the dataset's completions, or with seq_kd the "
                         "teacher's samples)."})
    beta: float = field(default=0.5, metadata={"help": "Interpolation of the generalised JSD: 0.0 = KL(teacher || "
                        "student), 1.0 = KL(student || teacher)."})
    max_new_tokens: int = field(default=128, metadata={"help": "Most tokens generated per completion (alias: "
                                "max_completion_length)."})
    max_completion_length: int = field(default=128, metadata={"help": "Alias of max_new_tokens."})
    loss_top_k: int = field(default=0, metadata={"help": "0: the divergence over the full vocabulary (GKD); K > 0: "
                            "on a top-K support (see DistillationConfig)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass (1.0: off)."})
    seq_kd: bool = field(default=False, metadata={"help": "Sequence-level KD: off-policy batches are the teacher's "
                         "samples of the prompts (supervised training on teacher outputs) instead of the dataset's."})

    def _check(self):
        resolve_aliases(self, [("max_new_tokens", "max_completion_length")])
        super()._check()
        if self.seq_kd and self.use_teacher_server:
            raise ValueError("seq_kd=True samples the teacher's completions, which needs a local teacher; a teacher "
                             "server only scores them: set seq_kd=False or use_teacher_server=False")


class GKDTrainer(DistillationTrainer):
    """GKD on the online engine. Signature as TRL's: `GKDTrainer(model, teacher_model, args=None,
    train_dataset=None, eval_dataset=None, processing_class=None, callbacks=None, optimizers=(None, None),
    peft_config=None)`."""

    config_class = GKDConfig
    _tag = "GKD"
    _name = "GKD"

    def off_policy_batch(self, inputs: dict, prompts: list, columns: dict) -> dict:
        if self.args.seq_kd:
            return self.teacher_completions(inputs)
        return super().off_policy_batch(inputs, prompts, columns)
