"""The online engine's prompts: which prompts each process takes for each micro-batch, in an order that a
resumed run can reproduce, from a map-style dataset (`PromptBatches`, a DataLoader over `_PromptOrder`) or a
stream (`_PromptStream`, whose place is checkpointed: `new_stream_position`).

Each process's prompts of a generation batch come once per micro-batch they feed (`training_step` generates at
the first and reads its buffer at the others), so transformers' counting and skipping of batches on resume
works unchanged. With asynchronous rollouts (`ahead` > 0), each generation batch's first micro-batch also
brings the next `ahead` generation batches' prompts, numbered (`generation_batch`), so that they can be sampled
before their turn (trainers/online_async.py); the order being a function of (seed, epoch), batches past the
epoch's end are the next epoch's.
"""

from __future__ import annotations

import functools
import itertools

import torch

from posttrain.data import formats
from posttrain.data.multimodal import IMAGE_COLUMNS, VisionDataError, check_vision_row
from posttrain.data.tokenize import TokenizeError

PROMPT_ONLY = formats.FormatInfo("prompt_only", False, ("prompt",))


class _PromptOrder(torch.utils.data.Sampler):
    """The batch sampler of `PromptBatches`: for each global batch of prompts, this process's dataset indices,
    once per micro-batch they feed, as (index, micro_index) pairs. A pure function of (seed, epoch), so that
    transformers can skip the batches a resumed run already trained on (`skip_first_batches`)."""

    def __init__(self, n: int, per_process: int, num_processes: int, rank: int, repeat: int, shuffle: bool,
                 seed: int, ahead: int = 0):
        self.n, self.per_process, self.num_processes, self.rank = n, per_process, num_processes, rank
        self.repeat, self.shuffle, self.seed, self.epoch, self.ahead = repeat, shuffle, seed, 0, ahead

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n // (self.per_process * self.num_processes) * self.repeat

    def _batches(self, epoch: int) -> list[list[int]]:
        """This process's dataset indices of each global batch of `epoch`."""
        n, size = self.n, self.per_process * self.num_processes
        order = (torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
                 if self.shuffle else list(range(n)))
        return [order[start + self.rank * self.per_process: start + (self.rank + 1) * self.per_process]
                for start in range(0, n - size + 1, size)]

    def __iter__(self):
        batches = self._batches(self.epoch)
        for b, mine in enumerate(batches):
            if not self.ahead:
                for r in range(self.repeat):
                    yield [(i, r) for i in mine]
                continue
            ordinal = self.epoch * len(batches) + b  # generation batches counted from the first epoch's first
            later = [(i, None, ordinal + a) for a in range(1, self.ahead + 1)
                     for i in self._batches((ordinal + a) // len(batches))[(ordinal + a) % len(batches)]]
            for r in range(self.repeat):
                yield [(i, r, ordinal) for i in mine] + (later if r == 0 else [])


class _Tagged(torch.utils.data.Dataset):
    """The dataset read at (index, micro_index) keys: each row comes with the micro-batch it feeds."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        index, micro_index, *ordinal = key  # (index, micro_index[, generation batch]); micro_index None: ahead
        return self.dataset[index], micro_index, *ordinal


class PromptBatches(torch.utils.data.DataLoader):
    """The training dataloader: this process's share of each global batch of prompts, yielded once for
    every micro-batch it feeds (`repeat`), tagged with `micro_index`. Incomplete global batches are dropped.
    A plain DataLoader over a batch sampler, so that a resumed run skips what it trained on as any other."""

    def __init__(self, dataset, collate, prompts_per_process: int, num_processes: int, process_index: int,
                 repeat: int, shuffle: bool, seed: int, ahead: int = 0):
        order = _PromptOrder(len(dataset), prompts_per_process, num_processes, process_index, repeat, shuffle, seed,
                             ahead)
        super().__init__(_Tagged(dataset), batch_sampler=order, collate_fn=functools.partial(_collate_tagged, collate))

    def set_epoch(self, epoch: int):
        self.batch_sampler.set_epoch(epoch)


def _collate_tagged(collate, items: list[tuple]) -> dict:
    """(row, micro_index) items -> the collated batch with its micro_index; (row, micro_index, generation batch)
    items (lookahead) add `generation_batch` and, for the rows of later batches (micro_index None), `ahead`: a list
    of (generation batch, collated batch)."""
    own = [item for item in items if item[1] is not None]
    out = {**collate([item[0] for item in own]), "micro_index": own[0][1]}
    if len(own[0]) > 2:
        later: dict[int, list[dict]] = {}
        for row, _, ordinal in (item for item in items if item[1] is None):
            later.setdefault(ordinal, []).append(row)
        out.update(generation_batch=own[0][2], ahead=[(ordinal, collate(rows)) for ordinal, rows in later.items()])
    return out


def new_stream_position() -> dict:
    """Where a `_PromptStream` stands: its pass over the stream, the prompts of that pass before the current
    generation batch, the batch's next micro-batch, and the micro-batches handed out since training began."""
    return {"passes": 0, "prompts": 0, "micro": 0, "yielded": 0}


class _PromptStream(torch.utils.data.IterableDataset):
    """The prompts of a streamed dataset (`datasets.IterableDataset`) in stream order. Each run of
    `per_process * num_processes` consecutive prompts is one generation batch, of which this process takes
    the prompts at positions rank, rank + num_processes, ...; each share is yielded once per micro-batch it
    feeds (`repeat`), with its micro_index. At the end of the stream an incomplete batch is dropped and a new
    pass begins (`set_epoch(pass)` reshuffles a shuffled stream), so the stream never ends: max_steps does.

    `position` (see `new_stream_position`) is updated as items are handed out and saved with checkpoints.
    A resumed run reads on from there, skipping the prompts already consumed without tokenising them; since
    transformers then skips the micro-batches already trained on by iterating past them, `placeholders`
    empty items (None) come first."""

    def __init__(self, dataset, per_process: int, num_processes: int, rank: int, repeat: int, position: dict,
                 placeholders: int = 0):
        self.dataset, self.per_process, self.num_processes, self.rank = dataset, per_process, num_processes, rank
        self.repeat, self.position, self.placeholders = repeat, position, placeholders

    def __iter__(self):
        pos, size = self.position, self.per_process * self.num_processes
        yield from itertools.repeat(None, self.placeholders)
        self.placeholders = 0
        while True:
            if hasattr(self.dataset, "set_epoch"):
                self.dataset.set_epoch(pos["passes"])
            rows, batches = itertools.islice(iter(self.dataset), pos["prompts"], None), 0
            while len(batch := list(itertools.islice(rows, size))) == size:
                if "prompt" in batch[0]:  # named by its place in the stream, before it is tokenised
                    _check_streamed(batch, pos)
                mine = batch[self.rank::self.num_processes]
                for micro in range(pos["micro"], self.repeat):
                    last = micro == self.repeat - 1  # the position after this item: the next batch's start
                    pos.update(micro=0 if last else micro + 1, prompts=pos["prompts"] + size * last,
                               yielded=pos["yielded"] + 1)
                    yield mine, micro
                batches += 1
            if batches == 0 and pos["prompts"] == 0:
                raise ValueError(f"the streamed train_dataset holds {len(batch)} prompts, fewer than one generation "
                                 f"batch needs ({size}); add prompts or lower per_device_train_batch_size / "
                                 "steps_per_generation")
            pos.update(passes=pos["passes"] + 1, prompts=0, micro=0)


def _check_streamed(batch: list[dict], pos: dict) -> None:
    """Refuse a streamed batch's bad prompt row, naming its place in the stream: rows with images by the vision
    rules (`data.multimodal.check_vision_row`), the others as text prompts."""
    try:
        if any(column in batch[0] for column in IMAGE_COLUMNS):
            for k, row in enumerate(batch):
                check_vision_row(row, pos["prompts"] + k)
        else:
            formats.validate(batch, PROMPT_ONLY, start=pos["prompts"])
    except (formats.FormatError, VisionDataError) as err:
        raise TokenizeError(f"streamed train_dataset (pass {pos['passes']}): {err}") from None


def _collate_streamed(collate, item: tuple[list[dict], int] | None) -> dict | None:
    return None if item is None else {**collate(item[0]), "micro_index": item[1]}


class _Reordered(torch.utils.data.IterableDataset):
    """A map-style dataset's rows in a random order per pass (`set_epoch`), or in order without `shuffle`."""

    def __init__(self, dataset, shuffle: bool, seed: int):
        self.dataset, self.shuffle, self.seed, self.epoch = dataset, shuffle, seed, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __iter__(self):
        n = len(self.dataset)
        # a seed of its own, apart from the training order's seed + epoch
        seed = self.seed * 1_000_003 + 7919 * (self.epoch + 1)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist() if self.shuffle else range(n)
        for i in order:
            yield self.dataset[i]


def top_up_prompts(dataset, streamed: bool, per_process: int, num_processes: int, rank: int, position: dict,
                   shuffle: bool, seed: int):
    """The extra prompts of dynamic sampling: an endless iterator of this process's rows (a list of dicts) of one
    generation batch after another, read from the train dataset on a cursor of its own (a stream in stream order,
    a map-style dataset shuffled per pass with a seed apart from the training order's), so the training order,
    and transformers' skipping of it on resume, stays as it is. `position` (`new_stream_position`) moves as
    batches are handed out; a checkpoint saves it and a resumed run reads on from there."""
    source = dataset if streamed else _Reordered(dataset, shuffle, seed)
    for rows, _ in _PromptStream(source, per_process, num_processes, rank, 1, position):
        yield rows
