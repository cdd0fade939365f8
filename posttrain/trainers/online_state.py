"""The online engine's checkpointed state: besides transformers' checkpoint and BaseTrainer's, the sampler's
and the shuffle's generators, the episode count, a streamed dataset's place, the generation batch in progress
(its micro-batches not yet trained on, `core.batch.Experience.state`), and the critic saved next to the
policy. A mixin of `OnlineTrainer` (online.py); resuming is bit-identical to never stopping."""

from __future__ import annotations

import os
import time

from posttrain.core.batch import Experience
from posttrain.models.value_head import CausalLMWithValueHead, PolicyWithCritic
from posttrain.rollout.cpu_backend import keep_record
from posttrain.trainers.base import BaseTrainer, is_streamed


class OnlineCheckpoints:
    """Checkpointed attributes and model saving of `OnlineTrainer`."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        model = self.accelerator.unwrap_model(self.model)
        if isinstance(model, (CausalLMWithValueHead, PolicyWithCritic)):
            output_dir = output_dir or self.args.output_dir
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                model.save_pretrained(output_dir)
                self.processing_class.save_pretrained(output_dir)
                with open(os.path.join(output_dir, "README.md"), "w") as f:  # the model card, as BaseTrainer writes it
                    f.write(self.model_card(os.path.basename(os.path.normpath(output_dir))))
            return
        super().save_model(output_dir, _internal_call)

    # ------------------------------------------------------------------ checkpoints
    # Besides transformers' checkpoint (weights, optimizer, scheduler, global RNGs, trainer state and the data
    # position) and BaseTrainer's, a step depends on the sampler's and the micro-batch shuffle's generators,
    # the episode count and the generation batch in progress: BaseTrainer saves these attributes with each
    # checkpoint, per process. The critic is saved with the policy (`save_model`).
    # "_rollouts_in_flight" comes before "generator": saving it waits for the background sampler, which draws on it
    checkpointed = BaseTrainer.checkpointed + ("_rollouts_in_flight", "generator", "_shuffle", "_episodes", "_last_sample_step",
                                               "_generation_in_progress", "_stream_position", "_top_up_position")

    @property
    def _top_up_position(self) -> dict | None:
        """Where dynamic sampling's extra prompts stand (`prompts.top_up_prompts`); None (not saved) without it."""
        return dict(self._top_up_pos) if self.args.filter_groups_enable else None

    @_top_up_position.setter
    def _top_up_position(self, position: dict):
        self._top_up_pos, self._top_up = dict(position), None  # read on from there

    @property
    def _rollouts_in_flight(self) -> list | None:
        """With asynchronous rollouts, the generation batches sampled ahead (online_async.py), once sampled: the
        weights that sampled them are not in the checkpoint, so they are saved rather than sampled again."""
        rollouts = getattr(self, "rollouts", None)
        return None if rollouts is None else rollouts.state()

    @_rollouts_in_flight.setter
    def _rollouts_in_flight(self, state: list):
        if getattr(self, "rollouts", None) is None:
            raise ValueError(f"the checkpoint holds {len(state)} generation batch(es) sampled ahead by asynchronous "
                             "rollouts; resume with the max_staleness it was saved with")
        self.rollouts.load_state(state)

    @property
    def _stream_position(self) -> dict | None:
        """A streamed train_dataset's place (`_PromptStream`); None (not saved) for other datasets."""
        return dict(self._stream_pos) if is_streamed(self.train_dataset) else None

    @_stream_position.setter
    def _stream_position(self, position: dict):
        self._stream_pos, self._stream_resumed = dict(position), True

    @property
    def _generation_in_progress(self) -> dict:
        """What a checkpoint taken inside a generation batch (several optimizer steps per batch:
        steps_per_generation > gradient_accumulation_steps, or num_iterations > 1) needs to go on: the
        micro-batches not yet trained on and the batch's samples; also metrics not yet logged and the
        sampling time so far (for `eps`). Between generation batches, nothing of the batch is kept."""
        pending = self._next_micro < len(self._buffer)
        return {"buffer": [mb.state() for mb in self._buffer] if pending else [],
                "next_micro": self._next_micro if pending else 0,
                "samples": self._samples if pending else None, "plan": self._generation_plan(),
                "elapsed": None if self._start_time is None else time.time() - self._start_time,
                "metrics": {mode: dict(values) for mode, values in self._metrics.items()}}

    def _generation_plan(self) -> dict[str, int]:
        """The settings that cut a generation batch into micro-batches and optimizer steps."""
        names = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                 "num_iterations", "num_generations")
        return {**{n: getattr(self.args, n) for n in names}, "processes": self.accelerator.num_processes}

    def _check_generation_plan(self, state: dict):
        """Refuse to finish a stored generation batch under settings that cut it otherwise (its micro-batches
        would not match the steps left: transformers' loop would index past them)."""
        plan, now = state.get("plan"), self._generation_plan()
        if plan is None:  # written before plans were stored: the batch's length tells
            expected = self.args.steps_per_generation * self.args.num_iterations
            plan, now = {"micro-batches per generation batch": len(state["buffer"])}, \
                {"micro-batches per generation batch": expected}
        changed = {k: (v, now.get(k)) for k, v in plan.items() if now.get(k) != v}
        if changed:
            was = ", ".join(f"{k}={old}" for k, (old, _) in changed.items())
            raise ValueError(
                f"the checkpoint was taken inside a generation batch (micro-batch {state['next_micro']} of "
                f"{len(state['buffer'])}) planned with {was}; this run has "
                f"{', '.join(f'{k}={new}' for k, (_, new) in changed.items())}. Resume with the checkpoint's "
                f"{was} to finish the stored batch (change it later from a checkpoint taken between generation "
                "batches, i.e. save_steps a multiple of the optimizer steps per generation batch), or resume from "
                "an earlier checkpoint taken between generation batches")

    @_generation_in_progress.setter
    def _generation_in_progress(self, state: dict):
        if state["buffer"]:
            self._check_generation_plan(state)
        # the replay record is kept only within one optimizer step (old == current), never across a checkpoint:
        # restored micro-batches were not sampled here, so any record the sampler backend keeps goes
        keep_record(self.policy, None)
        self._buffer = [Experience.from_state(mb) for mb in state["buffer"]]
        self._next_micro, self._samples = state["next_micro"], state["samples"]
        self._start_time = None if state["elapsed"] is None else time.time() - state["elapsed"]
        for mode, values in state["metrics"].items():
            self._metrics[mode].clear()
            self._metrics[mode].update(values)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None):
        # transformers' private loader, overridden because it cannot read policy + critic (the policy is saved
        # as an ordinary causal-LM checkpoint, the critic next to it) and no public hook loads the weights
        unwrapped = self.accelerator.unwrap_model(model if model is not None else self.model)
        if isinstance(unwrapped, (CausalLMWithValueHead, PolicyWithCritic)):
            super()._load_from_checkpoint(resume_from_checkpoint, unwrapped.policy)
            unwrapped.load_critic(resume_from_checkpoint)
        else:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
