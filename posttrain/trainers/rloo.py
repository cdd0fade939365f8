"""RLOO: REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE
Style Optimization for Learning from Human Feedback in LLMs"; the baseline is Kool et al. 2019).

Sample k completions per prompt; the baseline of each is the mean reward of the other k - 1,
A_i = r_i - mean_{j != i} r_j, and the whole completion is one action of a REINFORCE update
(clipped when the batch is reused, as PPO). The KL penalty to the reference policy goes into
the reward: r = score - kl_coef * sum_t KL_t.

A preset of the online engine: advantage_estimator="leave_one_out", KL in the reward,
loss_type="seq_mean_token_sum" (each sequence contributes the sum over its tokens, i.e. the
gradient of its sequence log-prob). The classic field names work (rloo_k, kl_coef,
response_length, num_ppo_epochs, num_mini_batches, cliprange, stop_token, ...) and so do the
GRPO-style ones (num_generations, beta, max_completion_length, num_iterations, epsilon); set
one of each pair.

Departures from the classic trainer: `per_device_train_batch_size` counts completions (as in
GRPO), not prompts; rows are prompt-major and each prompt's group stays on one process; the
importance ratio is per token (the classic trainer used one ratio per sequence, which only
differs once the batch is reused, num_ppo_epochs > 1); completions always stop at EOS;
`token_level_kl` gives the same advantages as the summed KL here, since the leave-one-out
advantage is one number per sequence (it matters for per-token estimators).

As in the classic trainer, `reward_clip_range` clips the scores only when `normalize_reward`
normalises them (clipping raw scores would make every score beyond the range equal, and their
advantages 0); it is a bound c ([-c, c]) or a (min, max) pair. A callable `reward_model` in the
classic form is called as the classic trainer called it: with the decoded query + response texts.
`val/clipfrac_avg` is logged as 0 (there is no critic), and the completions table has the classic
headings: query | model response | score (one "score (<reward>)" column per reward when several).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from posttrain.core.shaping import RewardShaping
from posttrain.trainers.classic_forms import rloo_arguments
from posttrain.trainers.online import OnlineTrainer
from posttrain.trainers.online_config import ClassicOnlineConfig, estimator_help

# (classic name, GRPO-style name)
RLOO_ALIASES = [("rloo_k", "num_generations"), ("kl_coef", "beta"), ("response_length", "max_completion_length"),
                ("num_ppo_epochs", "num_iterations"), ("cliprange", "epsilon")]


@dataclass
class RLOOConfig(ClassicOnlineConfig):
    """RLOO's configuration: classic RLOO fields and defaults, GRPO-style aliases."""

    _aliases = RLOO_ALIASES
    rloo_k: int = field(default=2, metadata={"help": "Completions per prompt (alias: num_generations)."})
    num_generations: int = field(default=2, metadata={"help": "Alias of rloo_k."})
    reward_clip_range: float | None = field(default=10.0, metadata={"help": "With normalize_reward, clip the "
                                            "normalised scores to [-c, c] (in Python also a (min, max) pair); "
                                            "without it, scores are not clipped (as in the classic trainer)."})
    advantage_estimator: str = field(default="leave_one_out", metadata={"help": estimator_help()})
    loss_type: str = field(default="seq_mean_token_sum", metadata={"help": "Loss aggregation (see OnlineConfig)."})

    def _check(self):
        clip = self.reward_clip_range
        if isinstance(clip, (list, tuple)):
            if len(clip) != 2 or not all(isinstance(v, (int, float)) for v in clip) or clip[0] > clip[1]:
                raise ValueError(f"reward_clip_range={clip!r}: give one bound c >= 0 (clips to [-c, c]) or a "
                                 "(min, max) pair of numbers with min <= max")
            self.reward_clip_range = (float(clip[0]), float(clip[1]))
        elif clip is not None and clip < 0:
            raise ValueError(f"reward_clip_range={clip} must be >= 0 (scores are clipped to [-c, c])")
        super()._check()


class RLOOTrainer(OnlineTrainer):
    """RLOO on the online engine. Two call forms:

    * GRPO style: `RLOOTrainer(model, reward_funcs, args=None, train_dataset=None, eval_dataset=None,
      processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
      peft_config=None)`;
    * classic: `RLOOTrainer(config, processing_class, policy, ref_policy, reward_model, train_dataset,
      data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None)`, positional or by
      keyword; the reward model may be a sequence-classification model or a callable.

    Both forms take TRL's older conventions: `tokenizer=` for processing_class, and RLOOConfig fields given to
    the trainer (set on a copy of the config with a FutureWarning naming them; see `classic_arguments`). The
    classic form is resolved in `classic_forms.py`.
    """

    config_class = RLOOConfig
    _tag = "RLOO"
    _name = "RLOO"
    _citation = """@inproceedings{ahmadian2024back,
    title     = {{Back to Basics: Revisiting REINFORCE-Style Optimization for Learning from Human Feedback in LLMs}},
    author    = {Arash Ahmadian and Chris Cremer and Matthias Gall{\\'e} and Marzieh Fadaee and Julia Kreutzer
                 and Olivier Pietquin and Ahmet {\\"U}st{\\"u}n and Sara Hooker},
    booktitle = {Proceedings of the 62nd Annual Meeting of the Association for Computational Linguistics (ACL 2024)},
    year      = 2024,
    eprint    = {arXiv:2402.14740}
}"""

    def __init__(self, *args, **kwargs):
        super().__init__(**rloo_arguments(self, args, kwargs))  # either form (classic_forms.py)
        self.completions_table.headings, self.completions_table.score_heading = ("query", "model response"), "score"

    def reward_shaping(self) -> RewardShaping:
        # the classic trainer clipped the normalised scores only: raw scores beyond the range would all become equal
        shaping = super().reward_shaping()
        return shaping if self.args.normalize_reward else replace(shaping, clip_range=None)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.record({"val/clipfrac_avg": 0.0}, "train")  # the classic RLOO logged it; no critic, nothing clipped
        return result
