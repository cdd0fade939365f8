"""The core pieces of Online DPO, XPO, Nash-MD, GMPO and GSPO-token, against hand numbers and float64 references."""

import math

import pytest
import torch

from posttrain.core.advantages import AdvantageInput, compute_advantages
from posttrain.core.policy_losses import POLICY_LOSSES
from posttrain.core.preference_losses import PreferenceInput, nash_md_loss, tied_pair_loss, xpo_exploration
from posttrain.rollout.backends import GeometricMixture, SamplerBackend


def test_preference_pair_marks_the_chosen_and_breaks_ties_for_the_first():
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0, -1.0])  # pairs: second wins, tie, first wins
    mask = torch.tensor([[1, 1, 0]] * 6)
    adv, returns = compute_advantages("preference_pair", AdvantageInput(scores, mask, group_size=2))
    assert returns is None
    assert adv[:, 0].tolist() == [-1.0, 1.0, 1.0, -1.0, 1.0, -1.0]
    assert (adv[:, 2] == 0).all()  # padding


def test_preference_pair_in_larger_groups_marks_the_best_and_the_worst():
    scores = torch.tensor([1.0, 3.0, 3.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv, _ = compute_advantages("preference_pair", AdvantageInput(scores, torch.ones(8, 1), group_size=4))
    assert adv[:, 0].tolist() == [0.0, 1.0, 0.0, -1.0, 1.0, 0.0, 0.0, -1.0]  # ties: first best, last worst


def test_preference_or_tie_labels_no_completion_of_a_tied_pair():
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0, -1.0])  # pairs: second wins, tie, first wins
    mask = torch.tensor([[1, 1, 0]] * 6)
    adv, returns = compute_advantages("preference_or_tie", AdvantageInput(scores, mask, group_size=2))
    assert returns is None
    assert adv[:, 0].tolist() == [-1.0, 1.0, 0.0, 0.0, 1.0, -1.0]
    assert (adv[:, 2] == 0).all()  # padding
    big = torch.tensor([1.0, 3.0, 3.0, 0.0, 2.0, 2.0, 2.0, 2.0])  # a larger group ties only when all its scores do
    adv, _ = compute_advantages("preference_or_tie", AdvantageInput(big, torch.ones(8, 1), group_size=4))
    assert adv[:, 0].tolist() == [0.0, 1.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0]


def test_tied_pair_loss_is_the_fair_coin_expectation_float64():
    f64 = dict(dtype=torch.float64)
    inp = PreferenceInput(torch.tensor([-2.0, -5.0], **f64), torch.tensor([-4.0, -1.0], **f64),
                          torch.tensor([-3.0, -2.0], **f64), torch.tensor([-3.5, -2.5], **f64))
    h = [(-2.0 + 3.0) - (-4.0 + 3.5), (-5.0 + 2.0) - (-1.0 + 2.5)]  # 1.5, -4.5
    beta = 0.5
    log_sigmoid = lambda z: -math.log1p(math.exp(-z))  # noqa: E731
    expected = [0.5 * (-log_sigmoid(beta * x) - log_sigmoid(-beta * x)) for x in h]
    torch.testing.assert_close(tied_pair_loss(inp, "sigmoid", beta), torch.tensor(expected, **f64))
    # ipo: ((h - 1/(2 beta))^2 + (-h - 1/(2 beta))^2) / 2 = h^2 + 1/(4 beta^2), the same whichever row is "chosen"
    torch.testing.assert_close(tied_pair_loss(inp, "ipo", beta), torch.tensor([x * x + 1.0 for x in h], **f64))
    swapped = PreferenceInput(inp.rejected_logps, inp.chosen_logps, inp.ref_rejected_logps, inp.ref_chosen_logps)
    torch.testing.assert_close(tied_pair_loss(swapped, "sigmoid", beta), tied_pair_loss(inp, "sigmoid", beta))


def test_nash_md_estimator_is_win_probability_minus_half_on_the_policy_row():
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0], dtype=torch.float64)
    mask = torch.ones(4, 2)
    adv, _ = compute_advantages("nash_md", AdvantageInput(scores, mask, group_size=2))
    expected = [1 / (1 + math.exp(-1)) - 0.5, 0.0, 1 / (1 + math.exp(2)) - 0.5, 0.0]
    torch.testing.assert_close(adv[:, 0], torch.tensor(expected, dtype=torch.float64))


def test_nash_md_loss_value_and_gradient_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -7.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    p, beta = torch.tensor([0.8], dtype=torch.float64), 0.1
    loss = nash_md_loss(logp, ref, mask, p, beta)
    # -(0.8 - 0.5) * (-3) + 0.1 * (0.5 * -1 + (-1) * -2) = 0.9 + 0.15
    torch.testing.assert_close(loss, torch.tensor([1.05], dtype=torch.float64))
    loss.sum().backward()
    # d/dlogp_t = -(P - 0.5) + beta * sg(logp_t - ref_t); 0 on padding
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.3 + 0.05, -0.3 - 0.1, 0.0]], dtype=torch.float64))


def test_xpo_exploration_is_alpha_times_the_reference_sample_logp():
    torch.testing.assert_close(xpo_exploration(torch.tensor([-4.0, -2.0]), 0.5), torch.tensor([-2.0, -1.0]))


def test_gmpo_is_the_clipped_geometric_mean_of_the_ratios_float64():
    logp = torch.tensor([[0.3, -0.1, 0.0], [0.5, -0.6, 9.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([[2.0] * 3, [-1.0] * 3], dtype=torch.float64) * mask
    per_token, stats = POLICY_LOSSES["gmpo"].fn(logp, old, adv, mask, epsilon=0.4, epsilon_high=0.2)
    # row 0, A > 0: log-ratios capped above at 0.2 -> mean(0.2, -0.1, 0) ; row 1, A < 0: floored at -0.4
    g0 = math.exp((0.2 - 0.1 + 0.0) / 3)
    g1 = math.exp((0.5 - 0.4) / 2)
    torch.testing.assert_close(per_token[0], torch.full((3,), -2.0 * g0, dtype=torch.float64))
    torch.testing.assert_close(per_token[1, :2], torch.full((2,), 1.0 * g1, dtype=torch.float64))
    assert per_token[1, 2] == 0
    assert stats["clipped"].tolist() == [[True, False, False], [False, True, False]]
    # gradient of the sequence loss -A g (the mean of its tokens): only unclipped tokens, each -A g / |o|
    per_token[0].mean().backward()
    torch.testing.assert_close(logp.grad[0], torch.tensor([0.0, -2.0 * g0 / 3, -2.0 * g0 / 3], dtype=torch.float64))


def test_sequence_token_level_is_gspo_token():
    logp = torch.tensor([[0.2, -0.4]], requires_grad=True)
    old, mask, adv = torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)
    a, _ = POLICY_LOSSES["clipped"].fn(logp, old, adv, mask, importance_sampling_level="sequence_token")
    b, _ = POLICY_LOSSES["clipped"].fn(logp, old, adv, mask, importance_sampling_level="sequence")
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, -torch.full((1, 2), math.exp(-0.1)))  # exp(mean log-ratio) at every token


class _Fixed(SamplerBackend):
    """A backend that returns the same logits each call and records what it was asked."""

    def __init__(self, logits):
        self.logits, self.calls = logits, []

    def prefill(self, prompt_ids, prompt_mask, positions):
        self.calls.append("prefill")
        return self.logits

    def expand(self, group, capacity):
        self.calls.append("expand")

    def step(self, tokens, t, attention, positions):
        self.calls.append("step")
        return self.logits

    def select(self, keep):
        self.calls.append("select")


def test_geometric_mixture_is_the_normalised_weighted_log_mean():
    p = torch.tensor([[2.0, 0.0, -1.0]])
    r = torch.tensor([[0.0, 3.0, 1.0]])
    entered = []

    class Context:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return None

    mix = GeometricMixture(_Fixed(p), _Fixed(r), 0.25, ref_context=Context)
    out = mix.prefill(None, None, None)
    expected = torch.log_softmax(0.75 * torch.log_softmax(p, -1) + 0.25 * torch.log_softmax(r, -1), -1)
    torch.testing.assert_close(torch.log_softmax(out, -1), expected)
    mix.expand(2, 5)
    mix.step(None, 0, None, None)
    mix.select(torch.tensor([0]))
    assert mix.policy.calls == mix.ref.calls == ["prefill", "expand", "step", "select"]
    assert len(entered) == 2  # the reference's logits were read in its context, for prefill and step


def test_optimal_value_is_a_soft_maximum_by_hand():
    from posttrain.core.advantages import optimal_value

    rewards = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    v = optimal_value(rewards, 0.5)
    # 0.5 log((1 + e^2 + e^2 + 1) / 4) = 0.5 log((1 + e^2) / 2)
    torch.testing.assert_close(v, torch.tensor([0.5 * math.log((1 + math.e ** 2) / 2), 0.0], dtype=torch.float64))
    assert float(optimal_value(rewards[:1], 1e-3)) == pytest.approx(1.0, abs=2e-3)  # beta1 -> 0: the best sample


def test_a2po_regression_loss_and_gradient_by_hand():
    from posttrain.core.policy_losses import a2po_regression_loss

    logps = torch.tensor([-3.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-5.0, -1.0], dtype=torch.float64)
    adv = torch.tensor([0.5, -0.25], dtype=torch.float64)
    loss = a2po_regression_loss(logps, ref, adv, 0.1)
    torch.testing.assert_close(loss, torch.tensor([(0.2 - 0.5) ** 2, 0.25 ** 2], dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(logps.grad, torch.tensor([2 * 0.1 * (0.2 - 0.5), 2 * 0.1 * 0.25], dtype=torch.float64))
