"""SDPO: Self-Distillation Policy Optimization (Hübotter et al. 2026, "Reinforcement Learning via Self-Distillation";
TRL's experimental SDPOTrainer).

Reinforcement learning with verifiable rewards in which the model is its own teacher. For each prompt the policy
samples `num_generations` completions scored by the reward functions; a completion whose group holds a successful
peer (reward >= `success_reward_threshold`, itself excluded with `dont_reprompt_on_self_success`) gets a teacher
prompt: the original prompt, that peer's completion (`solution_template`) and optionally the row's
`privileged_context` as feedback (`include_environment_feedback`, `feedback_template`), joined by
`reprompt_template`. The teacher, the model conditioned on this reprompt, re-scores the completion's tokens, and its
next-token distributions are distilled into the policy on the plain prompt: a dense, per-token signal from a sparse
reward. Completions without a reprompt (no successful peer, no feedback) are out of the distillation term. The loss
is `(1 - distillation_weight) * policy_loss + distillation_weight * distillation_loss`: the policy loss is GRPO's
(group-normalised advantages, the clipped surrogate), the distillation loss SDFT's (`distillation_mode`
"sampled_token": the reverse KL on the sampled tokens, TRL's default; "full_logits" / "topk_logits": the generalised
JSD(`distillation_alpha`)). The teacher's weights are an EMA of the student's (`teacher_model_kind="ema"`,
`teacher_update_rate` every `teacher_sync_steps` optimizer steps), the current student ("live") or the initial one
("base").

A preset of the online engine through the SDFT preset (`posttrain.trainers.sdft`): the engine samples, scores and
computes the advantages (`sample_and_score`, `build_experience`); `reprompt` adds each row's teacher prompt and
`self_distillation_mask` to the batch before it is cut into micro-batches; `compute_loss` adds the two terms, each
averaged as the engine's `loss_type` (the global token count of the optimizer step for "dapo"; rows without a
reprompt count there with a zero distillation term, as TRL's batch mean counts them).

Departures from TRL: the distillation term is averaged as the policy term (`loss_type`) where TRL's takes
per-sequence means; `distillation_is_clip` has no effect (one optimizer step per generation batch: ratio 1);
`beta` > 0 (a reference model) and the teacher server are refused; a successful peer is looked for in this
process's groups (every group is sampled whole on one process).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import torch

from posttrain.core.batch import Experience
from posttrain.core.masked import aggregate_loss, masked_mean
from posttrain.data.collate import pad as pad_rows
from posttrain.data.tokenize import encode_prompt
from posttrain.trainers.online import OnlineTrainer
from posttrain.trainers.online_config import estimator_help
from posttrain.trainers.sdft import SDFTConfig, SDFTTrainer


@dataclass
class SDPOConfig(SDFTConfig):
    """TRL's SDPOConfig fields and defaults on the SDFT preset (the online engine's GRPO fields for the policy loss)."""

    learning_rate: float = field(default=5e-5, metadata={"help": "Initial AdamW learning rate (TRL's SDPOConfig "
                                 "keeps transformers' default)."})
    advantage_estimator: str = field(default="group_norm", metadata={"help": estimator_help(
        "The policy loss's advantages: GRPO's group-normalised rewards (scale_rewards).")})
    distillation_alpha: float = field(default=1.0, metadata={"help": "The generalised JSD's interpolation (0.0 "
                                      "forward KL, 1.0 reverse KL); 'sampled_token' needs 1.0."})
    distillation_mode: str = field(default="sampled_token", metadata={"help": "'sampled_token' (the reverse KL on the "
                                   "sampled tokens), 'full_logits' (the whole vocabulary) or 'topk_logits' "
                                   "(distillation_topk tokens)."})
    distillation_topk: int | None = field(default=None, metadata={"help": "The top-k support of 'topk_logits' "
                                          "(set it then only)."})
    distillation_weight: float = field(default=1.0, metadata={"help": "The loss is (1 - distillation_weight) * "
                                       "policy_loss + distillation_weight * distillation_loss: 1.0 pure "
                                       "self-distillation, 0.0 GRPO's policy gradient."})
    teacher_model_kind: str = field(default="ema", metadata={"help": "The teacher's weights: 'ema' a moving average "
                                    "of the student, 'live' the current student, 'base' the initial one."})
    max_reprompt_len: int = field(default=10240, metadata={"help": "Keep the last this many tokens of a teacher "
                                  "prompt."})
    use_successful_as_teacher: bool = field(default=True, metadata={"help": "Show the teacher a successful "
                                            "completion of the same prompt (its group)."})
    success_reward_threshold: float = field(default=1.0, metadata={"help": "Least reward of a successful "
                                            "completion."})
    dont_reprompt_on_self_success: bool = field(default=True, metadata={"help": "A completion is never its own "
                                                "demonstration: only its peers' successes count."})
    reprompt_template: str = field(default="{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n",
                                   metadata={"help": "The teacher's prompt from the prompt, the solution and the "
                                             "feedback texts."})
    solution_template: str = field(default="\nCorrect solution:\n\n{successful_previous_attempt}\n\n",
                                   metadata={"help": "How a successful completion is shown to the teacher."})
    feedback_template: str = field(default="\nThe following is feedback from your unsuccessful earlier attempt:\n\n"
                                   "{feedback_raw}\n\n", metadata={"help": "How a row's privileged_context is "
                                                                   "shown to the teacher."})
    include_environment_feedback: bool = field(default=False, metadata={"help": "Show the teacher the row's "
                                               "privileged_context column (when non-empty) as feedback."})
    environment_feedback_only_without_solution: bool = field(default=False, metadata={"help": "Show the feedback "
                                                             "only where no successful completion is shown."})
    remove_thinking_from_demonstration: bool = field(default=False, metadata={"help": "Drop <think>...</think> "
                                                     "blocks from a demonstration."})

    def _check(self):
        super()._check()
        if not 0.0 <= self.distillation_weight <= 1.0:
            raise ValueError(f"distillation_weight={self.distillation_weight} must be in [0, 1] (the loss is (1 - w) "
                             "* policy_loss + w * distillation_loss)")
        if self.max_reprompt_len <= 0:
            raise ValueError(f"max_reprompt_len={self.max_reprompt_len} must be > 0")
        for name, keys in (("reprompt_template", ("{prompt}", "{solution}", "{feedback}")),
                           ("solution_template", ("{successful_previous_attempt}",)),
                           ("feedback_template", ("{feedback_raw}",))):
            missing = [k for k in keys if k not in getattr(self, name)]
            if missing:
                raise ValueError(f"{name}={getattr(self, name)!r} lacks {', '.join(missing)}")


class SDPOTrainer(SDFTTrainer):
    """SDPO on the online engine. Signature as TRL's: `SDPOTrainer(model, reward_funcs, args=None,
    train_dataset=None, eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
    optimizers=(None, None), peft_config=None)`."""

    config_class = SDPOConfig
    _tag = "sdpo"
    _name = "SDPO"
    _citation = """@article{hubotter2026sdpo,
    title   = {{Reinforcement Learning via Self-Distillation}},
    author  = {Jonas H\\"ubotter and Frederike L\\"ubeck and Lejs Behric and Anton Baumann and Marco Bagatella and
               Daniel Marta and Ido Hakimi and Idan Shenfeld and Thomas Kleine Buening and Carlos Guestrin and
               Andreas Krause},
    journal = {arXiv preprint arXiv:2601.20802},
    year    = 2026
}"""

    def __init__(self, model, reward_funcs=None, args: SDPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), peft_config=None, **kwargs):
        if reward_funcs is None or (isinstance(reward_funcs, (list, tuple)) and not reward_funcs):
            raise ValueError("SDPOTrainer needs reward_funcs: the rewards decide which completions are successful "
                             "demonstrations for the teacher (success_reward_threshold)")
        self._teacher_rows = {}
        super().__init__(model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         peft_config=peft_config, reward_funcs=reward_funcs,
                         reward_processing_classes=reward_processing_classes, **kwargs)

    # ------------------------------------------------------------------ experience
    @torch.no_grad()
    def make_experience(self, inputs: dict) -> list[Experience]:
        """The engine's sampled, scored batch (advantages for the policy loss) with each row's teacher prompt."""
        self._start_time = self._start_time or time.time()
        sampled = self.sample_and_score(inputs)
        self._record_sampled(sampled)
        self.batch_prompts = sampled.prompts
        k = self.args.num_generations
        columns = {key: [v for v in values for _ in range(k)] for key, values in inputs["columns"].items()}
        self._teacher_rows = self.reprompt(sampled.prompts, columns, sampled.rollout, sampled.scores)
        return self.build_experience(sampled.rollout, sampled.scores)

    def _micro_batches(self, batch) -> list[Experience]:
        batch = Experience.of(batch)
        for key, value in self._teacher_rows.items():  # cut with the rest of the batch's rows
            batch[key] = value.to(batch["completion_ids"].device)
        return super()._micro_batches(batch)

    def demonstrations(self, scores: torch.Tensor) -> list[int | None]:
        """Per row, the index of the successful peer in its group shown to its teacher (the first), or None."""
        args, k = self.args, self.args.num_generations
        ok = (scores.float().cpu() >= args.success_reward_threshold).tolist()
        shown = []
        for i in range(len(ok)):
            peers = [j for j in range(i - i % k, i - i % k + k) if ok[j]
                     and not (args.dont_reprompt_on_self_success and j == i)]
            shown.append(peers[0] if peers and args.use_successful_as_teacher else None)
        return shown

    def reprompt(self, prompts: list, columns: dict, rollout, scores: torch.Tensor) -> dict[str, torch.Tensor]:
        """`teacher_prompt_ids` / `teacher_prompt_mask` (left-padded) and `self_distillation_mask` (N,) of a batch:
        rows with a successful peer or feedback get the reprompt, the others their own prompt (and mask 0)."""
        args, tok, k = self.args, self.processing_class, self.args.num_generations
        lengths = rollout.completion_mask.sum(1).tolist()
        texts = tok.batch_decode([ids[:n] for ids, n in zip(rollout.completion_ids.tolist(), lengths)],
                                 skip_special_tokens=True)
        if args.remove_thinking_from_demonstration:
            texts = [re.sub(r"<think>.*?</think>", "", t, flags=re.DOTALL).strip() for t in texts]
        feedback = columns.get("privileged_context") or [None] * len(prompts)
        shown, rows, active = self.demonstrations(scores), [], []
        for i, prompt in enumerate(prompts):
            solution = "" if shown[i] is None else args.solution_template.format(
                successful_previous_attempt=texts[shown[i]])
            has_feedback = isinstance(feedback[i], str) and feedback[i].strip() != ""
            use_feedback = args.include_environment_feedback and has_feedback and not (
                args.environment_feedback_only_without_solution and shown[i] is not None)
            said = args.feedback_template.format(feedback_raw=feedback[i]) if use_feedback else ""
            active.append(bool(solution or said))
            teacher = _reprompted(prompt, solution, said, args.reprompt_template) if active[-1] else prompt
            rows.append(encode_prompt(tok, teacher)[-args.max_reprompt_len:])
        groups = torch.tensor([s >= args.success_reward_threshold for s in scores.float().tolist()]).view(-1, k)
        n = max(len(rows), 1)
        self.record({"self_distillation/success_group_fraction": groups.any(1).float().mean(),
                     "self_distillation/success_sample_fraction": sum(s is not None for s in shown) / n,
                     "self_distillation/feedback_available_fraction":
                         sum(isinstance(f, str) and f.strip() != "" for f in feedback) / n,
                     "self_distillation/reprompt_sample_fraction": sum(active) / n}, "train")
        pad = tok.pad_token_id
        return {"teacher_prompt_ids": pad_rows(rows, pad, side="left"),
                "teacher_prompt_mask": pad_rows([[1] * len(r) for r in rows], 0, side="left"),
                "self_distillation_mask": torch.tensor(active, dtype=torch.float32)}

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """(1 - distillation_weight) * GRPO's policy loss + distillation_weight * the self-distillation loss (the
        weight is applied in `divergence`), each averaged as the engine's loss_type."""
        args = self.args
        loss = 0.0
        if args.distillation_weight < 1.0:
            loss = (1.0 - args.distillation_weight) * OnlineTrainer.compute_loss(self, model, inputs)
        if args.distillation_weight > 0.0:
            mask = inputs["loss_mask"] * inputs["self_distillation_mask"][:, None]
            per_token = self.divergence(model, {**inputs, "loss_mask": mask})
            loss = loss + aggregate_loss(per_token, inputs["loss_mask"], self.loss_mode,
                                         denominator=inputs["denominator"], max_length=args.max_completion_length)
            self.record({"divergence": masked_mean(per_token.detach(), mask) / args.distillation_weight}, "train")
        return (loss, None) if return_outputs else loss

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """The online engine's evaluation: the rewards of the policy's samples of the eval prompts."""
        return OnlineTrainer.evaluate(self, eval_dataset, ignore_keys, metric_key_prefix)

    def teacher_inputs(self, inputs: dict, prompts: list, columns: dict) -> dict:
        return {}  # the teacher's prompts come from the scored batch (`reprompt`)


def _reprompted(prompt, solution: str, feedback: str, template: str):
    """The teacher's prompt: a text prompt through the template; a chat prompt as its messages but the last, then
    one user message with the last user message's text through the template (as TRL's)."""
    if isinstance(prompt, str):
        return template.format(prompt=prompt, solution=solution, feedback=feedback)
    last = max(i for i, m in enumerate(prompt) if m.get("role") == "user")
    content = prompt[last]["content"]
    if isinstance(content, list):  # content parts: their text
        content = " ".join(part.get("text", "") for part in content if part.get("type") == "text")
    return [dict(m) for m in prompt[:-1]] + [{"role": "user", "content": template.format(
        prompt=content, solution=solution, feedback=feedback)}]
