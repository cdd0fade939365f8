"""DPPO's policy loss against numbers worked by hand (float64): which tokens leave the trust region, the capped
detached ratio as each token's weight, and the two binary divergences."""

import math

import pytest
import torch

from posttrain.core.policy_losses import POLICY_LOSSES, binary_divergence, dppo

# the sampled token's probability under the sampling policy (q) and the current one (p), four tokens
Q = torch.tensor([[0.5, 0.5, 0.5, 0.01]] * 2, dtype=torch.float64)
P = torch.tensor([[0.8, 0.6, 0.2, 0.05]] * 2, dtype=torch.float64)
A = torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=torch.float64)  # row 0 positive advantages, row 1 negative
MASK = torch.ones(2, 4)


def test_binary_divergences_by_hand():
    tv = binary_divergence(P.log(), Q.log(), "binary_tv")[0]
    assert tv.tolist() == pytest.approx([0.3, 0.1, 0.3, 0.04])
    kl = binary_divergence(P.log(), Q.log(), "binary_kl")[0]
    by_hand = [q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
               for q, p in [(0.5, 0.8), (0.5, 0.6), (0.5, 0.2), (0.01, 0.05)]]
    assert kl.tolist() == pytest.approx(by_hand)  # 0.2231, 0.0204, 0.2231, 0.0247
    with pytest.raises(ValueError, match="divergence_type must be one of"):
        binary_divergence(P.log(), Q.log(), "topk_tv")


@pytest.mark.parametrize("divergence_type", ["binary_tv", "binary_kl"])
def test_tokens_leaving_the_region_in_the_advantages_direction_are_left_out(divergence_type):
    logp = P.log().requires_grad_()
    loss, stats = dppo(logp, Q.log(), A, MASK, divergence_type=divergence_type)
    # A > 0: token 0 rose past 0.15 (TV 0.3, KL 0.223) -> out; token 2 fell, which lowers the objective's gain
    # from it, not further out of the region for a positive advantage -> in. A < 0: the mirror, token 2 out.
    assert stats["clipped"].tolist() == [[True, False, False, False], [False, False, True, False]]
    weights = [0.8 / 0.5, 0.6 / 0.5, 0.2 / 0.5, 0.05 / 0.01]  # the detached ratios p / q
    expected = [[0.0, -weights[1], -weights[2], -weights[3]], [weights[0], weights[1], 0.0, weights[3]]]
    assert loss.tolist() == [pytest.approx(row) for row in expected]
    loss.sum().backward()  # -sg(w) A ∇log π: the gradient per log-prob is the value
    assert logp.grad.tolist() == [pytest.approx(row) for row in expected]


def test_the_ratio_weight_is_capped_at_clip_ratio_c():
    loss, _ = dppo(P.log(), Q.log(), A, MASK, clip_ratio_c=2.0)
    assert loss[0, 3].item() == pytest.approx(-2.0)  # ratio 5 capped at 2
    assert loss[0, 1].item() == pytest.approx(-1.2)


def test_registered_with_the_token_mean_and_its_options():
    entry = POLICY_LOSSES["dppo"]
    assert entry.aggregation == "token_mean"
    assert entry.options == ("epsilon", "epsilon_high", "divergence_type", "clip_ratio_c")
