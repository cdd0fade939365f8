"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath").

Sample a group of `num_generations` completions per prompt, score them, and use each
completion's reward relative to its group, A_i = (r_i - mean(r)) / std(r), as the advantage of
every one of its tokens in a clipped (PPO-style) surrogate; no critic. A KL penalty to a
reference policy, beta * k3, is added to the loss per token (beta = 0 by default: no
reference model is loaded at all).

A preset of the online engine (`posttrain.trainers.online`): advantage_estimator="group_norm",
policy_loss="clipped", KL in the loss. Variants are config values, not other trainers:
  loss_type   "grpo" (per-sequence token mean, the paper), "bnpo", "dr_grpo" (Liu et al. 2025:
              token sum / max_completion_length, with scale_rewards="none"), "dapo" (Yu et al.
              2025: token mean over the whole step; the default, as in recent TRL);
  epsilon_high              DAPO's asymmetric clip ("clip-higher");
  filter_groups_enable, max_num_gen_batches   DAPO's dynamic sampling (verl's names; core.dynamic_sampling);
  overlong_buffer_len, overlong_penalty_factor DAPO's overlong reward shaping (verl's names; core.shaping);
  vllm_importance_sampling_mode  TRL's four importance-sampling corrections (core.importance);
  importance_sampling_level "sequence" for GSPO (Zheng et al. 2025);
  mask_truncated_completions, scale_rewards ("group" | "batch" | "none");
  loss_type   "cispo" / "sapo" / "luspo" / "vespo" also pick their policy loss (core.policy_losses);
  delta (INTELLECT-2), entropy_coef, top_entropy_quantile, use_bias_correction_kl,
  off_policy_mask_threshold, multi_objective_aggregation="normalize_then_sum" (GDPO), as TRL 1.16.

Departures: the old-policy log-probs are the sampler's own (no extra forward pass), and when the
policy cannot have moved since sampling, old = current (detached), so the ratio is exactly 1.
`per_device_train_batch_size` counts completions, as in TRL; each process generates whole
groups, so `per_device_train_batch_size * steps_per_generation` must be a multiple of
`num_generations` (TRL only needs the global generation batch to be).
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.trainers.online import OnlineConfig, OnlineTrainer


@dataclass
class GRPOConfig(OnlineConfig):
    """GRPO's configuration: the online engine's fields with GRPO defaults (group_norm, KL in the loss)."""

    def _check(self):
        super()._check()
        if self.kl_in_reward:
            raise ValueError("GRPO puts the KL term in the loss; for a KL penalty in the reward use RLOOConfig, "
                             "PPOConfig or ReinforcePPConfig (or OnlineConfig)")


class GRPOTrainer(OnlineTrainer):
    """GRPO on the online engine. Signature as TRL's:
    `GRPOTrainer(model, reward_funcs, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
    reward_processing_classes=None, callbacks=None, optimizers=(None, None), peft_config=None)`."""

    config_class = GRPOConfig
    _tag = "GRPO"
    _name = "GRPO"
    _citation = """@article{shao2024deepseekmath,
    title   = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},
    author  = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and Xiao Bi and Haowei Zhang
               and Mingchuan Zhang and Y. K. Li and Y. Wu and Daya Guo},
    journal = {arXiv preprint},
    year    = 2024,
    eprint  = {arXiv:2402.03300}
}"""

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), peft_config=None, ref_model=None, tools=None, environment_factory=None,
                 rollout_func=None, **kwargs):
        # kwargs: TRL's older conventions (tokenizer=, config fields), see OnlineTrainer
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, reward_processing_classes=reward_processing_classes,
                         callbacks=callbacks, optimizers=optimizers, peft_config=peft_config, ref_model=ref_model,
                         tools=tools, environment_factory=environment_factory, rollout_func=rollout_func, **kwargs)
