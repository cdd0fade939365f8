"""GOLD: General Online Logit Distillation, on-policy distillation between models with different tokenizers (TRL's
experimental GOLDTrainer; "Unlocking On-Policy Distillation for Any Model Family", Hugging Face 2025), built on
Universal Logit Distillation (Boizard et al. 2024, "Towards Cross-Tokenizer Distillation: the Universal Logit
Distillation Loss for LLMs").

Without `use_uld_loss` this is GKD (`posttrain.trainers.gkd`): teacher and student share a tokenizer. With it, the
student's completion (its own sample, or the dataset's) is given to the teacher as text: the prompt's and the
completion's text are decoded with the student's tokenizer and encoded with the teacher's, so both models read
the same text in their own tokens (a sampled completion is read by the teacher as its tokenizer encodes the
text, which need not split it as the student's sample did). Token boundaries: each side's completion tokens are cut into groups where
both tokenizations end a token at the same character (`core.cross_tokenizer.align_by_text`; with
`use_extended_uld=False`, token i with token i, the longer cut, as the original ULD); within a group, each side's
per-token distributions are multiplied and renormalised (`merge_groups`), so no completion token is left out; the
EOS token of each side is left out (`uld_skip_*_eos`) or paired with the other side's. Each group's loss is
`uld_distance` of the two merged distributions (the sorted-probability L1 distance, at `uld_student_temperature`
/ `uld_teacher_temperature`), or with `uld_use_hybrid_loss` the hybrid (`hybrid_uld`: the tokens both
vocabularies spell the same compared one to one). A group's loss is shared among its student tokens, so the
engine's token mean averages it; `uld_crossentropy_weight` adds the student's cross-entropy on the completion.

Departures from TRL: `GOLDConfig` extends `GKDConfig` (the online engine's fields), not `SFTConfig`; the ULD loss is
averaged over the optimizer step's student tokens (TRL: over each sequence's groups, then over sequences); the
hybrid's matched part is a JSD over the matched tokens plus a rest-of-the-mass outcome (TRL: over the unnormalised
sub-vectors); `seq_kd` with `use_uld_loss`, a teacher server with it, vLLM's colocate/server student and the
paged transformers generation are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from posttrain.core.cross_tokenizer import (align_by_text, hybrid_uld, matched_vocabulary, merge_groups,
                                            positional_groups, uld_distance)
from posttrain.core.divergences import LinearLogits
from posttrain.core.masked import aggregate_loss, masked_mean
from posttrain.forward.completions import completion_logits, completion_logprobs
from posttrain.models import loading
from posttrain.trainers.gkd import GKDConfig, GKDTrainer


@dataclass
class GOLDConfig(GKDConfig):
    """TRL's GOLDConfig fields and defaults on the GKD preset."""

    learning_rate: float = field(default=1e-7, metadata={"help": "Initial AdamW learning rate."})
    top_p: float = field(default=0.95, metadata={"help": "Nucleus sampling mass of on-policy generation."})
    student_model_revision: str = field(default="main", metadata={"help": "Revision of the student loaded from a "
                                        "name."})
    teacher_tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "The teacher's tokenizer, for "
                                                       "use_uld_loss (None: the teacher's name when it is given as "
                                                       "one)."})
    use_uld_loss: bool = field(default=False, metadata={"help": "Universal Logit Distillation between different "
                               "tokenizers instead of the generalised JSD."})
    use_extended_uld: bool = field(default=True, metadata={"help": "Align the two tokenizations by their text and "
                                   "merge the distributions of split tokens; False: token i with token i."})
    uld_use_hybrid_loss: bool = field(default=False, metadata={"help": "Compare the tokens both vocabularies spell "
                                      "the same one to one (a JSD), the rest by sorted probabilities."})
    uld_hybrid_matched_weight: float | None = field(default=None, metadata={"help": "Weight of the hybrid's matched "
                                                    "part (None with the unmatched weight None: the share of the "
                                                    "teacher's vocabulary that matches)."})
    uld_hybrid_unmatched_weight: float | None = field(default=None, metadata={"help": "Weight of the hybrid's "
                                                      "unmatched (sorted-probability) part."})
    uld_crossentropy_weight: float = field(default=0.0, metadata={"help": "Weight of the student's cross-entropy on "
                                           "the completion tokens, added to the ULD loss."})
    uld_distillation_weight: float = field(default=1.0, metadata={"help": "Weight of the ULD loss."})
    uld_student_temperature: float = field(default=1.0, metadata={"help": "Temperature of the student's softmax in "
                                           "the ULD loss."})
    uld_teacher_temperature: float = field(default=1.0, metadata={"help": "Temperature of the teacher's softmax in "
                                           "the ULD loss."})
    uld_skip_student_eos: bool = field(default=True, metadata={"help": "Leave the student's EOS token out of the "
                                       "ULD loss."})
    uld_skip_teacher_eos: bool = field(default=True, metadata={"help": "Leave the teacher's EOS token out of the "
                                       "ULD loss."})
    use_transformers_paged: bool = field(default=False, metadata={"help": "Accepted for TRL compatibility: only "
                                         "False (posttrain's sampler)."})

    def _check(self):
        super()._check()
        if self.use_transformers_paged:
            raise ValueError("use_transformers_paged=True: posttrain generates with its own sampler; leave it False")
        if not self.use_uld_loss:
            return
        if self.uld_crossentropy_weight < 0 or self.uld_distillation_weight < 0:
            raise ValueError(f"uld_crossentropy_weight={self.uld_crossentropy_weight} and uld_distillation_weight="
                             f"{self.uld_distillation_weight} must be >= 0")
        if not (self.uld_student_temperature > 0 and self.uld_teacher_temperature > 0):
            raise ValueError(f"uld_student_temperature={self.uld_student_temperature} and uld_teacher_temperature="
                             f"{self.uld_teacher_temperature} must be > 0")
        weights = (self.uld_hybrid_matched_weight, self.uld_hybrid_unmatched_weight)
        if self.uld_use_hybrid_loss and (weights[0] is None) != (weights[1] is None):
            raise ValueError(f"uld_hybrid_matched_weight={weights[0]} and uld_hybrid_unmatched_weight={weights[1]}: "
                             "set both (fixed weights) or neither (the vocabulary overlap decides)")
        if any(w is not None and w < 0 for w in weights):
            raise ValueError(f"the hybrid weights {weights} must be >= 0")
        if self.seq_kd:
            raise ValueError("seq_kd=True with use_uld_loss=True is not implemented: the teacher's samples are in its "
                             "own tokens; set seq_kd=False")
        if self.use_teacher_server:
            raise ValueError("use_uld_loss=True needs the teacher's whole distributions: a teacher server sends its "
                             "top-k only; set use_teacher_server=False")


class GOLDTrainer(GKDTrainer):
    """GOLD on the GKD preset. Signature as TRL's: `GOLDTrainer(model, teacher_model, args=None, train_dataset=None,
    eval_dataset=None, processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None)`."""

    config_class = GOLDConfig
    _tag = "gold"
    _name = "GOLD"
    _citation = """@misc{patino2025unlocking,
    title  = {{Unlocking On-Policy Distillation for Any Model Family}},
    author = {Carlos Miguel Patiño and Kashif Rasul and Quentin Gallouédec and Ben Burtenshaw and Sergio Paniego
              and Vaibhav Srivastav and Thibaud Frere and Ed Beeching and Lewis Tunstall and Leandro von Werra and
              Thomas Wolf},
    year   = 2025,
    url    = {https://huggingface.co/spaces/HuggingFaceH4/general-on-policy-logit-distillation}
}"""

    def __init__(self, model, teacher_model=None, args: GOLDConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None,
                 **kwargs):
        if args is not None and isinstance(model, str) and args.student_model_revision not in (None, "main"):
            args.model_init_kwargs = {**(args.model_init_kwargs or {}), "revision": args.student_model_revision}
        super().__init__(model, teacher_model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         peft_config=peft_config, **kwargs)
        args, self.teacher_tokenizer, self._matched = self.args, None, None
        if args.use_uld_loss:
            name = args.teacher_tokenizer_name_or_path or (
                teacher_model if isinstance(teacher_model, str) else args.teacher_model_name_or_path)
            if name is None and teacher_model is not None:
                raise ValueError("use_uld_loss=True with a teacher given as a model needs "
                                 "teacher_tokenizer_name_or_path (the teacher's tokenizer)")
            # no teacher at all: the frozen copy of the student, with the student's tokenizer
            self.teacher_tokenizer = loading.load_tokenizer(name) if name else self.processing_class
            if args.uld_use_hybrid_loss:
                teacher = self.teacher_model if self.teacher_model is not None else self.policy
                self._matched = matched_vocabulary(self.processing_class.get_vocab(),
                                                   self.teacher_tokenizer.get_vocab(),
                                                   self.policy.get_output_embeddings().weight.shape[0],
                                                   teacher.get_output_embeddings().weight.shape[0])

    # ------------------------------------------------------------------ the teacher's view of the batch
    def teacher_batch(self, mb: dict) -> tuple[dict, list[dict]]:
        """The micro-batch in the teacher's tokens (prompt and completion text re-encoded, left- / right-padded) and,
        per row, the alignment: `groups` (student positions, teacher positions) per group."""
        s_tok, t_tok, args = self.processing_class, self.teacher_tokenizer, self.args
        rows, aligned = [], []
        for p_ids, p_mask, c_ids, c_mask in zip(mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                                                mb["completion_mask"]):
            prompt, completion = p_ids[p_mask.bool()].tolist(), c_ids[c_mask.bool()].tolist()
            eos = bool(completion) and completion[-1] == s_tok.eos_token_id
            body = completion[:-1] if eos else completion
            if t_tok is s_tok:  # one tokenizer: the very tokens (a sample need not be how its text encodes)
                t_prompt, t_body = prompt, body
            else:
                t_prompt = t_tok(s_tok.decode(prompt), add_special_tokens=False)["input_ids"]
                t_body = t_tok(s_tok.decode(body), add_special_tokens=False)["input_ids"]
            t_eos = [t_tok.eos_token_id] if eos and t_tok.eos_token_id is not None else []
            rows.append((t_prompt, t_body + t_eos))
            if args.use_extended_uld:
                s_groups, t_groups = align_by_text(_ends(s_tok, body), _ends(t_tok, t_body))
            else:
                s_groups, t_groups = positional_groups(len(body), len(t_body))
            keep_s = [len(body)] if eos and not args.uld_skip_student_eos else []
            keep_t = [len(t_body)] if t_eos and not args.uld_skip_teacher_eos else []
            if keep_s and keep_t:
                s_groups, t_groups = s_groups + [keep_s], t_groups + [keep_t]
            elif s_groups:  # one side's EOS alone: it joins the last group
                s_groups[-1], t_groups[-1] = s_groups[-1] + keep_s, t_groups[-1] + keep_t
            aligned.append({"student": s_groups, "teacher": t_groups})
        pad = t_tok.pad_token_id if t_tok.pad_token_id is not None else t_tok.eos_token_id
        P, C = max(len(p) for p, _ in rows), max(max(len(c) for _, c in rows), 1)
        batch = {"prompt_ids": [[pad] * (P - len(p)) + p for p, _ in rows],
                 "prompt_mask": [[0] * (P - len(p)) + [1] * len(p) for p, _ in rows],
                 "completion_ids": [c + [pad] * (C - len(c)) for _, c in rows],
                 "completion_mask": [[1] * len(c) + [0] * (C - len(c)) for _, c in rows]}
        device = mb["completion_ids"].device
        return {key: torch.tensor(value, device=device) for key, value in batch.items()}, aligned

    # ------------------------------------------------------------------ loss
    def uld_per_token(self, model, mb: dict) -> Tensor:
        """(B, C) the ULD (or hybrid) loss of each aligned group, shared among the group's student tokens."""
        args = self.args
        t_mb, aligned = self.teacher_batch(mb)
        student = completion_logits(model, mb)
        with self.teacher() as teacher:
            target = completion_logits(teacher, t_mb)
        out = torch.zeros(mb["completion_ids"].shape, dtype=torch.float32, device=mb["completion_ids"].device)
        for i, groups in enumerate(aligned):
            if not groups["student"]:
                continue
            s_logp = merge_groups((_row(student, i) / args.uld_student_temperature).log_softmax(-1), groups["student"])
            t_logp = merge_groups((_row(target, i).detach() / args.uld_teacher_temperature).log_softmax(-1),
                                  groups["teacher"])
            if self._matched is not None:
                share = len(self._matched[1]) / t_logp.shape[-1]
                weights = (args.uld_hybrid_matched_weight, args.uld_hybrid_unmatched_weight) \
                    if args.uld_hybrid_matched_weight is not None else (share, 1.0 - share)
                loss = hybrid_uld(s_logp, t_logp, *self._matched, beta=args.beta, matched_weight=weights[0],
                                  unmatched_weight=weights[1])
            else:
                loss = uld_distance(s_logp.exp(), t_logp.exp())
            for g, positions in enumerate(groups["student"]):
                out[i, positions] = out[i, positions] + loss[g] / len(positions)
        return out * args.uld_distillation_weight

    def divergence(self, model, mb: dict) -> Tensor:
        return self.uld_per_token(model, mb) if self.args.use_uld_loss else super().divergence(model, mb)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The distillation loss (`divergence`), plus with `uld_crossentropy_weight` the student's cross-entropy
        (temperature 1) on the completion tokens, averaged the same way."""
        args = self.args
        loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if args.use_uld_loss and args.uld_crossentropy_weight:
            mask = inputs["loss_mask"]
            logp, _ = completion_logprobs(model, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"],
                                          inputs["completion_mask"], 1.0)
            loss = loss + args.uld_crossentropy_weight * aggregate_loss(
                -logp, mask, self.loss_mode, denominator=inputs["denominator"], max_length=args.max_completion_length)
            self.record({"uld/crossentropy": masked_mean(-logp.detach(), mask)}, "train")
        return (loss, None) if return_outputs else loss


def _ends(tokenizer, ids: list[int]) -> list[int]:
    """The character offset where each token's text ends in the decoded text of `ids` (decoded prefix by prefix, so
    multi-token characters and tokenizers that change spacing are measured as decoded)."""
    return [len(tokenizer.decode(ids[:k + 1])) for k in range(len(ids))]


def _row(source, i: int) -> Tensor:
    """Row i's (C, V) logits of a `completion_logits` result, float32."""
    if isinstance(source, LinearLogits):
        return (source.hidden[i] @ source.weight.t()).float()
    return source[i].float()
