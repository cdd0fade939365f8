"""Distillation from a teacher behind HTTP servers (TRL's experimental `ServerDistillationTrainer` and
`AsyncDistillationTrainer`).

`ServerDistillationTrainer`: `DistillationTrainer` whose teacher is always a server (TRL's `/get_sequence_logprobs`
protocol, `rollout.teacher_server`): the teacher's top-k and sampled-token log-probs of each completion are
requested in the training step, and the divergence is taken on that support (`core.divergences.
sparse_teacher_divergence`: the teacher's top-k for beta = 0, the sampled token for beta = 1, both top-1s between).

`AsyncDistillationTrainer`: on-policy distillation on the asynchronous engine (`trainers/online_async.py`,
`max_staleness`). The phase that runs in the background thread, `sample_and_score`, samples the student's
completions of generation batch g + d with the weights of d batches back and then requests their teacher
log-probs, so the HTTP round trips of the next batches overlap the training of this one; the answers travel with
the sampled batch (`Sampled.extra`, saved in checkpoints with the batches in flight: resume stays bit-identical).
Several teachers (TRL's MOPD, multi-teacher on-policy distillation): `teacher_server_urls` names them, and each
row's `teacher_id` column picks the one that scores it. The divergence's temperature is `teacher_temperature` (both
sides), the sampling one `temperature`; the support is the teacher's `teacher_top_k` tokens for beta = 0, its top-1
and the sampled token otherwise, with a tail bucket (`add_tail_bucket`).

Departures from TRL's AsyncDistillationTrainer: the student samples with posttrain's in-process sampler (TRL: a
vLLM server fed by weight transfers), a whole generation batch at a time, never more than max_staleness steps
behind (nothing is dropped), so `vllm_server_base_url`, `weight_sync_timeout`, `token_budget`,
`max_inflight_tasks`, `queue_maxsize` and `heartbeat_stale_after_s` are not fields here; one process.
`evaluate()` (TRL's trainer has no evaluation of its own) scores each eval row with the teacher its `teacher_id`
names, or with every teacher when the eval dataset has no such column, and reports each teacher's divergence
(`eval_teacher_loss/<teacher_id>`, as TRL's training metric `teacher_jsd/<teacher_id>`). Staleness is not
corrected for (as TRL's: the loss is a divergence, not a ratio).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch

from posttrain.rollout.teacher_server import TeacherServer
from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer

DEFAULT_TEACHER_URLS = {"default": "http://localhost:8001"}


@dataclass
class ServerDistillationConfig(DistillationConfig):
    """TRL's ServerDistillationConfig: DistillationConfig with the teacher always behind a server."""

    use_teacher_server: bool = field(default=True, metadata={"help": "Always True: the teacher is the server at "
                                     "teacher_model_server_url."})
    vllm_server_port: int = field(default=8001, metadata={"help": "Server mode: the student's vLLM server's port "
                                  "(8001: the teacher's server commonly holds 8000)."})

    def _check(self):
        if not self.use_teacher_server:
            raise ValueError("ServerDistillationConfig takes the teacher from teacher_model_server_url: "
                             "use_teacher_server must stay True (use DistillationConfig for a local teacher)")
        super()._check()


class ServerDistillationTrainer(DistillationTrainer):
    """Distillation from a teacher server. Signature as TRL's: `ServerDistillationTrainer(model, args=None,
    train_dataset=None, eval_dataset=None, processing_class=None, callbacks=None, optimizers=(None, None),
    peft_config=None)`."""

    config_class = ServerDistillationConfig
    _tag = "server-distillation"
    _name = "Server Distillation"

    def __init__(self, model, args: ServerDistillationConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None, **kwargs):
        super().__init__(model, None, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         peft_config=peft_config, **kwargs)


@dataclass
class AsyncDistillationConfig(DistillationConfig):
    """TRL's AsyncDistillationConfig fields and defaults on the distillation preset of the asynchronous engine."""

    max_completion_length: int = field(default=2048, metadata={"help": "Most tokens generated per completion."})
    max_length: int | None = field(default=None, metadata={"help": "Most tokens of prompt + completion (None: "
                                   "prompts kept whole, as TRL's AsyncDistillationConfig has no such limit)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass of on-policy generation (1.0: off)."})
    beta: float = field(default=0.0, metadata={"help": "The generalised JSD's interpolation: 0.0 forward KL on the "
                        "teacher's teacher_top_k support, otherwise on its top-1 and the sampled token."})
    max_staleness: int = field(default=4, metadata={"help": "How many optimizer steps behind the weights that "
                               "sample a batch may be: batches are sampled and scored by the teachers that far "
                               "ahead, in a background thread, while earlier ones train (0: synchronous)."})
    teacher_server_urls: dict | str | None = field(default=None, metadata={"help": "The teacher servers, "
                                                   "{name: base URL} (JSON, or one URL, on the command line); None: "
                                                   "{'default': 'http://localhost:8001'}. With several, each row's "
                                                   "teacher_id column names its teacher (MOPD)."})
    request_timeout: int = field(default=600, metadata={"help": "Seconds one request to a teacher server may "
                                 "take."})
    teacher_temperature: float = field(default=1.0, metadata={"help": "Softmax temperature of both models in the "
                                       "divergence (sent to the teachers); temperature is the sampling one."})
    teacher_top_k: int = field(default=8, metadata={"help": "Candidate tokens requested from the teacher per "
                               "position (the support of beta = 0)."})
    add_tail_bucket: bool = field(default=True, metadata={"help": "One more outcome holds the mass outside the "
                                  "support."})
    weight_sync_steps: int = field(default=1, metadata={"help": "Steps between publishing the weights to the "
                                   "sampler: only 1."})
    log_completions: bool = field(default=False, metadata={"help": "Accepted for TRL compatibility (no "
                                  "completions table)."})

    def _check(self):
        urls = self.teacher_server_urls
        if isinstance(urls, str):  # from the command line: a JSON object or one URL
            urls = json.loads(urls) if urls.strip().startswith("{") else {"default": urls}
        urls = dict(urls or DEFAULT_TEACHER_URLS)
        if not urls or not all(isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in urls.items()):
            raise ValueError(f"teacher_server_urls={self.teacher_server_urls!r}: give {{name: base URL}}, e.g. "
                             "{'default': 'http://localhost:8001'}")
        if self.teacher_top_k < 1 or self.teacher_temperature <= 0 or self.request_timeout <= 0:
            raise ValueError(f"teacher_top_k={self.teacher_top_k} must be >= 1, teacher_temperature="
                             f"{self.teacher_temperature} and request_timeout={self.request_timeout} > 0")
        if self.weight_sync_steps != 1:
            raise ValueError(f"weight_sync_steps={self.weight_sync_steps}: the sampler takes the weights of every "
                             "step (1); max_staleness bounds how old they may be")
        self.teacher_server_urls = urls
        self.use_teacher_server, self.teacher_model_server_url = True, next(iter(urls.values()))
        self.teacher_model_server_timeout = float(self.request_timeout)
        self.loss_top_k = self.teacher_top_k if self.beta == 0.0 else 1  # TRL's two supports
        self.loss_add_tail = self.add_tail_bucket
        super()._check()


class AsyncDistillationTrainer(DistillationTrainer):
    """On-policy distillation from teacher servers, the next batches sampled and scored in the background.
    Signature as TRL's: `AsyncDistillationTrainer(model, args=None, train_dataset=None, processing_class=None,
    callbacks=None, optimizers=(None, None), peft_config=None)`."""

    config_class = AsyncDistillationConfig
    samples_in_background = True  # the teacher is a server: the background thread samples and requests
    _tag = "async-distillation"
    _name = "Async Distillation"

    def __init__(self, model, args: AsyncDistillationConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None, **kwargs):
        super().__init__(model, None, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         peft_config=peft_config, **kwargs)
        args = self.args
        self.teacher_servers = {name: TeacherServer(url, args.teacher_model_server_timeout,
                                                    args.teacher_model_server_retries)
                                for name, url in args.teacher_server_urls.items()}
        if args.lmbda != 1.0:
            raise ValueError(f"lmbda={args.lmbda}: AsyncDistillationTrainer distils on the student's own samples "
                             "only (lmbda=1.0)")

    def divergence_temperature(self) -> float:
        return self.args.teacher_temperature

    def sample_and_score(self, inputs: dict):
        """The engine's sampling phase (in the background thread with max_staleness > 0), then each completion's
        teacher log-probs from the server its row names: the requests overlap the training of earlier batches."""
        sampled = super().sample_and_score(inputs)
        k = self.args.num_generations
        columns = {key: [v for v in values for _ in range(k)] for key, values in inputs["columns"].items()}
        start = time.perf_counter()
        rollout = sampled.rollout
        sampled.extra = self.teacher_answers({key: getattr(rollout, key) for key in (
            "prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}, columns.get("teacher_id"))
        self.record({"teacher/request_time": time.perf_counter() - start}, "train")  # kept with the batch in the
        # background thread (online.record), logged when it trains
        return sampled

    def teacher_answers(self, batch: dict, teacher_ids: list | None) -> dict[str, torch.Tensor]:
        """`teacher_top_ids`, `teacher_top_logp` (N, C, teacher_top_k), `teacher_sampled_logp` (N, C) of a batch's
        prompt and completion ids and masks, each row from the teacher its `teacher_id` names (the only one when
        there is one)."""
        N = batch["completion_ids"].shape[0]
        teacher_ids = self.row_teachers(teacher_ids, N)
        out = None
        for name in dict.fromkeys(teacher_ids):  # each teacher once, with its rows
            rows = torch.tensor([i for i, t in enumerate(teacher_ids) if t == name])
            got = self.server_logprobs({key: batch[key][rows] for key in ("prompt_ids", "prompt_mask",
                                                                          "completion_ids", "completion_mask")},
                                       self.args.teacher_top_k, server=self.teacher_servers[name])
            if out is None:
                out = {key: value.new_empty((N, *value.shape[1:])) for key, value in got.items()}
            for key, value in got.items():
                out[key][rows] = value
        return {"teacher_top_ids": out["top_ids"], "teacher_top_logp": out["top_logp"],
                "teacher_sampled_logp": out["sampled_logp"]}

    def row_teachers(self, teacher_ids: list | None, n: int) -> list[str]:
        """Each of `n` rows' teacher name: its `teacher_id` (checked), or the only teacher when there is no column."""
        names = list(self.teacher_servers)
        if teacher_ids is None:
            if len(names) > 1:
                raise ValueError(f"teacher_server_urls names {len(names)} teachers {names}: each row needs a "
                                 "'teacher_id' column naming its teacher; train_dataset has none")
            return names * n
        unknown = [(i, t) for i, t in enumerate(teacher_ids) if t not in self.teacher_servers]
        if unknown:
            raise ValueError(f"row {unknown[0][0]}: teacher_id {unknown[0][1]!r} is not one of teacher_server_urls' "
                             f"names {names}")
        return list(teacher_ids)

    def eval_teacher_names(self) -> list[str]:
        return list(self.teacher_servers)

    def eval_terms(self, mb: dict, columns: dict) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """Each teacher's divergence on the eval rows whose `teacher_id` names it; without the column, every
        teacher's on every row (how far the student is from each)."""
        ids = columns.get("teacher_id")
        ids = self.row_teachers(ids, len(ids)) if ids is not None else None
        terms = []
        for name in self.teacher_servers:
            rows = [i for i in range(mb["completion_ids"].shape[0]) if ids is None or ids[i] == name]
            if not rows:
                continue
            sub = {key: value[rows] for key, value in mb.items()}
            sub.update({key: value.to(sub["completion_ids"].device)
                        for key, value in self.teacher_answers(sub, [name] * len(rows)).items()})
            terms.append((name, self.divergence(self.policy, sub), sub["loss_mask"]))
        return terms

    @torch.no_grad()
    def make_experience(self, inputs: dict) -> list:
        """The batch sampled and scored by the teachers ahead (the background thread's), in micro-batches."""
        self._start_time = self._start_time or time.time()
        sampled = self.rollouts.take(inputs) if self.rollouts is not None else self.sample_and_score(inputs)
        for metrics, mode in sampled.records:  # recorded while it was sampled
            self.record(metrics, mode)
        rollout = sampled.rollout
        batch = {key: getattr(rollout, key) for key in ("prompt_ids", "prompt_mask", "completion_ids",
                                                        "completion_mask")}
        batch.update(sampled.extra)
        loss_mask = None if rollout.tool_mask is None else batch["completion_mask"] * (1 - rollout.tool_mask)
        return self.finish_batch(batch, loss_mask, on_policy=True)

    def server_logprobs(self, mb: dict, top_k: int, server=None, temperature=None) -> dict[str, torch.Tensor]:
        """In training, the answers that came with the batch (cut to the micro-batch's completion columns);
        otherwise (evaluation) a request."""
        if "teacher_top_ids" not in mb or server is not None:
            return super().server_logprobs(mb, top_k, server, temperature)
        C = mb["completion_ids"].shape[1]
        return {"top_ids": mb["teacher_top_ids"][:, :C, :top_k], "top_logp": mb["teacher_top_logp"][:, :C, :top_k],
                "sampled_logp": mb["teacher_sampled_logp"][:, :C]}
