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
copy of the student's initial weights (or, with PEFT, the adapter-disabled student), as TRL's default. With
`use_teacher_server`, the teacher is a server (`rollout.teacher_server`, TRL's protocol) that sends its top-k and
sampled-token log-probs; the divergence is then taken on TRL's support (the teacher's top-k for beta = 0, the
sampled token for beta = 1, both top-1s in between: `core.divergences.sparse_teacher_divergence`).

Departures from TRL: the on-/off-policy choice is made per generation batch (TRL: per gradient-accumulation
slice; the same with steps_per_generation == gradient_accumulation_steps, the default); `beta` is the
divergence's interpolation here, never a KL-to-reference coefficient, so no reference model is loaded;
the reverse-KL top-1 token in "sampled" mode of an off-policy batch is the dataset's token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from posttrain.core.divergences import sparse_teacher_divergence, token_divergence
from posttrain.core.masked import aggregate_loss, masked_mean
from posttrain.data.tokenize import encode_prompt_completion
from posttrain.forward.completions import completion_logits
from posttrain.models import loading
from posttrain.models.modes import unwrap
from posttrain.rollout.cpu_backend import keep_record, replay_rows
from posttrain.rollout.generate import generate
from posttrain.rollout.teacher_server import TeacherServer
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
    replay_linear_outputs: bool = field(default=True, metadata={"help": "On-policy batches: the student's training "
                                        "forward takes its decoder layers' linear outputs from the sampler's record "
                                        "instead of recomputing them (the engine's option; the teacher's forward "
                                        "always computes its own)."})
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
                                     "(TRL's /get_sequence_logprobs protocol, e.g. `trl vllm-serve`) instead of a "
                                     "local teacher: then beta = 0 needs loss_top_k > 0 (the teacher's top-k), "
                                     "beta > 0 needs loss_top_k = 1 and reverse_kl_top_1_mode='sampled'."})
    teacher_model_server_url: str | None = field(default=None, metadata={"help": "The teacher server's base URL, e.g. "
                                                 "'http://localhost:8000' (with use_teacher_server)."})
    teacher_model_server_timeout: float = field(default=240.0, metadata={"help": "Seconds one request to the teacher "
                                                "server may take, connecting and answering (posttrain's)."})
    teacher_model_server_retries: int = field(default=2, metadata={"help": "Further tries of a request when the "
                                              "teacher server is unreachable or answers 5xx / 429 (posttrain's)."})
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
            self._check_teacher_server()

    def _check_teacher_server(self):
        """What a teacher known only through a server's top-k and sampled-token log-probs allows (TRL's rules)."""
        if not (self.teacher_model_server_url or "").strip():
            raise ValueError("use_teacher_server=True needs teacher_model_server_url, e.g. 'http://localhost:8000'")
        if self.beta == 0.0 and self.loss_top_k < 1:
            raise ValueError(f"use_teacher_server=True with beta=0 needs loss_top_k > 0 (got {self.loss_top_k}): the "
                             "server sends the teacher's top-k log-probs, not its whole distribution")
        if self.beta > 0.0 and self.loss_top_k != 1:
            raise ValueError(f"use_teacher_server=True with beta={self.beta} > 0 needs loss_top_k=1 (got "
                             f"{self.loss_top_k}): the server knows the sampled token and its own top-1 only")
        if self.reverse_kl_top_1_mode != "sampled":
            raise ValueError("use_teacher_server=True needs reverse_kl_top_1_mode='sampled': the server cannot score "
                             "the student's own top-1 token")
        if self.teacher_model_server_timeout <= 0 or self.teacher_model_server_retries < 0:
            raise ValueError(f"teacher_model_server_timeout={self.teacher_model_server_timeout} must be > 0 and "
                             f"teacher_model_server_retries={self.teacher_model_server_retries} >= 0")


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
        reward_funcs = kwargs.pop("reward_funcs", None) or [no_reward]  # a preset that scores rollouts (SDPO)
        super().__init__(model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config, **kwargs)
        args = self.args
        self.teacher_server = None
        if args.use_teacher_server:
            if teacher_model is not None:
                raise ValueError("use_teacher_server=True takes the teacher's log-probs from teacher_model_server_url; "
                                 "give no teacher_model (or set use_teacher_server=False)")
            self.teacher_server = TeacherServer(args.teacher_model_server_url, args.teacher_model_server_timeout,
                                                args.teacher_model_server_retries)
        teacher = teacher_model if teacher_model is not None else args.teacher_model_name_or_path
        if args.use_teacher_server:
            teacher = None
        elif isinstance(teacher, str):
            init = dict(args.teacher_model_init_kwargs or {})
            if args.teacher_model_revision:
                init.setdefault("revision", args.teacher_model_revision)
            teacher = loading.load_causal_lm(teacher, **init)
        # frozen, placed (and sharded) as a reference model; with a server, no local teacher
        self.teacher_model = None if args.use_teacher_server else self.make_reference(teacher)
        self._mixing = torch.Generator().manual_seed(args.seed + 15485863)  # the on-/off-policy draws, checkpointed
        own = [name for name in ("divergence", "compute_loss", "make_experience")
               if getattr(type(self), name) is not getattr(DistillationTrainer, name)]
        if own or args.use_teacher_server:
            # a loss or batch of its own may not hand the record to the student's forward; with teacher servers the
            # synchronous and asynchronous trainers compute alike: none kept
            self.replays = False

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

    def teacher_inputs(self, inputs: dict, prompts: list, columns: dict) -> dict:
        """Tensors the teacher reads besides the student's batch, one row per completion (`teacher_prompt_*`: a
        prompt of the teacher's own, left-padded, kept whole by the micro-batch trim); none here."""
        return {}

    @torch.no_grad()
    def make_experience(self, inputs: dict) -> list[dict]:
        """The generation batch's completions, on-policy with probability lmbda, split into micro-batches."""
        k = self.args.num_generations
        self._start_time = self._start_time or time.time()  # for the logged episodes per second
        prompts = [p for p in inputs["prompt"] for _ in range(k)]
        columns = {key: [v for v in values for _ in range(k)] for key, values in inputs["columns"].items()}
        on_policy = bool(torch.rand((), generator=self._mixing) < self.args.lmbda)
        loss_mask = record = None
        if on_policy:
            rollout, _ = self.roll_out(inputs, prompts, columns)
            record = rollout.linear_outputs
            batch = {key: getattr(rollout, key) for key in ("prompt_ids", "prompt_mask", "completion_ids",
                                                            "completion_mask")}
            if rollout.tool_mask is not None:  # fed tool results: context, not trained on
                loss_mask = batch["completion_mask"] * (1 - rollout.tool_mask)
        else:
            batch = self.off_policy_batch(inputs, prompts, columns)
        batch.update(self.teacher_inputs(inputs, prompts, columns))
        return self.finish_batch(batch, loss_mask, on_policy, record)

    def finish_batch(self, batch: dict, loss_mask, on_policy: bool, record=None) -> list:
        """A generation batch's tensors on the device with their loss mask, counted and logged, in micro-batches.
        `record`: the sampler's record of the student's linear outputs for these rows (`accel/replay.py`), or None."""
        device = self.accelerator.device
        batch = {key: value.to(device) for key, value in batch.items()}
        batch["loss_mask"] = (batch["completion_mask"] if loss_mask is None else loss_mask.to(device)).clone()
        # the sampler's record of linear outputs, kept by the CPU backend for the student's forward while the student
        # cannot have moved since sampling (`accel/replay.py`); an off-policy batch lets any kept record go
        record = record if on_policy and self.old_is_current and self.replays else None
        keep_record(self.policy, record)
        if record is not None:
            batch["rollout_row"] = torch.arange(len(batch["loss_mask"]), device=device)
        self._episodes += batch["loss_mask"].shape[0] * self.accelerator.num_processes
        self.record({"on_policy": float(on_policy),
                     "completions/mean_length": batch["loss_mask"].sum(1).float().mean()}, "train")
        return self._micro_batches(batch)

    # ------------------------------------------------------------------ loss
    def divergence(self, model, mb: dict) -> Tensor:
        """Per-token divergence (B, C) between the student (`model`, with gradients) and the teacher on `mb`."""
        args = self.args
        if self.teacher_server is not None:
            return self.server_divergence(model, mb)
        student = completion_logits(model, mb, replay=self.student_replay(mb))
        with self.teacher() as teacher:
            target = completion_logits(teacher, mb)
        sampled = mb["completion_ids"] if args.reverse_kl_top_1_mode == "sampled" else None
        return token_divergence(student, target, mb["loss_mask"], "generalized_jsd", beta=args.beta,
                                temperature=args.temperature, top_k=args.loss_top_k, add_tail=args.loss_add_tail,
                                sampled_ids=sampled).float()

    def student_replay(self, mb) -> tuple | None:
        """(record, rollout rows, last use) for the student's forward of micro-batch `mb` when the CPU backend keeps
        the sampler's record of its rows (on-policy, weights unchanged since sampling), else None."""
        if not mb.get("old_is_current") or mb.get("rollout_row") is None:
            return None
        return replay_rows(self.policy, mb["rollout_row"])

    def server_logprobs(self, mb: dict, top_k: int, server: TeacherServer | None = None,
                        temperature: float | None = None) -> dict[str, Tensor]:
        """The teacher server's log-probs of `mb`'s completions at `temperature` (the divergence's): `top_ids`,
        `top_logp` (B, C, top_k) its most likely tokens (-inf past a completion), `sampled_logp` (B, C) each
        completion token's (-inf where the server sent none). `server`: the trainer's teacher server by default."""
        server = server or self.teacher_server
        temperature = self.divergence_temperature() if temperature is None else temperature
        prompts = [ids[m.bool()].tolist() for ids, m in zip(mb["prompt_ids"], mb["prompt_mask"])]
        completions = [ids[m.bool()].tolist() for ids, m in zip(mb["completion_ids"], mb["completion_mask"])]
        reply = server.sequence_logprobs([p + c for p, c in zip(prompts, completions)], list(map(len, prompts)),
                                         top_k, temperature)
        (B, C), device = mb["completion_ids"].shape, mb["completion_ids"].device
        out = {"top_ids": torch.zeros(B, C, top_k, dtype=torch.long), "top_logp": torch.full((B, C, top_k), -math.inf),
               "sampled_logp": torch.full((B, C), -math.inf)}
        for i, n in enumerate(map(len, completions)):  # completions are right-padded: position j is token j
            if n:
                out["top_ids"][i, :n] = torch.tensor(reply["logprob_token_ids"][i])[:, :top_k]
                out["top_logp"][i, :n] = torch.tensor(reply["logprobs"][i])[:, :top_k]
                if "actual_logprobs" in reply:
                    out["sampled_logp"][i, :n] = torch.tensor(reply["actual_logprobs"][i])
        return {key: value.to(device) for key, value in out.items()}

    def divergence_temperature(self) -> float:
        """The softmax temperature of both models in the loss (the sampling temperature here)."""
        return self.args.temperature

    def server_divergence(self, model, mb: dict) -> Tensor:
        """Per-token divergence (B, C) to a teacher server on TRL's support: the teacher's top-k for beta = 0; the
        sampled token for beta = 1; both top-1s in between (the teacher's top-1 and the sampled token)."""
        args, mask = self.args, mb["loss_mask"]
        got = self.server_logprobs(mb, max(args.loss_top_k, 1))
        sampled = mb["completion_ids"][..., None]
        if args.beta == 0.0:
            index, teacher = got["top_ids"], got["top_logp"]
        elif args.beta == 1.0:
            index, teacher = sampled, got["sampled_logp"][..., None]
        else:
            index = torch.cat([got["top_ids"][..., :1], sampled], -1)
            teacher = torch.cat([got["top_logp"][..., :1], got["sampled_logp"][..., None]], -1)
        valid = torch.ones_like(index, dtype=torch.bool)
        if index.shape[-1] == 2 and args.beta not in (0.0, 1.0):
            valid[..., 1] = index[..., 1] != index[..., 0]  # the sampled token is the teacher's top-1: counted once
        missing = mask.bool() & ~torch.isfinite(torch.where(valid, teacher, 0.0)).all(-1)
        if missing.any():
            raise ValueError(f"the teacher server sent no log-probs for {int(missing.sum())} of {int(mask.sum())} "
                             "completion tokens the loss needs (the sampled tokens' `actual_logprobs` when beta > 0)")
        student = completion_logits(model, mb, replay=self.student_replay(mb))
        return sparse_teacher_divergence(student, mask, index, valid, teacher, "generalized_jsd",
                                         beta=args.beta, temperature=self.divergence_temperature(),
                                         add_tail=args.loss_add_tail).float()

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
        per-token divergence to the teacher, and the mean completion length; with named teachers (`eval_terms`),
        `eval_teacher_loss/<teacher_id>` and `eval_teacher_token_frac/<teacher_id>` per teacher too."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset: give one here or to the trainer")
        self._check_dataset(dataset, "eval_dataset")
        acc, bs = self.accelerator, self.args.per_device_eval_batch_size
        mine = [dataset[i] for i in range(acc.process_index, len(dataset), acc.num_processes)]
        sampling = dataclasses.replace(self.sampling, num_generations=1)
        names = self.eval_teacher_names()  # named teachers: a loss and a token count each
        sums = torch.zeros(4 + 2 * len(names), dtype=torch.float64)  # loss, tokens, length sum, rows, per teacher
        for s in range(0, len(mine), bs):
            batch = self._collate(mine[s:s + bs])
            rollout = self.sample_completions(batch["prompt_ids"], sampling)
            mb = {key: getattr(rollout, key).to(acc.device) for key in ("prompt_ids", "prompt_mask", "completion_ids",
                                                                      "completion_mask")}
            mb.update({key: value.to(acc.device) for key, value in
                       self.teacher_inputs(batch, batch["prompt"], batch["columns"]).items()})
            mb["loss_mask"] = mb["completion_mask"]
            for name, divergence, mask in self.eval_terms(mb, batch["columns"]):
                total, tokens = float(divergence.sum()), float(mask.sum())
                sums[:2] += torch.tensor([total, tokens], dtype=torch.float64)
                if name is not None:
                    i = 4 + 2 * names.index(name)
                    sums[i:i + 2] += torch.tensor([total, tokens], dtype=torch.float64)
            lengths = mb["completion_mask"].sum(1)
            sums[2:4] += torch.tensor([float(lengths.sum()), len(lengths)], dtype=torch.float64)
        sums = sums.to(acc.device)
        if acc.num_processes > 1:
            sums = acc.reduce(sums, reduction="sum")
        p = metric_key_prefix
        metrics = {f"{p}_loss": float(sums[0] / sums[1].clamp(min=1)),
                   f"{p}_completions/mean_length": float(sums[2] / sums[3].clamp(min=1))}
        for i, name in enumerate(names):  # TRL's teacher_jsd/<id> and teacher_token_frac/<id>, on the eval prompts
            metrics[f"{p}_teacher_loss/{name}"] = float(sums[4 + 2 * i] / sums[5 + 2 * i]) if sums[5 + 2 * i] else \
                math.nan
            metrics[f"{p}_teacher_token_frac/{name}"] = float(sums[5 + 2 * i] / sums[1].clamp(min=1))
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def eval_teacher_names(self) -> list[str]:
        """The teachers evaluate() reports one by one (none: the one teacher)."""
        return []

    def eval_terms(self, mb: dict, columns: dict) -> list[tuple[str | None, Tensor, Tensor]]:
        """(teacher name or None, per-token divergence, its loss mask) of an eval micro-batch: the one teacher."""
        return [(None, self.divergence(self.policy, mb), mb["loss_mask"])]


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
