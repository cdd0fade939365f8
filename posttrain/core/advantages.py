"""Advantage estimators for the online engine, one registered function each.

  group_norm            GRPO (Shao et al. 2024, DeepSeekMath): reward minus the group mean,
                        divided by the group std; `scale_rewards="none"` is Dr. GRPO
                        (Liu et al. 2025), `"batch"` divides by the batch std instead.
  group_filtered_norm   GFPO (Shrivastava et al. 2025, "Sample More to Think Less: Group Filtered Policy
                        Optimization"): group_norm over the completions each group's filter kept
                        (AdvantageInput.kept), 0 on the others.
  leave_one_out         RLOO (Ahmadian et al. 2024; Kool et al. 2019): reward minus the mean
                        reward of the other completions of the same prompt.
  p_norm                MaxRL (Tajwar et al. 2026, "Maximum Likelihood Reinforcement Learning"): reward
                        minus the group mean, divided by the group mean's magnitude (p-normalisation: with
                        0/1 rewards a prompt of pass rate p weighs 1/p, the gradient of log p).
  opo                   OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline"):
                        reward minus the length-weighted mean reward of the group.
  gae                   PPO with a critic (Schulman et al. 2016, "High-Dimensional Continuous
                        Control Using Generalized Advantage Estimation").
  reinforce_pp          REINFORCE++ (Hu 2025): discounted return-to-go of per-token rewards,
                        whitened over the whole batch; no critic.
  reinforce_pp_baseline REINFORCE++-baseline: the group mean of the scores is subtracted
                        first, then as reinforce_pp.
  preference_pair       Online DPO / XPO (Guo et al. 2024; Xie et al. 2024): the two completions of a
                        prompt become a preference pair, +1 for the chosen (the higher score; the
                        first on a tie, as TRL ranks them), -1 for the rejected (in a larger group:
                        the best and the worst, 0 for the rest). A label, not a baseline-corrected
                        return: the pair losses read its sign.
  preference_or_tie     XPO's pairs (policy sample against reference sample): as preference_pair, but a
                        group whose scores all tie gets 0 everywhere, no preference; the pair losses
                        then take the loss expected under a fair coin's label (the paper labels a pair
                        by P(y ≻ ỹ), which is 1/2 for equal rewards).
  optimal_advantage     A*-PO (Brantley et al. 2025): the score as given is the advantage, r - V*(x),
                        the trainer having subtracted the prompt's optimal value (`optimal_value`).
  nash_md               Nash-MD (Munos et al. 2023): in each pair (policy sample, mixture sample),
                        P - 0.5 on the policy's completion, P = σ(r_policy - r_mixture) the
                        Bradley-Terry probability that it wins (in a larger group, the mean over the
                        others); 0 on the mixture's (not trained on).
  reverse_kl_return     MiniLLM (Gu et al. 2024, "MiniLLM: Knowledge Distillation of Large Language
                        Models"): the policy gradient of -KL(student || teacher) over sequences; the
                        per-token rewards are log q_teacher - log q_student of the sampled tokens.
  iw_opd                IW-OPD ("On the Position Bias of On-Policy Distillation", 2026): the sampled-token
                        distillation signal log q_teacher - log q_student of each token, weighted by how
                        little of the completion's total |signal| came before it (early tokens more).

Each takes an `AdvantageInput` plus keyword-only options (each read from the config field of
its name) and returns `(advantages, returns)`: advantages `(B, T)`, 0 on padding; returns
`(B, T)` for estimators with a critic, else None. Advantages are targets, so
`compute_advantages` runs without autograd. `register_advantage` records what the engine and
the config checks need to know (per-token rewards or one score, a critic, the smallest group);
the config's lists, checks and help text are read from `ADVANTAGES`, so a new estimator is its
function and its registration here, plus a test.

Departures: batch-level statistics ("batch" std, whitening) are over the tensors given; in a
multi-process run the caller gathers the batch first if it wants them global. Masks may have
holes (e.g. tool output inside a completion): the token-level recursions skip masked-out
positions, treating the next masked token as the next step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from posttrain.core.masked import masked_whiten
from posttrain.core.registry import Registry

GROUP_STD_EPS = 1e-4


@dataclass
class AdvantageInput:
    scores: Tensor  # (B,) sequence-level reward of each completion
    mask: Tensor  # (B, T) 1 on completion tokens
    group_size: int = 1  # completions per prompt
    # "prompt_major": rows [p0c0, p0c1, ..., p1c0, ...];
    # "completion_major": rows [p0c0, p1c0, ..., p0c1, ...]
    layout: str = "prompt_major"
    # (B, T) per-token rewards besides the score, e.g. -kl_coef * KL; estimators that work
    # per token add the score at the last masked token
    token_rewards: Tensor | None = None
    values: Tensor | None = None  # (B, T) critic values V(s_t)
    kept: Tensor | None = None  # (B,) bool: the completions a group filter kept (GFPO); None: all of them


AdvantageFn = Callable[..., tuple[Tensor, Tensor | None]]


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator and the facts the engine and the config checks read from it."""

    fn: AdvantageFn  # fn(inp, **options) -> (advantages (B, T), returns (B, T) or None)
    # reads per-token rewards (AdvantageInput.token_rewards; a per-token KL penalty stays per token);
    # otherwise the engine folds every per-token reward into the one score per sequence
    per_token: bool
    critic: bool  # reads AdvantageInput.values: the engine trains a value model beside the policy
    # the smallest group_size that gives a signal: 2 where the baseline is the other completions
    # of the prompt (a group of one would get advantage 0 and no gradient)
    min_group: int
    options: tuple[str, ...]  # fn's keyword-only parameters, each read from the config field of that name


ADVANTAGES = Registry("advantage estimator", AdvantageEstimator, positional=("inp",))
# The options of the estimators below: each is the config field of its name (OnlineConfig).
ADVANTAGES.option("normalize_advantage", False, "leave_one_out: whiten the advantages.")
ADVANTAGES.option("gamma", 1.0, "Discount (gae, reinforce_pp).")
ADVANTAGES.option("lam", 0.95, "GAE lambda.")
ADVANTAGES.option("whiten_advantages", True, "gae: whiten the advantages.")


def register_advantage(
    name: str, *, per_token: bool, critic: bool, min_group: int
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register `fn` as estimator `name` with its facts; every fact must be given (none has a default),
    so a new estimator cannot silently inherit a wrong one."""
    for fact, value in (("per_token", per_token), ("critic", critic)):
        if not isinstance(value, bool):
            raise TypeError(f"register_advantage({name!r}): {fact} must be True or False, got {value!r}")
    if isinstance(min_group, bool) or not isinstance(min_group, int) or min_group < 1:
        raise ValueError(f"register_advantage({name!r}): min_group must be an int >= 1 (completions per "
                         f"prompt the estimator needs), got {min_group!r}")

    return ADVANTAGES.register(name, per_token=per_token, critic=critic, min_group=min_group)


def compute_advantages(name: str, inp: AdvantageInput, **options) -> tuple[Tensor, Tensor | None]:
    """The one dispatch point: `ADVANTAGES[name].fn(inp, **options)` without autograd."""
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; choose from {sorted(ADVANTAGES)}")
    with torch.no_grad():
        return ADVANTAGES[name].fn(inp, **options)


# --- helpers -----------------------------------------------------------------------------


def group_view(x: Tensor, group_size: int, layout: str) -> Tensor:
    """View `(B, ...)` as `(num_prompts, group_size, ...)`; row p holds prompt p's completions."""
    if x.shape[0] % group_size:
        raise ValueError(f"batch of {x.shape[0]} is not a multiple of group_size={group_size}")
    rest = x.shape[1:]
    if layout == "prompt_major":
        return x.view(-1, group_size, *rest)
    if layout == "completion_major":
        return x.view(group_size, -1, *rest).transpose(0, 1)
    raise ValueError(f"unknown layout {layout!r}; use 'prompt_major' or 'completion_major'")


def _ungroup(g: Tensor, layout: str) -> Tensor:
    # inverse of group_view: (P, k, ...) -> (B, ...) in the batch's own row order
    if layout == "completion_major":
        g = g.transpose(0, 1)
    return g.reshape(-1, *g.shape[2:])


def _broadcast(seq_adv: Tensor, mask: Tensor) -> Tensor:
    # (B,) -> (B, T), 0 on padding
    return torch.where(mask.bool(), seq_adv.unsqueeze(-1), 0.0)


def per_token_rewards(scores: Tensor, mask: Tensor, token_rewards: Tensor | None = None) -> Tensor:
    """token_rewards (or zeros) with `scores` (B,) added at each row's last masked token; 0 off the mask. (B, T)
    Shared with core.shaping, which whitens these rewards for per-token estimators."""
    mask = mask.bool()
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    if token_rewards is not None:
        rewards = torch.where(mask, token_rewards.to(scores.dtype), rewards)
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, -1).max(dim=-1).values  # (B,), -1 for empty rows
    rows = (last >= 0).nonzero(as_tuple=True)[0]
    rewards[rows, last[rows]] += scores[rows]
    return rewards


def _discounted_return(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + γ G_{t+1}, over masked positions only. (B, T) -> (B, T), 0 on padding."""
    mask = mask.bool()
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(mask[:, t], running, 0.0)
    return returns


# --- estimators ----------------------------------------------------------------------------


@register_advantage("group_norm", per_token=False, critic=False, min_group=2)
def group_norm(inp: AdvantageInput, *, scale_rewards: str | bool = "group"):
    """A_i = (r_i - mean_group) / (std + 1e-4), std per group ("group"), over the batch
    ("batch"), or no division ("none", Dr. GRPO). Stds are the sample (n - 1) std; a group
    of one completion has no baseline to compare with and gets advantage 0."""
    if isinstance(scale_rewards, bool):  # configs often say True / False
        scale_rewards = "group" if scale_rewards else "none"
    k, scores = inp.group_size, inp.scores
    if k == 1:
        return torch.zeros(inp.mask.shape, dtype=scores.dtype, device=scores.device), None
    g = group_view(scores, k, inp.layout)  # (P, k)
    centred = g - g.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        centred = centred / (g.std(dim=1, keepdim=True) + GROUP_STD_EPS)
    elif scale_rewards == "batch":
        centred = centred / (scores.std() + GROUP_STD_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', not {scale_rewards!r}")
    return _broadcast(_ungroup(centred, inp.layout), inp.mask), None


@register_advantage("group_filtered_norm", per_token=False, critic=False, min_group=2)
def group_filtered_norm(inp: AdvantageInput, *, scale_rewards: str | bool = "group"):
    """group_norm computed over each group's kept completions only (`inp.kept`): their mean is the baseline and
    their sample std ("group"; "batch": the std of every kept score; "none": no division) the scale; the
    filtered-out completions get 0. Without `kept`, group_norm itself."""
    if inp.kept is None:
        return group_norm(inp, scale_rewards=scale_rewards)
    if isinstance(scale_rewards, bool):
        scale_rewards = "group" if scale_rewards else "none"
    k, scores = inp.group_size, inp.scores
    g = group_view(scores, k, inp.layout)  # (P, k)
    keep = group_view(inp.kept.to(scores.device), k, inp.layout).to(scores.dtype)
    n = keep.sum(dim=1, keepdim=True)
    centred = (g - (g * keep).sum(dim=1, keepdim=True) / n.clamp(min=1)) * keep
    if scale_rewards == "group":
        std = ((centred ** 2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        centred = centred / (std + GROUP_STD_EPS)
    elif scale_rewards == "batch":
        centred = centred / (scores[inp.kept.bool()].std() + GROUP_STD_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', not {scale_rewards!r}")
    return _broadcast(_ungroup(centred, inp.layout), inp.mask), None


@register_advantage("leave_one_out", per_token=False, critic=False, min_group=2)
def leave_one_out(inp: AdvantageInput, *, normalize_advantage: bool = False):
    """A_i = r_i - (sum_j r_j - r_i) / (k - 1): the other completions are the baseline.
    With `normalize_advantage`, the (B,) advantages are whitened over the batch, each
    sequence counting once."""
    k = inp.group_size
    if k < 2:
        raise ValueError(
            "leave_one_out needs group_size >= 2: with one completion per prompt there is no "
            "other completion to serve as the baseline; raise num_generations or use group_norm"
        )
    g = group_view(inp.scores, k, inp.layout)  # (P, k)
    baseline = (g.sum(dim=1, keepdim=True) - g) / (k - 1)
    adv = _ungroup(g - baseline, inp.layout)  # (B,)
    if normalize_advantage:
        adv = masked_whiten(adv, torch.ones_like(adv, dtype=torch.bool))
    return _broadcast(adv, inp.mask), None


P_NORM_EPS = 1e-6  # TRL's MaxRLTrainer: advantage = (r - mean) / (|mean| + 1e-6)


@register_advantage("p_norm", per_token=False, critic=False, min_group=2)
def p_norm(inp: AdvantageInput):
    """A_i = (r_i - mean_group) / (|mean_group| + 1e-6), MaxRL's p-normalisation. With 0/1 rewards and pass rate
    p > 0 a correct completion gets (1 - p) / p, a wrong one -1: the group's policy gradient is that of log p, so
    hard prompts weigh more than under GRPO's std. A group whose scores are all 0 gets 0 (no signal), as in TRL;
    a group of one completion has itself as baseline and gets 0 too."""
    g = group_view(inp.scores, inp.group_size, inp.layout)  # (P, k)
    mean = g.mean(dim=1, keepdim=True)
    return _broadcast(_ungroup((g - mean) / (mean.abs() + P_NORM_EPS), inp.layout), inp.mask), None


@register_advantage("opo", per_token=False, critic=False, min_group=2)
def opo(inp: AdvantageInput):
    """A_i = r_i - sum_j l_j r_j / sum_j l_j over the prompt's group, l_j = completion j's number of
    masked (trained) tokens: the variance-minimising baseline when a sequence's gradient norm grows
    with its length. Departure: verl gives a group of one the baseline 0; here the formula's own
    value (r_i itself) applies, so the advantage is 0 as for the other group estimators."""
    g = group_view(inp.scores, inp.group_size, inp.layout)  # (P, k)
    lengths = group_view(inp.mask.sum(-1).to(g.dtype), inp.group_size, inp.layout)  # (P, k)
    # a group whose every row is empty trains no token: any finite baseline will do
    baseline = (lengths * g).sum(1, keepdim=True) / lengths.sum(1, keepdim=True).clamp(min=1)
    return _broadcast(_ungroup(g - baseline, inp.layout), inp.mask), None


@register_advantage("gae", per_token=True, critic=True, min_group=1)
def gae(
    inp: AdvantageInput, *, gamma: float = 1.0, lam: float = 0.95, whiten_advantages: bool = True
):
    """δ_t = r_t + γ V(s_{t+1}) - V(s_t);  A_t = δ_t + γλ A_{t+1};  returns = A + V.

    V after the last token is 0 (the episode ends). Returns are taken before whitening,
    as they are the critic's regression target."""
    if inp.values is None:
        raise ValueError("gae needs critic values: set AdvantageInput.values")
    mask = inp.mask.bool()
    values = torch.where(mask, inp.values, 0.0)  # (B, T)
    rewards = per_token_rewards(inp.scores.to(values.dtype), inp.mask, inp.token_rewards)  # (B, T)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])  # (B,) V(s_{t+1})
    next_adv = torch.zeros_like(values[:, 0])  # (B,) A_{t+1}
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        # a masked-out position is skipped: carry the next step's value and advantage over it
        next_adv = torch.where(mask[:, t], adv_t, next_adv)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(mask[:, t], adv_t, 0.0)
    returns = advantages + values
    if whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


@register_advantage("reinforce_pp", per_token=True, critic=False, min_group=1)
def reinforce_pp(inp: AdvantageInput, *, gamma: float = 1.0):
    """G_t = sum_{s>=t} γ^(s-t) r_s, then whitened over every masked token of the batch."""
    returns = _discounted_return(per_token_rewards(inp.scores, inp.mask, inp.token_rewards), inp.mask, gamma)
    return masked_whiten(returns, inp.mask), None


@register_advantage("reinforce_pp_baseline", per_token=True, critic=False, min_group=2)
def reinforce_pp_baseline(inp: AdvantageInput, *, gamma: float = 1.0):
    """REINFORCE++-baseline: scores minus their group mean, then as reinforce_pp."""
    g = group_view(inp.scores, inp.group_size, inp.layout)  # (P, k)
    scores = _ungroup(g - g.mean(dim=1, keepdim=True), inp.layout)  # (B,)
    returns = _discounted_return(per_token_rewards(scores, inp.mask, inp.token_rewards), inp.mask, gamma)
    return masked_whiten(returns, inp.mask), None


@register_advantage("preference_pair", per_token=False, critic=False, min_group=2)
def preference_pair(inp: AdvantageInput):
    """+1 on every token of each group's chosen completion, -1 on its rejected one's, 0 on the others: the chosen
    has the highest score (the first of equals), the rejected the lowest (the last of equals), so a pair
    (group_size 2, Online DPO's) ranks its first completion above the second when their scores tie."""
    k = inp.group_size
    if k < 2:
        raise ValueError(f"preference_pair ranks the completions of a prompt: it needs group_size >= 2, got {k}")
    g = group_view(inp.scores, k, inp.layout)  # (P, k)
    signs = torch.zeros_like(g)
    rows = torch.arange(g.shape[0], device=g.device)
    signs[rows, g.argmax(dim=1)] = 1.0  # argmax: the first of equal maxima
    signs[rows, k - 1 - g.flip(1).argmin(dim=1)] = -1.0  # the last of equal minima (a tie: the other row)
    return _broadcast(_ungroup(signs, inp.layout), inp.mask), None


@register_advantage("preference_or_tie", per_token=False, critic=False, min_group=2)
def preference_or_tie(inp: AdvantageInput):
    """preference_pair's labels, except in a group whose scores are all equal: 0 on every completion (a tie
    states no preference; ranking the first above the second would be an arbitrary label)."""
    advantages, _ = preference_pair(inp)
    g = group_view(inp.scores, inp.group_size, inp.layout)  # (P, k)
    tied = _ungroup((g == g[:, :1]).all(dim=1, keepdim=True).expand_as(g), inp.layout)  # (B,)
    return torch.where(tied.unsqueeze(-1), 0.0, advantages), None


@register_advantage("nash_md", per_token=False, critic=False, min_group=2)
def nash_md(inp: AdvantageInput):
    """P - 0.5 on the tokens of each group's first completion (the policy's), P = mean_j σ(s_0 - s_j) over the
    others (the geometric mixture's; for a pair, σ(s_0 - s_1)); 0 on the others, which are not trained on."""
    k = inp.group_size
    if k < 2:
        raise ValueError(f"nash_md compares the policy's completion with the mixture's: it needs group_size >= 2, "
                         f"got {k}")
    g = group_view(inp.scores, k, inp.layout)  # (P, k)
    first = torch.sigmoid(g[:, :1] - g[:, 1:]).mean(dim=1) - 0.5
    advantages = torch.zeros_like(g)
    advantages[:, 0] = first
    return _broadcast(_ungroup(advantages, inp.layout), inp.mask), None


@register_advantage("optimal_advantage", per_token=False, critic=False, min_group=1)
def optimal_advantage(inp: AdvantageInput):
    """The score itself on every token: A*-PO's scores arrive as r - V*(x) (`optimal_value`)."""
    return _broadcast(inp.scores, inp.mask), None


def optimal_value(rewards: Tensor, beta1: float) -> Tensor:
    """A*-PO's estimate of the optimal value of each prompt from its reference samples' rewards (P, n):
    V*(x) = β1 log mean_i exp(r_i / β1) (P,), computed stably (a soft maximum: β1 -> 0 gives max_i r_i)."""
    n = rewards.shape[1]
    return beta1 * (torch.logsumexp(rewards / beta1, dim=1) - math.log(n))
ADVANTAGES.option("rkl_advantage", True, "reverse_kl_return (MiniLLM): add the reverse-KL return to the reward "
                  "advantage.")
ADVANTAGES.option("single_step_decomposition", True, "reverse_kl_return (MiniLLM): each step's own reverse KL "
                  "exactly, over the vocabulary, in the loss; the return covers the later steps.")
ADVANTAGES.option("length_normalization", True, "reverse_kl_return (MiniLLM): divide each return by the number of "
                  "steps it sums.")


@register_advantage("reverse_kl_return", per_token=True, critic=False, min_group=1)
def reverse_kl_return(inp: AdvantageInput, *, gamma: float = 1.0, length_normalization: bool = True,
                      single_step_decomposition: bool = True, rkl_advantage: bool = True):
    """MiniLLM's advantage: the scores minus their group mean (as GRPO without the std; 0 for a group of one),
    plus, with `rkl_advantage`, the return R_t = sum_{s>=t} γ^(s-t) r_s of the per-token rewards r_s
    (`token_rewards`: log q_T(y_s) - log q_S(y_s), the negated single-sample reverse KL). With
    `single_step_decomposition` the current step is left out (R_{t+1}: the loss adds that step's exact
    reverse KL over the vocabulary instead); with `length_normalization` each return is divided by the
    number of steps it sums (MiniLLM's R^Norm), so long completions do not get larger advantages. (MiniLLMConfig's
    gamma defaults to TRL's 0.0: with the single-step decomposition the return is then 0.)"""
    g = group_view(inp.scores, inp.group_size, inp.layout)  # (P, k)
    scores = _ungroup(g - g.mean(dim=1, keepdim=True), inp.layout)  # (B,)
    mask = inp.mask.bool()
    advantages = torch.where(mask, scores[:, None], 0.0)
    if not rkl_advantage or inp.token_rewards is None:
        return advantages, None
    rewards = torch.where(mask, inp.token_rewards.to(scores.dtype), 0.0)
    if single_step_decomposition:  # r'_t = γ r_{t+1}: the next masked token's reward, discounted once
        later = _discounted_return(rewards, mask, gamma) - rewards  # γ G_{t+1}
        returns = torch.where(mask, later, 0.0)
    else:
        returns = _discounted_return(rewards, mask, gamma)
    if length_normalization:
        steps = mask.flip(1).cumsum(1).flip(1).to(scores.dtype)  # masked tokens from t to the end
        returns = returns / (steps - float(single_step_decomposition)).clamp(min=1)
    return advantages + torch.where(mask, returns, 0.0), None


ADVANTAGES.option("iw_opd_gamma", 0.5, "iw_opd: how much more an early token weighs than a late one (weights run "
                  "from 1 + gamma down to 1).", bound=(0.0, None))
ADVANTAGES.option("iw_opd_epsilon", 1e-8, "iw_opd: the smallest total |signal| a completion's weights divide by.",
                  bound=(0.0, None))


def iw_opd_weights(signal: Tensor, mask: Tensor, gamma: float, epsilon: float) -> Tensor:
    """IW-OPD's weight of each token (B, T): 1 + γ (1 - Σ_{s<t} |a_s| / max(Σ_s |a_s|, ε)), a = `signal` on the mask."""
    size = torch.where(mask.bool(), signal, 0.0).abs()
    before = size.cumsum(1) - size  # Σ_{s<t} |a_s|
    return 1.0 + gamma * (1.0 - before / size.sum(1, keepdim=True).clamp(min=epsilon))


@register_advantage("iw_opd", per_token=True, critic=False, min_group=1)
def iw_opd(inp: AdvantageInput, *, iw_opd_gamma: float = 0.5, iw_opd_epsilon: float = 1e-8):
    """IW-OPD's advantage of each sampled token: a_t = `token_rewards` (log q_T(y_t) - log q_S(y_t)) times its
    weight (`iw_opd_weights`): a token after much teacher-student disagreement (a prefix the teacher's supervision
    has drifted on) weighs less, the first token 1 + γ. The scores are not used (no token rewards: no signal)."""
    mask = inp.mask.bool()
    if inp.token_rewards is None:
        return torch.zeros(mask.shape, dtype=inp.scores.dtype, device=mask.device), None
    signal = torch.where(mask, inp.token_rewards, 0.0)
    return torch.where(mask, iw_opd_weights(signal, mask, iw_opd_gamma, iw_opd_epsilon) * signal, 0.0), None
