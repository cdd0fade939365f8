"""Packing: many short tokenised sequences -> few rows of up to `max_length` tokens.

* ``bfd`` (best-fit decreasing): sequences, longest first, each go to the open bin with the
  least room that still fits them, or to a new bin. Sequences are whole (cut to `max_length`
  beforehand), so no sequence is split across rows and bins come out nearly full.
* ``wrapped``: all sequences concatenated and cut every `max_length` tokens; no waste at all,
  but a sequence may continue in the next row (its second piece starts a new position count).

A packed row keeps ``seq_lengths``, the lengths of the sequences it holds, so the collator can
restart ``position_ids`` at 0 for each one; transformers turns restarting position ids (with no
attention mask) into block-diagonal attention, so packed sequences never see each other.
"""

from __future__ import annotations

from bisect import bisect_left, insort

STRATEGIES = ("bfd", "wrapped")


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of indices into `lengths`, each bin's lengths summing to at most `capacity`.

    Ties keep the original order (stable sort), so the result is deterministic.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    # room -> ids of open bins with exactly that much room; `rooms` lists the non-empty keys sorted
    by_room: dict[int, list[int]] = {}
    rooms: list[int] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"sequence {i} has {n} tokens, more than the bin capacity {capacity}; truncate first")
        if n == 0:
            continue
        k = bisect_left(rooms, n)
        if k < len(rooms):  # the tightest bin that fits
            room = rooms[k]
            b = by_room[room].pop()
            if not by_room[room]:
                del by_room[room], rooms[k]
        else:
            b, room = len(bins), capacity
            bins.append([])
        bins[b].append(i)
        room -= n
        if room > 0:
            if room not in by_room:
                by_room[room] = []
                insort(rooms, room)
            by_room[room].append(b)
    return bins


def pack_rows(rows: dict[str, list[list[int]]], max_length: int, strategy: str = "bfd") -> dict[str, list]:
    """Pack columns of token lists (`input_ids` plus aligned ones such as `loss_mask`).

    rows: {"input_ids": [[...], ...], "loss_mask": [[...], ...], ...}, all lists aligned.
    Returns the same columns packed, plus "seq_lengths" (list of ints per packed row).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown packing_strategy {strategy!r}; choose one of {STRATEGIES}")
    columns = list(rows)
    out: dict[str, list] = {c: [] for c in columns + ["seq_lengths"]}
    if strategy == "bfd":
        ids = rows["input_ids"]
        for b in best_fit_decreasing([min(len(s), max_length) for s in ids], max_length):
            for c in columns:
                out[c].append([t for i in b for t in rows[c][i][:max_length]])
            out["seq_lengths"].append([min(len(ids[i]), max_length) for i in b])
        return out
    # wrapped: one long stream, cut into blocks; track where sequences start inside each block
    stream = {c: [t for seq in rows[c] for t in seq] for c in columns}
    starts, total = set(), 0
    for seq in rows["input_ids"]:
        starts.add(total)
        total += len(seq)
    for lo in range(0, total, max_length):
        hi = min(lo + max_length, total)
        for c in columns:
            out[c].append(stream[c][lo:hi])
        cuts = sorted({lo} | {s for s in starts if lo < s < hi}) + [hi]
        out["seq_lengths"].append([b - a for a, b in zip(cuts, cuts[1:])])
    return out


def pack_dataset(dataset, max_length: int, strategy: str = "bfd", columns=("input_ids", "loss_mask")):
    """A `datasets.Dataset` of tokenised rows packed into rows of at most `max_length` tokens.

    Packing happens over the whole dataset in one batch (bins see every sequence); other columns
    are dropped.
    """
    columns = [c for c in columns if c in dataset.column_names]
    dataset = dataset.select_columns(columns)
    return dataset.map(lambda batch: pack_rows(batch, max_length, strategy), batched=True,
                       batch_size=None, remove_columns=columns, desc=f"packing ({strategy})")
