"""On-policy distillation: a student learns a teacher's next-token distributions on the student's own samples
(Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes", GKD).

For each generation batch, with probability `lmbda` the completions are the student's own samples (the
online engine's sampler), otherwise the dataset's `completion` column (supervised KD; with GKD's `seq_kd`,
the teacher's samples instead). At every completion position the loss is the generalised JSD(beta) between
the student's and the teacher's distributions over the vocabulary (`core.divergences`: beta = 0 the forward
KL(teacher || student), beta = 1 the reverse KL(student || teacher)), at `temperature`, optionally on a
top-k support (`loss_top_k`, with a tail bucket `loss_add_tail`); the per-token values are averaged with
the engine's global token denominator. Both models' logits are made a block of positions at a time from
their final hidden states (`core.divergences.LinearLogits`) where the output layer is plain, so neither
model's (tokens x vocabulary) logits are ever whole.

A preset of the online engine (`posttrain.trainers.online`): its prompt batches, sampler, micro-batches,
denominators, checkpoints and resume; `make_experience` chooses where the completions come from and
`compute_loss` is the divergence. The teacher is a frozen model prepared as the engine's reference model
(`BaseTrainer.make_reference`: dtype and device, sharded under ZeRO-3 / FSDP2); without one it is a frozen
copy of the student's initial weights (or, with PEFT, the adapter-disabled student), as TRL's default.

Departures from TRL: the on-/off-policy choice is made per generation batch (TRL: per gradient-accumulation
slice; the same with steps_per_generation == gradient_accumulation_steps, the default); `beta` is the
divergence's interpolation here, never a KL-to-reference coefficient, so no reference model is loaded;
the reverse-KL top-1 token in "sampled" mode of an off-policy batch is the dataset's token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from posttrain.core.divergences import token_divergence
from posttrain.core.masked import aggregate_loss, masked_mean
from posttrain.data.tokenize import encode_prompt_completion
from posttrain.forward.completions import completion_logits
from posttrain.models import loading
from posttrain.models.modes import unwrap
from posttrain.rollout.generate import generate
from posttrain.trainers.online import OnlineTrainer
from posttrain.trainers.online_config import OnlineConfig, estimator_help


@dataclass
class DistillationConfig(OnlineConfig):
    """TRL's DistillationConfig fields and defaults on the online engine's configuration."""

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})
    max_length: int | None = field(default=1024, metadata={"help": "Most tokens of prompt + completion: prompts "
                                   "keep their last max_length - max_completion_length tokens when "
                                   "max_prompt_length is None."})
    max_prompt_length: int | None = field(default=None, metadata={"help": "Keep the last this many prompt tokens "
                                          "(None: max_length - max_completion_length)."})
    max_completion_length: int = field(default=512, metadata={"help": "Most tokens generated per completion (and "
                                       "kept of a dataset completion)."})
    num_generations: int = field(default=1, metadata={"help": "Completions per prompt in on-policy batches."})
    top_p: float = field(default=0.95, metadata={"help": "Nucleus sampling mass of on-policy generation."})
    advantage_estimator: str = field(default="reinforce_pp", metadata={"help": estimator_help(
        "Not used by distillation (no rewards); a one-sample estimator so that num_generations=1 is valid.")})
    replay_linear_outputs: bool = field(default=False, metadata={"help": "Not used by distillation (the loss "
                                        "reads logits, not the sampler's linear outputs)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature, and the temperature of both "
                               "models' softmax in the loss."})
    lmbda: float = field(default=1.0, metadata={"help": "Probability that a generation batch is on-policy (the "
                         "student's samples); otherwise the dataset's completions. 0: fully off-policy, 1: fully "
                         "on-policy."})
    beta: float = field(default=1.0, metadata={"help": "Interpolation of the generalised JSD loss: 0.0 = forward "
                        "KL(teacher || student), 0.5 = JSD, 1.0 = reverse KL(student || teacher). Not a KL-penalty "
                        "coefficient: no reference model is loaded."})
    reverse_kl_top_1_mode: str = field(default="sampled", metadata={"help": "With beta > 0 and loss_top_k == 1, the "
                                       "student-side top-1 token: 'sampled' (the completion's token) or 'argmax' "
                                       "(the student's most likely token)."})
    loss_top_k: int = field(default=1, metadata={"help": "Restrict both distributions to K tokens (the teacher's "
                            "top-k for forward KL, the student's for reverse KL, their union in between) before the "
                            "divergence; 0: the full vocabulary (exact)."})
    loss_add_tail: bool = field(default=True, metadata={"help": "With loss_top_k > 0: one more outcome holds the "
                                "mass outside the support (else both distributions are renormalised on it)."})
    disable_dropout: bool = field(default=True, metadata={"help": "No dropout in the student."})
    teacher_model_name_or_path: str | None = field(default=None, metadata={"help": "The teacher, when the trainer "
                                                   "gets no teacher_model (None: a frozen copy of the student)."})
    teacher_model_revision: str | None = field(default=None, metadata={"help": "Revision (branch, tag, commit) of "
                                               "the teacher loaded from a name."})
    teacher_model_init_kwargs: dict | None = field(default=None, metadata={"help": "Keyword arguments for "
                                                   "from_pretrained when the teacher is given as a string."})
    use_teacher_server: bool = field(default=False, metadata={"help": "Take the teacher's log-probs from a server "
                                     "(not implemented here: refused)."})
    teacher_model_server_url: str | None = field(default=None, metadata={"help": "The teacher server's base URL "
                                                 "(with use_teacher_server)."})
    log_completions_steps: int = field(default=100, metadata={"help": "Accepted for TRL compatibility; completions "
                                       "are not logged by distillation trainers."})
    use_fused_linear_loss: bool = field(default=False, metadata={"help": "Accepted for TRL compatibility: the loss "
                                        "always takes each model's output layer a block of positions at a time where "
                                        "the layer is plain, so no (tokens x vocabulary) logits are made."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow the student's and the teacher's custom "
                                    "code from the Hub when loaded from a name."})
    ds3_gather_for_generation: bool = field(default=True, metadata={"help": "Accepted for TRL compatibility: under "
                                            "ZeRO-3 the sampler gathers each layer as its forward runs."})
    cache_implementation: str | None = field(default=None, metadata={"help": "Accepted for TRL compatibility: "
                                             "posttrain's sampler keeps its own KV cache (None only)."})
    log_unique_prompts: bool = field(default=False, metadata={"help": "Accepted for TRL compatibility (no "
                                     "completions table)."})
    vllm_sync_frequency: int = field(default=1, metadata={"help": "Steps between weight syncs to vLLM: only 1 "
                                     "(every step) is supported."})

    def _check(self):
        if isinstance(self.teacher_model_init_kwargs, str):  # from the command line, as JSON
            import json

            self.teacher_model_init_kwargs = json.loads(self.teacher_model_init_kwargs)
        if self.max_prompt_length is None and self.max_length is not None:
            if self.max_length <= self.max_completion_length:
                raise ValueError(f"max_length={self.max_length} leaves no prompt tokens after max_completion_length="
                                 f"{self.max_completion_length}; raise max_length or set max_prompt_length")
            self.derive("max_prompt_length", self.max_length - self.max_completion_length)
        super()._check()
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError(f"lmbda={self.lmbda} must be in [0, 1] (the probability of an on-policy batch)")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta={self.beta} must be in [0, 1] (0: forward KL, 1: reverse KL)")
        if self.loss_top_k < 0:
            raise ValueError(f"loss_top_k={self.loss_top_k} must be >= 0 (0: the full vocabulary)")
        if self.reverse_kl_top_1_mode not in ("sampled", "argmax"):
            raise ValueError(f"reverse_kl_top_1_mode={self.reverse_kl_top_1_mode!r}: choose 'sampled' or 'argmax'")
        if self.trust_remote_code:  # the student's loading reads model_init_kwargs, the teacher's its own
            self.model_init_kwargs = {**(self.model_init_kwargs or {}), "trust_remote_code": True}
            self.teacher_model_init_kwargs = {**(self.teacher_model_init_kwargs or {}), "trust_remote_code": True}
        if self.cache_implementation is not None:
            raise ValueError(f"cache_implementation={self.cache_implementation!r}: posttrain's sampler keeps its own "
                             "KV cache; leave it None")
        if self.vllm_sync_frequency != 1:
            raise ValueError(f"vllm_sync_frequency={self.vllm_sync_frequency}: posttrain syncs vLLM's weights every "
                             "step (1)")
        if self.use_teacher_server:
            raise ValueError("use_teacher_server=True is not implemented in posttrain yet: give a local teacher "
                             "(teacher_model or teacher_model_name_or_path)")


class DistillationTrainer(OnlineTrainer):
    """On-policy distillation on the online engine. Signature as TRL's: `DistillationTrainer(model,
    teacher_model=None, args=None, train_dataset=None, eval_dataset=None, processing_class=None, callbacks=None,
    optimizers=(None, None), peft_config=None)`; `teacher_model` a model or a name."""

    config_class = DistillationConfig
    _tag = "distillation"
    samples_in_background = False  # samples with a teacher / the reference too (max_staleness refused)
    _name = "Distillation"
    _citation = """@inproceedings{agarwal2024onpolicy,
    title     = {{On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes}},
    author    = {Rishabh Agarwal and Nino Vieillard and Yongchao Zhou and Piotr Stanczyk and Sabela Ramos and
                 Matthieu Geist and Olivier Bachem},
    booktitle = {The Twelfth International Conference on Learning Representations, {ICLR} 2024},
    year      = 2024
}"""
    checkpointed = OnlineTrainer.checkpointed + ("_mixing",)

    def __init__(self, model, teacher_model=None, args: DistillationConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None,
                 data_collator=None, **kwargs):
        if data_collator is not None:
            raise ValueError("data_collator is not used: the distillation trainers tokenise prompts and completions "
                             "themselves; leave it None")
        train_dataset, eval_dataset = split_messages(train_dataset), split_messages(eval_dataset)
        super().__init__(model, reward_funcs=[no_reward], args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config, **kwargs)
        args = self.args
        teacher = teacher_model if teacher_model is not None else args.teacher_model_name_or_path
        if isinstance(teacher, str):
            init = dict(args.teacher_model_init_kwargs or {})
            if args.teacher_model_revision:
                init.setdefault("revision", args.teacher_model_revision)
            teacher = loading.load_causal_lm(teacher, **init)
        self.teacher_model = self.make_reference(teacher)  # frozen, placed (and sharded) as a reference model
        self._mixing = torch.Generator().manual_seed(args.seed + 15485863)  # the on-/off-policy draws, checkpointed

    @staticmethod
    def uses_reference(args) -> bool:
        return False  # beta picks the divergence; the teacher is made in __init__

    @contextlib.contextmanager
    def teacher(self):
        """The teacher model (the adapter-disabled student under PEFT without a teacher), no gradients."""
        with torch.no_grad(), self.reference_context(self.teacher_model):
            yield self.teacher_model if self.teacher_model is not None else self.policy

    # ------------------------------------------------------------------ experience
    def off_policy_batch(self, inputs: dict, prompts: list, columns: dict) -> dict:
        """An off-policy batch: the dataset's completions (the `completion` column, text or messages)."""
        if "completion" not in columns:
            raise ValueError("an off-policy batch (lmbda < 1) reads the dataset's 'completion' column, which "
                             f"train_dataset lacks (it has {sorted(columns)}); add it or set lmbda=1.0")
        tok, limit = self.processing_class, self.args.max_completion_length
        rows = [encode_prompt_completion(tok, p, c, row=i)["completion_ids"][:limit]
                for i, (p, c) in enumerate(zip(prompts, columns["completion"]))]
        prompt_ids = [ids for ids in inputs["prompt_ids"] for _ in range(self.args.num_generations)]
        P, C = max(map(len, prompt_ids)), max(max(map(len, rows)), 1)
        pad = tok.pad_token_id
        return {"prompt_ids": torch.tensor([[pad] * (P - len(r)) + r for r in prompt_ids]),
                "prompt_mask": torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in prompt_ids]),
                "completion_ids": torch.tensor([r + [pad] * (C - len(r)) for r in rows]),
                "completion_mask": torch.tensor([[1] * len(r) + [0] * (C - len(r)) for r in rows])}

    def teacher_completions(self, inputs: dict) -> dict:
        """The teacher's samples of the batch's prompts (sequence-level KD: GKD's `seq_kd`)."""
        tok = self.processing_class
        with self.teacher() as teacher:
            rollout = generate(unwrap(teacher), inputs["prompt_ids"], self.sampling, pad_token_id=tok.pad_token_id,
                               eos_token_id=tok.eos_token_id, tokenizer=tok, generator=self.generator)
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
        return {key: getattr(rollout, key) for key in keys}

    @torch.no_grad()
    def make_experience(self, inputs: dict) -> list[dict]:
        """The generation batch's completions, on-policy with probability lmbda, split into micro-batches."""
        k = self.args.num_generations
        self._start_time = self._start_time or time.time()  # for the logged episodes per second
        prompts = [p for p in inputs["prompt"] for _ in range(k)]
        columns = {key: [v for v in values for _ in range(k)] for key, values in inputs["columns"].items()}
        on_policy = bool(torch.rand((), generator=self._mixing) < self.args.lmbda)
        loss_mask = None
        if on_policy:
            rollout, _ = self.roll_out(inputs, prompts, columns)
            batch = {key: getattr(rollout, key) for key in ("prompt_ids", "prompt_mask", "completion_ids",
                                                            "completion_mask")}
            if rollout.tool_mask is not None:  # fed tool results: context, not trained on
                loss_mask = batch["completion_mask"] * (1 - rollout.tool_mask)
        else:
            batch = self.off_policy_batch(inputs, prompts, columns)
        device = self.accelerator.device
        batch = {key: value.to(device) for key, value in batch.items()}
        batch["loss_mask"] = (batch["completion_mask"] if loss_mask is None else loss_mask.to(device)).clone()
        self._episodes += batch["loss_mask"].shape[0] * self.accelerator.num_processes
        self.record({"on_policy": float(on_policy),
                     "completions/mean_length": batch["loss_mask"].sum(1).float().mean()}, "train")
        return self._micro_batches(batch)

    # ------------------------------------------------------------------ loss
    def divergence(self, model, mb: dict) -> Tensor:
        """Per-token divergence (B, C) between the student (`model`, with gradients) and the teacher on `mb`."""
        args = self.args
        student = completion_logits(model, mb)
        with self.teacher() as teacher:
            target = completion_logits(teacher, mb)
        sampled = mb["completion_ids"] if args.reverse_kl_top_1_mode == "sampled" else None
        return token_divergence(student, target, mb["loss_mask"], "generalized_jsd", beta=args.beta,
                                temperature=args.temperature, top_k=args.loss_top_k, add_tail=args.loss_add_tail,
                                sampled_ids=sampled).float()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mask = inputs["loss_mask"]
        per_token = self.divergence(model, inputs)
        loss = aggregate_loss(per_token, mask, self.loss_mode, denominator=inputs["denominator"],
                              max_length=self.args.max_completion_length)
        self.record({"divergence": masked_mean(per_token.detach(), mask)}, "train")
        return (loss, None) if return_outputs else loss

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """The student's samples of the eval prompts (one each, training sampling settings): `eval_loss` the mean
        per-token divergence to the teacher, and the mean completion length."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset: give one here or to the trainer")
        self._check_dataset(dataset, "eval_dataset")
        acc, bs = self.accelerator, self.args.per_device_eval_batch_size
        mine = [dataset[i] for i in range(acc.process_index, len(dataset), acc.num_processes)]
        sampling = dataclasses.replace(self.sampling, num_generations=1)
        total, tokens, lengths = 0.0, 0.0, []
        for s in range(0, len(mine), bs):
            batch = self._collate(mine[s:s + bs])
            rollout = self.sample_completions(batch["prompt_ids"], sampling)
            mb = {key: getattr(rollout, key).to(acc.device) for key in ("prompt_ids", "prompt_mask", "completion_ids",
                                                                      "completion_mask")}
            mb["loss_mask"] = mb["completion_mask"]
            total += float(self.divergence(self.policy, mb).sum())
            tokens += float(mb["loss_mask"].sum())
            lengths += mb["loss_mask"].sum(1).tolist()
        sums = torch.tensor([total, tokens, sum(lengths), len(lengths)], dtype=torch.float64, device=acc.device)
        if acc.num_processes > 1:
            sums = acc.reduce(sums, reduction="sum")
        p = metric_key_prefix
        metrics = {f"{p}_loss": float(sums[0] / sums[1].clamp(min=1)),
                   f"{p}_completions/mean_length": float(sums[2] / sums[3].clamp(min=1))}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


def no_reward(completions, **kwargs) -> list[float]:
    """The engine's reward slot, unused by distillation (the teacher is the signal)."""
    return [0.0] * len(completions)


def split_messages(dataset):
    """A dataset in TRL's GKD form (a `messages` column, no `prompt`) as prompt (every message but the last) and
    completion (the last message, the assistant's); other datasets as they are."""
    columns = getattr(dataset, "column_names", None)
    if not columns or "messages" not in columns or "prompt" in columns:
        return dataset

    def split(row, index):
        messages = row["messages"]
        if len(messages) < 2 or messages[-1].get("role") != "assistant":
            raise ValueError(f"row {index}: 'messages' must end with an assistant message after at least one other "
                             f"message (the prompt); it has roles {[m.get('role') for m in messages]}")
        return {"prompt": messages[:-1], "completion": messages[-1:]}

    return dataset.map(split, with_indices=True, remove_columns=["messages"])
