import math

import pytest
import torch

from posttrain.core.masked import (
    AGGREGATIONS,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

# x = [[1, 2, 3], [4, 5, 6]] with the mask keeping 1, 2 and 4
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_masked_sum_and_mean_by_hand():
    assert masked_sum(X, MASK).item() == 7.0  # 1 + 2 + 4
    assert masked_mean(X, MASK).item() == pytest.approx(7 / 3)
    assert masked_sum(X, MASK, dim=-1).tolist() == [3.0, 4.0]
    assert masked_mean(X, MASK, dim=-1).tolist() == [1.5, 4.0]
    assert masked_mean(X, MASK.bool(), dim=0).tolist() == [2.5, 2.0, 0.0]  # empty column -> 0


def test_padding_nan_and_inf_do_not_leak():
    x = X.clone()
    x[0, 2], x[1, 1] = float("nan"), float("inf")
    assert masked_sum(x, MASK).item() == 7.0
    assert masked_mean(x, MASK, dim=-1).tolist() == [1.5, 4.0]


def test_masked_var_by_hand():
    # values 1, 2, 4: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 42/9
    x = torch.tensor([[1.0, 2.0, 99.0], [4.0, -7.0, 0.0]], dtype=torch.float64)
    assert masked_var(x, MASK, unbiased=False).item() == pytest.approx(42 / 9 / 3)
    assert masked_var(x, MASK, unbiased=True).item() == pytest.approx(42 / 9 / 2)
    # one entry: no spread, and no division by zero
    assert masked_var(x, torch.tensor([[1, 0, 0], [0, 0, 0]])).item() == 0.0


def test_masked_whiten():
    torch.manual_seed(0)
    x = torch.randn(4, 6, dtype=torch.float64) * 3 + 2
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4, [1] * 5 + [0]])
    w = masked_whiten(x, mask)
    assert masked_mean(w, mask).item() == pytest.approx(0.0, abs=1e-12)
    assert masked_var(w, mask).item() == pytest.approx(1.0, rel=1e-6)
    assert (w[mask == 0] == 0).all()
    # against a plain computation on the selected entries
    sel = x[mask.bool()].tolist()
    mean = sum(sel) / len(sel)
    std = math.sqrt(sum((v - mean) ** 2 for v in sel) / (len(sel) - 1) + 1e-8)
    assert w[0, 0].item() == pytest.approx((x[0, 0].item() - mean) / std)
    # shift_mean=False keeps the mean, only rescales
    w_keep = masked_whiten(x, mask, shift_mean=False)
    assert masked_mean(w_keep, mask).item() == pytest.approx(mean)
    assert w_keep[1, 1].item() == pytest.approx((x[1, 1].item() - mean) / std + mean)


def test_aggregations_by_hand():
    # per-token losses 1, 2 | 4 kept; row means 1.5 and 4; row sums 3 and 4
    assert aggregate_loss(X, MASK, "token_mean").item() == pytest.approx(7 / 3)
    assert aggregate_loss(X, MASK, "seq_mean_token_mean").item() == pytest.approx(2.75)
    assert aggregate_loss(X, MASK, "seq_mean_token_sum").item() == pytest.approx(3.5)
    # Dr. GRPO: 7 / (2 sequences * max_length 4)
    assert aggregate_loss(X, MASK, "seq_mean_token_sum_norm", max_length=4).item() == 0.875
    # explicit denominators replace the defaults
    assert aggregate_loss(X, MASK, "token_mean", denominator=14).item() == 0.5
    assert aggregate_loss(X, MASK, "seq_mean_token_mean", denominator=11).item() == 0.5
    assert aggregate_loss(X, MASK, "seq_mean_token_sum", denominator=7).item() == 1.0
    assert aggregate_loss(X, MASK, "seq_mean_token_sum_norm", denominator=70).item() == 0.1


def test_empty_rows_are_not_sequences():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert aggregate_loss(X, mask, "seq_mean_token_mean").item() == 1.5
    assert aggregate_loss(X, mask, "seq_mean_token_sum").item() == 3.0


def test_aggregate_errors():
    with pytest.raises(ValueError, match="max_length"):
        aggregate_loss(X, MASK, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_loss(X, MASK, "mean")


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_micro_batches_with_global_denominator_sum_to_whole_batch(mode):
    torch.manual_seed(1)
    per_token = torch.rand(8, 7, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([7, 1, 3, 5, 2, 6, 4, 7])
    mask = torch.arange(7)[None, :] < lengths[:, None]
    global_denominator = {
        "token_mean": mask.sum(),
        "seq_mean_token_mean": 8,
        "seq_mean_token_sum": 8,
        "seq_mean_token_sum_norm": 8 * 7,
    }[mode]
    whole = aggregate_loss(per_token, mask, mode, max_length=7)
    (grad_whole,) = torch.autograd.grad(whole, per_token)
    split = sum(
        aggregate_loss(per_token[i : i + 4], mask[i : i + 4], mode, denominator=global_denominator)
        for i in (0, 4)
    )
    (grad_split,) = torch.autograd.grad(split, per_token)
    assert split.item() == pytest.approx(whole.item(), rel=1e-12)
    assert torch.allclose(grad_split, grad_whole)


def test_local_token_mean_differs_from_whole_batch():
    # the reason for global denominators: averaging two local token means is biased
    # rows 0-3 hold 2 + 2 + 2 + 2 tokens of loss 1, rows 4-7 hold 4 tokens in total of loss 3
    per_token = torch.tensor([[1.0, 1.0]] * 4 + [[3.0, 0.0]] * 4)
    mask = torch.tensor([[1, 1]] * 4 + [[1, 0]] * 4)
    whole = aggregate_loss(per_token, mask, "token_mean")  # (8 + 12) / 12 = 5/3
    local = (aggregate_loss(per_token[:4], mask[:4], "token_mean")
             + aggregate_loss(per_token[4:], mask[4:], "token_mean")) / 2  # (1 + 3) / 2 = 2
    assert whole.item() == pytest.approx(5 / 3)
    assert local.item() == pytest.approx(2.0)


def test_shared_prefix_attention_mask_by_hand():
    from posttrain.core.masked import shared_prefix_attention_mask

    # prefix of 2, block 1 of 2, block 2 of 1, one pad
    segment = torch.tensor([[0, 0, 1, 1, 2, 9]])
    valid = torch.tensor([[True, True, True, True, True, False]])
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0],
                             [1, 1, 1, 1, 0, 0],
                             [1, 1, 0, 0, 1, 0],   # block 2 sees the prefix, not block 1
                             [1, 1, 0, 0, 0, 1]], dtype=torch.bool)  # the pad (segment 9): the prefix and itself
    mask = shared_prefix_attention_mask(segment, valid)
    assert mask.shape == (1, 1, 6, 6)
    assert torch.equal(mask[0, 0], expected)
    additive = shared_prefix_attention_mask(segment, valid, additive_dtype=torch.float32)
    assert torch.equal(additive[0, 0] == 0, expected) and additive.min() == torch.finfo(torch.float32).min


def test_each_mode_counts_its_own_denominator():
    # the registered count is what aggregate_loss divides by, and what a caller sums over micro-batches
    lengths = torch.tensor([7, 1, 3, 0, 2, 6, 4, 7])  # row 3 is batch padding
    mask = torch.arange(7)[None, :] < lengths[:, None]
    expected = {"token_mean": 30, "seq_mean_token_mean": 7, "seq_mean_token_sum": 7, "seq_mean_token_sum_norm": 8 * 9}
    assert set(expected) == set(AGGREGATIONS)
    for mode, count in expected.items():
        assert AGGREGATIONS[mode].count(mask, 9).item() == count
        halves = sum(AGGREGATIONS[mode].count(mask[i:i + 4], 9) for i in (0, 4))
        assert halves.item() == count  # counts add up over a split batch
        x = torch.rand(8, 7, dtype=torch.float64)
        assert aggregate_loss(x, mask, mode, max_length=9).item() == pytest.approx(
            aggregate_loss(x, mask, mode, denominator=count).item())


def test_a_registered_aggregation_is_one_function_and_its_count(monkeypatch):
    from posttrain.core.masked import count_tokens, register_aggregation

    monkeypatch.setattr("posttrain.core.masked.AGGREGATIONS", AGGREGATIONS.copy())  # registered for this test only
    import posttrain.core.masked as masked

    @register_aggregation("token_sum_over_two", count=lambda mask, max_length: torch.tensor(2.0))
    def half_sum(per_token, mask, denominator):
        return masked_sum(per_token, mask) / denominator

    assert masked.AGGREGATIONS["token_sum_over_two"].fn is half_sum
    assert aggregate_loss(X, MASK, "token_sum_over_two").item() == 3.5  # (1 + 2 + 4) / 2
    with pytest.raises(ValueError, match="already registered"):
        register_aggregation("token_mean", count=count_tokens)(half_sum)
    with pytest.raises(TypeError, match="count"):  # the denominator cannot be forgotten
        register_aggregation("no_count")
    with pytest.raises(TypeError, match="count must be a function"):
        register_aggregation("no_count", count=None)
    assert "no_count" not in masked.AGGREGATIONS
