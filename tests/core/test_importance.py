"""The importance-sampling corrections (core/importance.py, TRL's four `vllm_importance_sampling_mode`s) against
numbers worked by hand, in float64."""

import math

import pytest
import torch

from posttrain.core.importance import IMPORTANCE_CORRECTIONS, log_importance_ratio
from posttrain.core.policy_losses import truncated_importance_weights

D = torch.float64
# two completions of 3 and 2 tokens (the last position of row 1 is padding, with garbage log-probs)
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.3, -9.0]], dtype=D)
BEHAVIOUR = torch.tensor([[-1.5, -1.0, -3.0], [-0.1, -0.5, 5.0]], dtype=D)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# log pi_old/mu per token: row 0: 0.5, -1.0, 2.5; row 1: -0.1, 0.2 (padding: 0)
TOKEN_LOG = [[0.5, -1.0, 2.5], [-0.1, 0.2, 0.0]]
SEQ_LOG = [2.0, 0.1]  # their sums


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-12, atol=1e-12)


def weights(mode, clip_min=None, clip_max=3.0, old=OLD, behaviour=BEHAVIOUR, mask=MASK):
    return IMPORTANCE_CORRECTIONS[mode].fn(old, behaviour, mask, clip_min, clip_max)


def test_the_four_trl_modes_are_registered_with_their_facts():
    assert sorted(IMPORTANCE_CORRECTIONS) == ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"]
    for name, entry in IMPORTANCE_CORRECTIONS.items():
        assert name == f"{entry.level}_{entry.constraint}"


def test_log_ratio_by_hand():
    close(log_importance_ratio(OLD, BEHAVIOUR, MASK, "token"), TOKEN_LOG)
    close(log_importance_ratio(OLD, BEHAVIOUR, MASK, "sequence").flatten(), SEQ_LOG)


def test_token_truncate_by_hand():
    w = weights("token_truncate")
    assert w.dtype == D
    # e^0.5 = 1.649, e^-1 = 0.368, e^2.5 = 12.18 -> 3; e^-0.1 = 0.905, e^0.2 = 1.221; padding 0
    close(w, [[math.exp(0.5), math.exp(-1.0), 3.0], [math.exp(-0.1), math.exp(0.2), 0.0]])
    # with a lower bound of 0.5: e^-1 = 0.368 -> 0.5
    close(weights("token_truncate", clip_min=0.5)[0], [math.exp(0.5), 0.5, 3.0])


def test_token_mask_by_hand():
    close(weights("token_mask"), 
        [[math.exp(0.5), math.exp(-1.0), 0.0], [math.exp(-0.1), math.exp(0.2), 0.0]])
    # [0.5, 3]: e^-1 = 0.368 leaves too
    close(weights("token_mask", clip_min=0.5)[0], [math.exp(0.5), 0.0, 0.0])


def test_sequence_truncate_by_hand():
    # row 0: e^2 = 7.39 -> 3 at every token; row 1: e^0.1 = 1.105 at its 2 tokens, 0 on padding
    e = math.exp(0.1)
    close(weights("sequence_truncate"), [[3.0, 3.0, 3.0], [e, e, 0.0]])
    close(weights("sequence_truncate", clip_max=10.0)[0], [math.exp(2.0)] * 3)
    close(weights("sequence_truncate", clip_min=1.5, clip_max=10.0)[1], [1.5, 1.5, 0.0])


def test_sequence_mask_by_hand():
    e = math.exp(0.1)
    close(weights("sequence_mask"), [[0.0, 0.0, 0.0], [e, e, 0.0]])
    close(weights("sequence_mask", clip_min=1.2, clip_max=10.0), 
        [[math.exp(2.0)] * 3, [0.0, 0.0, 0.0]])


def test_long_sequences_give_the_cap_or_zero_never_inf():
    old = torch.zeros(1, 2000, dtype=D)
    behaviour = torch.full((1, 2000), -1.0, dtype=D)  # log ratio 2000: e^2000 overflows float64
    mask = torch.ones(1, 2000)
    assert torch.equal(weights("sequence_truncate", old=old, behaviour=behaviour, mask=mask), torch.full((1, 2000), 3.0, dtype=D))
    assert torch.equal(weights("sequence_mask", old=old, behaviour=behaviour, mask=mask), torch.zeros(1, 2000, dtype=D))
    below = weights("sequence_mask", clip_min=0.1, old=behaviour, behaviour=old, mask=mask)  # e^-2000 < 0.1
    assert torch.equal(below, torch.zeros(1, 2000, dtype=D))


def test_no_gradient_flows_and_float32_stays_float32():
    old = OLD.float().requires_grad_(True)
    for mode in IMPORTANCE_CORRECTIONS:
        w = IMPORTANCE_CORRECTIONS[mode].fn(old, BEHAVIOUR.float(), MASK, None, 3.0)
        assert not w.requires_grad and w.dtype == torch.float32


def test_truncated_importance_weights_is_token_truncate_everywhere():
    full = torch.ones_like(OLD)
    assert torch.equal(truncated_importance_weights(OLD, BEHAVIOUR, 3.0), weights("token_truncate", mask=full))
