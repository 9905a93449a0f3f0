"""Batches for contrastive training in which no document is the positive of two items.

With in-batch negatives every positive is a negative for every other query of
the batch.  If two items share a positive (two phrasings of one question, or
one query listed twice), the loss would push a query away from its own answer.
The sampler prevents that by construction: an item whose positive is already in
the batch is deferred to a later batch (as sentence-transformers'
NoDuplicatesBatchSampler does).  Other overlaps (a hard negative that is some
query's positive) are handled by the loss mask instead.

Each query with several positives contributes one item per positive per epoch,
so every labelled pair is seen once an epoch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from twotower.retrieval.training.training_data import TrainExample


@dataclass(frozen=True)
class Item:
    """One (query, positive) training item: index into the example list and the chosen positive id."""

    example: int
    positive: str


class UniquePositiveBatches:
    """Shuffled, seeded batches of `Item`s; within a batch every positive id is distinct.

    Args:
        examples: the training examples.
        batch_size: items per batch.
        seed: shuffling seed; epoch e uses seed + e, so runs are reproducible.
        drop_last: drop a final short batch (keeps every batch the same shape, which the
            cross-rank gather needs).
    """

    def __init__(self, examples: Sequence[TrainExample], batch_size: int, seed: int = 0,
                 drop_last: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.items = [Item(i, p) for i, e in enumerate(examples) for p in e.positives]
        if drop_last and len(self.items) < batch_size:
            raise ValueError(f"{len(self.items)} training pairs cannot fill one batch of {batch_size}")
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = drop_last

    def __len__(self) -> int:
        """Batches per epoch (an upper bound when deferrals leave a short tail)."""
        n = len(self.items) // self.batch_size
        return n if self.drop_last or len(self.items) % self.batch_size == 0 else n + 1

    def epoch(self, epoch: int) -> Iterator[list[Item]]:
        remaining = list(self.items)
        random.Random(self.seed + epoch).shuffle(remaining)
        while remaining:
            batch: list[Item] = []
            seen: set[str] = set()
            rest: list[Item] = []
            for item in remaining:
                if len(batch) < self.batch_size and item.positive not in seen:
                    batch.append(item)
                    seen.add(item.positive)
                else:
                    rest.append(item)
            remaining = rest
            if len(batch) == self.batch_size or (batch and not self.drop_last):
                yield batch
            else:
                return

    def __iter__(self) -> Iterator[list[Item]]:
        epoch = 0
        while True:
            yield from self.epoch(epoch)
            epoch += 1
