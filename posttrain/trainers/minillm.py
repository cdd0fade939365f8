"""MiniLLM: knowledge distillation as reverse-KL policy optimisation (Gu et al. 2024, "MiniLLM: Knowledge
Distillation of Large Language Models").

The student minimises KL(student || teacher) over whole sequences by policy gradient on its own samples: each
sampled token earns r_t = log q_teacher(y_t) - log q_student(y_t), and its advantage is the (discounted,
length-normalised) return of these rewards (`core.advantages.reverse_kl_return`). With
`single_step_decomposition`, each step's own term is taken exactly instead of sampled: the loss adds the
per-token reverse KL over the whole vocabulary (`core.divergences`), which lowers the gradient's variance.
Reward functions may be given too: their scores, minus the group mean, join the advantage (GRPO-style).

A preset of the online engine: the teacher is the engine's reference model (its log-probs of the sampled
tokens are computed once per generation batch), the per-token rewards are the engine's KL-in-reward
shaping with the k1 estimator at coefficient 1, the policy loss is the engine's clipped surrogate, and
`compute_loss` adds the single-step term.

Departures: MiniLLM's teacher-mixed sampling and its pre-training loss are not implemented; the rewards use
the sampling `temperature`, the single-step term `kd_temperature`; the single-step term needs one more
forward of the student per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from posttrain.core.advantages import ADVANTAGES
from posttrain.core.divergences import token_divergence
from posttrain.core.masked import aggregate_loss, masked_mean
from posttrain.core.shaping import RewardShaping
from posttrain.forward.completions import completion_logits
from posttrain.models import loading
from posttrain.trainers.online import OnlineTrainer
from posttrain.trainers.online_config import OnlineConfig, estimator_help


@dataclass
class MiniLLMConfig(OnlineConfig):
    """TRL's MiniLLMConfig (GRPO's fields plus the ones below) on the online engine."""

    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (1 is allowed: the reward "
                                 "advantage is then 0 and only the reverse-KL return drives learning)."})
    advantage_estimator: str = field(default="reverse_kl_return", metadata={"help": estimator_help()})
    teacher_model_name_or_path: str | None = field(default=None, metadata={"help": "The teacher, when the trainer "
                                                   "gets no teacher_model (posttrain's addition, for the CLI)."})
    teacher_model_init_kwargs: dict | None = field(default=None, metadata={"help": "Keyword arguments for "
                                                   "from_pretrained when the teacher is given as a string."})
    disable_dropout: bool = field(default=True, metadata={"help": "No dropout in the student."})
    rkl_advantage: bool = ADVANTAGES.field("rkl_advantage")
    single_step_decomposition: bool = ADVANTAGES.field("single_step_decomposition")
    kd_temperature: float = field(default=1.0, metadata={"help": "Softmax temperature of both models in the "
                                  "single-step reverse KL."})
    gamma: float = field(default=0.0, metadata={"help": "Discount of later tokens' rewards in the return."})
    length_normalization: bool = ADVANTAGES.field("length_normalization")

    def _check(self):
        if isinstance(self.teacher_model_init_kwargs, str):  # from the command line, as JSON
            import json

            self.teacher_model_init_kwargs = json.loads(self.teacher_model_init_kwargs)
        super()._check()
        if self.kl_in_reward:
            raise ValueError("MiniLLM puts the teacher's log-ratio in the reward itself; leave kl_in_reward False "
                             "(beta > 0 adds a KL to the teacher in the loss, as GRPO's to its reference)")
        if self.kd_temperature <= 0:
            raise ValueError(f"kd_temperature must be > 0, got {self.kd_temperature}")


class MiniLLMTrainer(OnlineTrainer):
    """MiniLLM on the online engine. Signature as TRL's: `MiniLLMTrainer(model, teacher_model, reward_funcs=None,
    args=None, train_dataset=None, eval_dataset=None, processing_class=None, reward_processing_classes=None,
    callbacks=None, optimizers=(None, None), peft_config=None)`."""

    config_class = MiniLLMConfig
    _tag = "MiniLLM"
    _name = "MiniLLM"
    _citation = """@inproceedings{gu2024minillm,
    title     = {{MiniLLM: Knowledge Distillation of Large Language Models}},
    author    = {Yuxian Gu and Li Dong and Furu Wei and Minlie Huang},
    booktitle = {The Twelfth International Conference on Learning Representations, {ICLR} 2024},
    year      = 2024
}"""

    def __init__(self, model, teacher_model=None, reward_funcs=None, args: MiniLLMConfig | None = None,
                 train_dataset=None, eval_dataset=None, processing_class=None, reward_processing_classes=None,
                 callbacks=None, optimizers=(None, None), peft_config=None, **kwargs):
        from posttrain.trainers.distillation import no_reward

        init = dict(getattr(args, "teacher_model_init_kwargs", None) or {})
        if teacher_model is None:
            teacher_model = getattr(args, "teacher_model_name_or_path", None)
        if teacher_model is None:
            raise ValueError("MiniLLMTrainer needs a teacher: give teacher_model (a model or a name) or set "
                             "teacher_model_name_or_path")
        teacher = loading.load_causal_lm(teacher_model, **init)
        super().__init__(model, reward_funcs=reward_funcs or [no_reward], args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config, ref_model=teacher, **kwargs)

    @staticmethod
    def uses_reference(args) -> bool:
        return True  # the teacher, in the reference model's place

    def reward_shaping(self) -> RewardShaping:
        """The engine's shaping with the teacher's per-token log-ratio as the reward: -1 * k1(student, teacher)."""
        shaping = super().reward_shaping()
        return RewardShaping(**{**vars(shaping), "kl_in_reward": self.args.rkl_advantage, "kl_coef": 1.0,
                                "kl_estimator": "k1", "per_token": True, "token_level_kl": True})

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        args, mask = self.args, inputs["loss_mask"]
        if args.single_step_decomposition:
            student = completion_logits(model, inputs)
            with torch.no_grad(), self.reference_context(self.ref_model):
                teacher = completion_logits(self.ref_model if self.ref_model is not None else self.policy, inputs)
            per_token = token_divergence(student, teacher, mask, "reverse_kl",
                                         temperature=args.kd_temperature).float()
            loss = loss + aggregate_loss(per_token, mask, self.loss_mode, denominator=inputs["denominator"],
                                         max_length=args.max_completion_length)
            self.record({"divergence": masked_mean(per_token.detach(), mask)}, "train")
        return (loss, None) if return_outputs else loss
