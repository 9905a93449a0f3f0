"""Building an index from a corpus file: bounded memory, resumable, optionally spread over torchrun ranks.

The story of a build (``build_index``):

1. **Validate** the whole corpus first (`twotower.retrieval.corpus.validate_corpus`): a bad
   line or a duplicate id stops the build in seconds, naming file and line,
   before any model runs and before anything is written.
2. **Plan**: shard ``i`` is documents ``[i*S, (i+1)*S)`` of the (de-duplicated)
   corpus.  ``plan.json`` in the work directory pins the corpus bytes (sha256),
   the duplicate policy, the shard size and the encoder fingerprint.
3. **Encode** shard by shard, each written atomically as ``shards/shard-NNNNNN.npy``
   (float32, (n, D)).  Memory holds one shard of texts and vectors at a time.
   Rerunning after a crash finds the same plan and skips every shard already on
   disk; a plan that changed (other corpus, other model) starts over.  Under
   ``torchrun`` rank ``r`` encodes shards ``r, r+W, ...``.
4. **Assemble** (rank 0, after a barrier): create an `indexing.IndexStore` in the
   work directory, add the shards in order with their documents, commit, and
   rename it to the output path.  The output path therefore either does not
   exist or holds a complete index; a crash leaves only the work directory
   (``<out>.build``), which the next run resumes from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from twotower.common.atomic import atomic_path, atomic_write_text, fsync_dir
from twotower.indexing import IndexStore, document_text
from twotower.retrieval.corpus import CorpusPlan, iter_chunks, validate_corpus
from twotower.retrieval.dual_encoder import DualEncoder
from twotower.retrieval.sharding import DistInfo, barrier, init_build_group, owns_shard

logger = logging.getLogger(__name__)

PLAN_NAME = "plan.json"
SHARDS_DIR = "shards"
PLAN_FORMAT = 1
DEFAULT_SHARD_SIZE = 8192


def file_sha256(path: str, block: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class BuildPlan:
    """What the shards on disk were computed from; a resumed build must match it exactly."""

    corpus_sha256: str
    on_duplicate: str
    shard_size: int
    encoder_fingerprint: str
    num_documents: int
    dim: int
    format: int = PLAN_FORMAT

    @property
    def num_shards(self) -> int:
        return -(-self.num_documents // self.shard_size)

    def shard_rows(self, shard: int) -> int:
        return min(self.shard_size, self.num_documents - shard * self.shard_size)


def shard_path(work_dir: str, shard: int) -> str:
    return os.path.join(work_dir, SHARDS_DIR, f"shard-{shard:06d}.npy")


def _shard_done(path: str, rows: int, dim: int) -> bool:
    """A shard counts as finished only if it loads with the expected shape and dtype."""
    if not os.path.isfile(path):
        return False
    try:
        arr = np.load(path, mmap_mode="r")
    except (ValueError, OSError):
        return False
    return arr.shape == (rows, dim) and arr.dtype == np.float32


def _save_shard(path: str, vectors: np.ndarray) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(vectors, dtype=np.float32))


def prepare_work_dir(work_dir: str, plan: BuildPlan) -> int:
    """Create or reuse the work directory; returns how many finished shards it already holds."""
    plan_file = os.path.join(work_dir, PLAN_NAME)
    if os.path.isfile(plan_file):
        try:
            with open(plan_file, encoding="utf-8") as f:
                old = json.load(f)
        except (OSError, json.JSONDecodeError):
            old = None
        if old != asdict(plan):
            logger.warning("%s: an earlier build used another corpus, model or shard size; starting over", work_dir)
            shutil.rmtree(work_dir)
    os.makedirs(os.path.join(work_dir, SHARDS_DIR), exist_ok=True)
    if not os.path.isfile(plan_file):
        atomic_write_text(plan_file, json.dumps(asdict(plan), indent=2) + "\n")
    return sum(_shard_done(shard_path(work_dir, i), plan.shard_rows(i), plan.dim) for i in range(plan.num_shards))


def encode_shards(
    plan: BuildPlan,
    corpus: CorpusPlan,
    encoder: DualEncoder,
    work_dir: str,
    info: DistInfo,
    batch_size: int = 64,
    progress: bool = True,
) -> int:
    """Encode this rank's unfinished shards; returns how many documents it encoded."""
    mine = [i for i in range(plan.num_shards) if owns_shard(i, info)]
    todo = {i for i in mine if not _shard_done(shard_path(work_dir, i), plan.shard_rows(i), plan.dim)}
    if len(todo) < len(mine):
        logger.warning("resuming: %d of %d shards of rank %d already encoded", len(mine) - len(todo), len(mine),
                       info.rank)
    total = sum(plan.shard_rows(i) for i in todo)
    bar = tqdm(total=total, desc="encode documents", unit="doc", disable=not progress or info.rank != 0)
    encoded = 0
    for i, chunk in enumerate(iter_chunks(corpus.path, plan.shard_size, corpus.skip_lines)):
        if i not in todo:
            continue
        vecs = encoder.encode_documents([document_text(d) for d in chunk], batch_size=batch_size)  # (n, D)
        _save_shard(shard_path(work_dir, i), vecs)
        encoded += len(chunk)
        bar.update(len(chunk))
    bar.close()
    return encoded


def _training_sample(store: IndexStore, plan: BuildPlan, work_dir: str, seed: int = 0) -> np.ndarray:
    """Rows drawn (seeded) from all shards, for IVF/PQ training, without loading every shard at once."""
    n = store.vectors.train_sample_size(plan.num_documents)
    rows = np.sort(np.random.default_rng(seed).choice(plan.num_documents, size=n, replace=False))
    parts = []
    for i in range(plan.num_shards):
        lo = i * plan.shard_size
        sel = rows[(rows >= lo) & (rows < lo + plan.shard_rows(i))] - lo
        if len(sel):
            parts.append(np.asarray(np.load(shard_path(work_dir, i), mmap_mode="r")[sel]))
    return np.concatenate(parts)  # (n, D)


def assemble(
    plan: BuildPlan,
    corpus: CorpusPlan,
    work_dir: str,
    out: str,
    *,
    factory: str | None,
    metric: str,
    bm25: bool,
    extra: dict[str, Any],
    progress: bool = True,
) -> None:
    """Rank 0: shards + documents -> a committed IndexStore, renamed into place at `out`."""
    staging = os.path.join(work_dir, "index")
    if os.path.exists(staging):
        shutil.rmtree(staging)  # an interrupted assembly: cheap to redo
    store = IndexStore.create(staging, plan.dim, factory, metric, expected_size=plan.num_documents, bm25=bm25,
                              extra=extra)
    try:
        if not store.vectors.is_trained:
            store.train(_training_sample(store, plan, work_dir))
        bar = tqdm(total=plan.num_documents, desc="assemble index", unit="doc", disable=not progress)
        for i, chunk in enumerate(iter_chunks(corpus.path, plan.shard_size, corpus.skip_lines)):
            store.add(chunk, np.load(shard_path(work_dir, i), mmap_mode="r"))
            bar.update(len(chunk))
        bar.close()
        store.commit()
        if bm25:
            _ = store.bm25  # build the lexical index now and save it with the commit, not at first search
            store.commit()
    finally:
        store.close()
    os.rename(staging, out)  # `out` is absent or an empty directory: atomic on POSIX
    fsync_dir(os.path.dirname(os.path.abspath(out)))


def build_index(
    corpus_path: str,
    out: str,
    encoder: DualEncoder,
    *,
    factory: str | None = None,
    metric: str | None = None,
    bm25: bool = False,
    on_duplicate: str = "error",
    batch_size: int = 64,
    shard_size: int = DEFAULT_SHARD_SIZE,
    progress: bool = True,
    keep_shards: bool = False,
    work_dir: str | None = None,
    extra: Callable[[CorpusPlan, BuildPlan, dict[str, Any]], dict[str, Any]] | None = None,
) -> bool:
    """Build the index at `out` from a corpus file; returns True on the rank that assembled it (rank 0).

    See the module docstring for the steps.  `extra(corpus_plan, build_plan, run)`
    supplies the manifest's ``extra`` object (the pipeline block); `run` says how the
    build ran (world_size, shard_size, batch_size, encode_seconds).
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(f"{out}: already exists; add documents with `twotower index add` or remove it first")
    started = time.perf_counter()
    corpus = validate_corpus(corpus_path, on_duplicate)
    if corpus.num_documents == 0:
        raise ValueError(f"{corpus_path}: no documents to index")
    plan = BuildPlan(
        corpus_sha256=file_sha256(corpus_path),
        on_duplicate=on_duplicate,
        shard_size=int(shard_size),
        encoder_fingerprint=encoder.fingerprint(),
        num_documents=corpus.num_documents,
        dim=encoder.dim,
    )
    work_dir = work_dir or f"{out.rstrip(os.sep)}.build"
    import torch.distributed as dist

    created_group = not dist.is_initialized()
    info = init_build_group()
    try:
        if info.is_main:
            done = prepare_work_dir(work_dir, plan)
            if done:
                logger.warning("%s: resuming a build, %d of %d shards already encoded", work_dir, done,
                               plan.num_shards)
        barrier(info)
        encode_shards(plan, corpus, encoder, work_dir, info, batch_size=batch_size, progress=progress)
        barrier(info)
        if info.is_main:
            run = {"world_size": info.world_size, "shard_size": plan.shard_size, "batch_size": batch_size,
                   "encode_seconds": round(time.perf_counter() - started, 1)}
            meta = extra(corpus, plan, run) if extra is not None else {}
            assemble(plan, corpus, work_dir, out, factory=factory, metric=metric or encoder.metric, bm25=bm25,
                     extra=meta, progress=progress)
            if not keep_shards:
                shutil.rmtree(work_dir, ignore_errors=True)
        barrier(info)
    finally:
        if created_group and info.enabled:
            from twotower.retrieval.sharding import cleanup

            cleanup(info)
    return info.is_main
