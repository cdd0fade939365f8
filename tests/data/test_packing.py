"""Packing (best-fit decreasing, wrapped) and the causal-LM collator, by hand; packed attention on real models."""

import pytest
import torch
from datasets import Dataset

from posttrain.data.collate import IGNORE_INDEX, LanguageModelingCollator, flatten_padded
from posttrain.data.packing import best_fit_decreasing, pack_dataset, pack_rows
from posttrain.models.loading import load_causal_lm, load_tokenizer


def test_best_fit_decreasing_by_hand():
    # longest first: 6 -> bin0 (room 2); 5 -> bin1 (room 3); 4 -> bin2 (room 4);
    # 3 -> bin1, the tightest fit (room 0); 2 -> bin0 (room 0); 1 -> bin2 (room 3)
    assert best_fit_decreasing([5, 3, 4, 2, 6, 1], 8) == [[4, 3], [0, 1], [2, 5]]


def test_best_fit_decreasing_invariants():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(1, 50) for _ in range(500)]
    bins = best_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    lower_bound = -(-sum(lengths) // 64)
    assert len(bins) <= lower_bound * 1.1 + 1  # nearly full bins
    with pytest.raises(ValueError, match="more than the bin capacity"):
        best_fit_decreasing([3, 9], 8)


def test_pack_rows_bfd_truncates_and_keeps_columns_aligned():
    rows = {"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11]], "loss_mask": [[0, 1, 1], [1, 1], [0, 0, 1, 1, 1, 1]]}
    out = pack_rows(rows, max_length=5, strategy="bfd")
    # the 6-token sequence is cut to 5 and fills a bin; 3 + 2 share the other
    assert out["input_ids"] == [[6, 7, 8, 9, 10], [1, 2, 3, 4, 5]]
    assert out["loss_mask"] == [[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]
    assert out["seq_lengths"] == [[5], [3, 2]]


def test_pack_rows_wrapped_by_hand():
    rows = {"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]], "loss_mask": [[1, 1, 1], [0, 1], [1, 1, 1, 0]]}
    out = pack_rows(rows, max_length=4, strategy="wrapped")
    assert out["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8], [9]]
    assert out["loss_mask"] == [[1, 1, 1, 0], [1, 1, 1, 1], [0]]
    assert out["seq_lengths"] == [[3, 1], [1, 3], [1]]
    with pytest.raises(ValueError, match="packing_strategy"):
        pack_rows(rows, 4, strategy="greedy")


def test_pack_dataset():
    data = Dataset.from_dict({"input_ids": [[1] * 3, [2] * 4, [3] * 2, [4] * 5],
                              "loss_mask": [[1] * 3, [1] * 4, [1] * 2, [1] * 5], "extra": ["a", "b", "c", "d"]})
    packed = pack_dataset(data, 7, "bfd")
    assert packed.column_names == ["input_ids", "loss_mask", "seq_lengths"]
    assert sorted(sum(packed["seq_lengths"], [])) == [2, 3, 4, 5]
    assert len(packed) == 2


def test_collator_padding_free_by_hand():
    collate = LanguageModelingCollator(pad_token_id=0, padding_free=True)
    batch = collate([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
                     {"input_ids": [8, 9, 10, 11], "loss_mask": [1, 1, 1, 1], "seq_lengths": [2, 2]}])
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    # the first token of every sequence is never a target
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9, IGNORE_INDEX, 11]]


def test_collator_padded_and_packed_rows_by_hand():
    collate = LanguageModelingCollator(pad_token_id=0)
    batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 7], [IGNORE_INDEX, 9, IGNORE_INDEX]]
    assert "position_ids" not in batch

    packed = collate([{"input_ids": [5, 6, 7, 8], "seq_lengths": [1, 3]}, {"input_ids": [9, 10], "seq_lengths": [2]}])
    assert "attention_mask" not in packed
    assert packed["position_ids"].tolist() == [[0, 0, 1, 2], [0, 1, 2, 3]]  # pads continue the last sequence
    assert packed["labels"].tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 7, 8], [IGNORE_INDEX, 10, IGNORE_INDEX, IGNORE_INDEX]]


def test_flatten_padded_by_hand():
    batch = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0], [4, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]]),
             "labels": torch.tensor([[5, 6, 7], [8, 9, IGNORE_INDEX], [IGNORE_INDEX] * 3])}
    flat = flatten_padded(batch)
    assert set(flat) == {"input_ids", "labels", "position_ids"}
    assert flat["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4]]
    assert flat["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    # a row's first label was never a target (padded, nothing predicts it); flat, it would follow the row before
    assert flat["labels"].tolist() == [[IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9, IGNORE_INDEX]]
    # the same targets as the padded rows: the collator's batch flattens to the collator's padding-free batch
    rows = [{"input_ids": [5, 6, 7], "loss_mask": [1, 0, 1]}, {"input_ids": [8, 9]}, {"input_ids": [4]}]
    assert {k: v.tolist() for k, v in flatten_padded(LanguageModelingCollator(0)(rows)).items()} == \
        {k: v.tolist() for k, v in LanguageModelingCollator(0, padding_free=True)(rows).items()}
    # left padding, or a target on padding: flattening would change the targets
    assert flatten_padded({k: v.flip(1) for k, v in batch.items()}) is None
    assert flatten_padded(dict(batch, labels=batch["input_ids"])) is None


@pytest.mark.parametrize("name", ["posttrain/tiny-qwen2", "posttrain/tiny-llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_restarting_position_ids_give_block_diagonal_attention(name, attn):
    """transformers 5 reads restarting position_ids (no attention mask) as packed sequences."""
    model = load_causal_lm(name, attn_implementation=attn).eval()
    tokenizer = load_tokenizer(name)
    seqs = [tokenizer(t)["input_ids"] for t in ("reverse 1234 = 4321", "Beautiful is better than ugly.", "add 3 4 = 7")]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in seqs])
        flat = LanguageModelingCollator(0, padding_free=True)([{"input_ids": s} for s in seqs])
        packed = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"], use_cache=False).logits[0]
        rows = LanguageModelingCollator(0)([{"input_ids": seqs[0] + seqs[1], "seq_lengths": [len(seqs[0]), len(seqs[1])]},
                                            {"input_ids": seqs[2], "seq_lengths": [len(seqs[2])]}])
        by_row = model(input_ids=rows["input_ids"], position_ids=rows["position_ids"], use_cache=False).logits
        by_row = torch.cat([by_row[0], by_row[1, : len(seqs[2])]])
        # control: the same row without restarts lets later sequences see earlier ones
        plain = model(input_ids=flat["input_ids"], use_cache=False).logits[0]
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(by_row, alone, atol=1e-5, rtol=1e-5)
    assert (plain[len(seqs[0]):] - alone[len(seqs[0]):]).abs().max() > 1e-2
