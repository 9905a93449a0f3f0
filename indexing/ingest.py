"""Resumable bulk builds of an ``IndexStore``: embed, add and commit in batches.

Why resumable: encoding a corpus is the expensive part of a build. Documents already in
the store are skipped *before* ``embed`` is called, and the store commits every
``commit_every`` documents, so rerunning the same call after a crash (or a kill) only
encodes what the last commit did not hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from twotower.indexing.docstore import Document, as_document

if TYPE_CHECKING:
    from twotower.indexing.store import IndexStore


@dataclass
class IngestStats:
    """What one ``ingest`` call did."""

    added: int
    skipped: int  # ids already present (e.g. committed by an earlier, interrupted run)
    commits: int


def ingest(
    store: IndexStore,
    docs: Iterable[Mapping[str, Any]],
    embed: Callable[[list[Document]], np.ndarray],
    *,
    batch_size: int = 256,
    commit_every: int = 10_000,
    progress: bool = False,
    total: int | None = None,
) -> IngestStats:
    """Embed and add ``docs`` to ``store`` in batches, committing every ``commit_every`` documents.

    ``embed`` receives a list of ``Document`` and returns their vectors (n, D). An untrained
    (IVF/PQ) index first buffers ``train_sample_size`` vectors, trains on them, then adds
    them. The last partial batch is committed before returning.
    """
    if batch_size < 1 or commit_every < 1:
        raise ValueError(f"batch_size and commit_every must be >= 1, got {batch_size}, {commit_every}")
    added = skipped = commits = since_commit = 0
    buffer: list[tuple[list[Document], np.ndarray]] = []  # waiting for IVF/PQ training
    vectors = store.vectors
    train_target = 0 if vectors.is_trained else vectors.train_sample_size(1 << 62)
    bar = tqdm(total=total, desc="ingest", unit="doc", disable=not progress)
    for chunk in _batched(docs, batch_size):
        rows = [as_document(d, "document") for d in chunk]
        present = store.contains_many([d["id"] for d in rows])
        new = [d for d, p in zip(rows, present) if not p]
        skipped += len(rows) - len(new)
        bar.update(len(rows))
        if not new:
            continue
        vecs = np.asarray(embed(new))  # (n, D)
        if not store.vectors.is_trained:
            buffer.append((new, vecs))
            if sum(len(b[0]) for b in buffer) < train_target:
                continue
            n = _train_and_add(store, buffer)
        else:
            n = store.add(new, vecs)
        added += n
        since_commit += n
        if since_commit >= commit_every:
            store.commit()
            commits += 1
            since_commit = 0
    if buffer:  # fewer documents than the training target: train on all of them
        added += _train_and_add(store, buffer)
    bar.close()
    if store.has_pending:
        store.commit()
        commits += 1
    return IngestStats(added=added, skipped=skipped, commits=commits)


def _train_and_add(store: IndexStore, buffer: list[tuple[list[Document], np.ndarray]]) -> int:
    docs = [d for b in buffer for d in b[0]]
    vecs = np.concatenate([b[1] for b in buffer])  # (n, D)
    buffer.clear()
    store.train(vecs)
    return store.add(docs, vecs)


def _batched(items: Iterable[Any], n: int) -> Iterator[list[Any]]:
    it = iter(items)
    while chunk := list(islice(it, n)):
        yield chunk
