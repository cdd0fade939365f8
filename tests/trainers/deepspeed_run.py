"""Two optimizer steps of SFT, DPO (dpo_sync: its reference synced after each step), GRPO (beta > 0;
grpo_rm: with a reward model too), distillation (a teacher loaded by name, prepared as a reference) or PPO
(ppo: a value head on the policy; ppo_critic: a separate value model and a reward model, both loaded by name),
run by tests/trainers/test_deepspeed.py under `accelerate launch` with a DeepSpeed ZeRO config (2 CPU processes)
and as a plain single process with the same global batch; writes each step's loss and gradient norm, whether the
policy and the reference model were ZeRO-3 partitioned, and for PPO how far each weight of the policy and the
critic moved (its sum and norm).

DPO's first loss is log 2 only if the reference scores exactly as the policy does (both start from the same
weights), and GRPO's first KL is 0 only then: a reference that is not prepared for ZeRO-3 fails or differs.
"""

import gc
import importlib
import json
import os
import sys

import torch

from posttrain.cli import close_process_group, end_process
from posttrain.models.loading import zero3_partitioned
from posttrain.tasks.builtin import task_dataset, task_preference_dataset


def _skip_shm_build():
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce op on first use (minutes, once per machine);
    it only speeds up all-reduces, which then go through torch.distributed (gloo), so the test does without it."""
    try:  # by import_module: `import deepspeed.comm.torch as m` binds torch itself, which deepspeed.comm imports
        ds_torch = importlib.import_module("deepspeed.comm.torch")
    except ImportError:
        return
    ds_torch.build_shm_op = lambda: None


def main(out_path: str, algorithm: str, processes: int):
    _skip_shm_build()
    # the same global batch (4 rows, GRPO 2 prompts x 4 completions) however many processes share it
    common = dict(output_dir=out_path + ".run", per_device_train_batch_size=4 // processes, max_steps=2,
                  logging_steps=1, optim="sgd", learning_rate=0.5, report_to="none", disable_tqdm=True,
                  use_cpu=True, save_strategy="no", seed=0)
    if algorithm == "sft":
        from posttrain.trainers.sft import SFTConfig, SFTTrainer

        trainer = SFTTrainer("posttrain/tiny-qwen2", args=SFTConfig(**common),
                             train_dataset=task_dataset("reverse", size=16))
    elif algorithm in ("dpo", "dpo_sync"):
        from posttrain.trainers.dpo import DPOConfig, DPOTrainer

        sync = dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5) if algorithm == "dpo_sync" \
            else {}
        trainer = DPOTrainer("posttrain/tiny-qwen2", args=DPOConfig(**common, **sync),
                             train_dataset=task_preference_dataset("reverse", size=16))
    elif algorithm == "distillation":  # the dataset's completions (lmbda=0), the teacher loaded by name
        from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer

        trainer = DistillationTrainer("posttrain/tiny-qwen2", teacher_model="posttrain/tiny-llama",
                                      args=DistillationConfig(**common, lmbda=0.0, beta=0.5, loss_top_k=0,
                                                              max_completion_length=6, shuffle_dataset=False),
                                      train_dataset=task_dataset("reverse", size=16))
    elif algorithm in ("ppo", "ppo_critic"):
        from distributed_grpo import PerPromptSeededGRPO, first_token_reward
        from posttrain.trainers.ppo import PPOConfig, PPOTrainer

        class PerPromptSeededPPO(PPOTrainer):  # sampling independent of how the prompts are split
            sample_completions = PerPromptSeededGRPO.sample_completions

        # one completion per prompt, 4 prompts, one PPO epoch of one mini-batch: one optimizer step per batch
        args = PPOConfig(**common, max_completion_length=6, kl_coef=0.1, num_ppo_epochs=1, num_mini_batches=1,
                         shuffle_dataset=False)
        critic = dict(value_model="posttrain/tiny-qwen2-seqcls", reward_model="posttrain/tiny-qwen2-seqcls",
                      reward_funcs=[first_token_reward]) if algorithm == "ppo_critic" \
            else dict(reward_funcs=[first_token_reward])
        trainer = PerPromptSeededPPO(args=args, model="posttrain/tiny-qwen2", **critic,
                                     train_dataset=task_dataset("reverse", size=16).remove_columns("completion"))
    else:
        # sampling independent of how the prompts are split over processes
        from distributed_grpo import PerPromptSeededGRPO, first_token_reward
        from posttrain.trainers.grpo import GRPOConfig

        args = GRPOConfig(**{**common, "per_device_train_batch_size": 8 // processes}, num_generations=4,
                          max_completion_length=6, beta=0.1, shuffle_dataset=False, replay_linear_outputs=False)
        rewards = [first_token_reward] + (["posttrain/tiny-qwen2-seqcls"] if algorithm == "grpo_rm" else [])
        trainer = PerPromptSeededGRPO("posttrain/tiny-qwen2", rewards, args=args,
                              train_dataset=task_dataset("reverse", size=16).remove_columns("completion"))
    before = _weights(trainer.accelerator.unwrap_model(trainer.model)) if algorithm.startswith("ppo") else {}
    trainer.train()
    steps = [log for log in trainer.state.log_history if "loss" in log]
    ref = getattr(trainer, "ref_model", None) or getattr(trainer, "teacher_model", None)  # a teacher: as a reference
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    critic = getattr(unwrapped, "v_head", None) or getattr(unwrapped, "value_model", None)
    scorer = getattr(trainer, "reward_scorer", None)
    reward_models = [m for m in (scorer.funcs if scorer else ()) if isinstance(m, torch.nn.Module)]
    after = _weights(trainer.accelerator.unwrap_model(trainer.model)) if algorithm.startswith("ppo") else {}
    # each weight's move over training: its sum and its norm (float64)
    moves = {name: [(after[name] - w).sum().item(), (after[name] - w).norm().item()] for name, w in before.items()}
    if not trainer.accelerator.is_main_process:
        return
    with open(out_path, "w") as f:
        json.dump({"loss": [log["loss"] for log in steps], "grad_norm": [log["grad_norm"] for log in steps],
                   "kl": [log.get("objective/kl") for log in steps], "reward": [log.get("reward") for log in steps],
                   "engine": trainer.accelerator.distributed_type.value, "processes": trainer.accelerator.num_processes,
                   "policy_partitioned": zero3_partitioned(trainer.model),
                   "ref_partitioned": ref is not None and zero3_partitioned(ref),
                   "reward_models_partitioned": [zero3_partitioned(m) for m in reward_models],
                   "critic_partitioned": critic is not None and zero3_partitioned(critic),
                   "moves": moves}, f)


def _weights(model) -> dict:
    """A float64 copy of each parameter by name, gathered first where ZeRO-3 partitioned it (every process
    joins the gather)."""
    params = dict(model.named_parameters())
    if not zero3_partitioned(model):
        return {name: p.detach().double().clone() for name, p in params.items()}
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().double().clone() for name, p in params.items()}


if __name__ == "__main__":
    try:
        # out folder, a comma-separated list of sft | dpo | dpo_sync | grpo | grpo_rm | distillation | ppo |
        # ppo_critic, processes. The trainers run one after the other in the same processes (one launch: the
        # start-up of a launch is most of its time), each writing <out folder>/<algorithm>.json; every trainer
        # seeds itself, so the order does not change a result.
        for name in sys.argv[2].split(","):
            main(os.path.join(sys.argv[1], name + ".json"), name, int(sys.argv[3]))
            gc.collect()
    finally:  # see cli.close_process_group
        close_process_group()
    end_process(0)  # see cli.end_process
