"""The vectors of an index directory as append-only segments: commits cost what they change.

A *segment* is one immutable ``VectorIndex`` file (``seg-<seq>-<token>.faiss``, the format
of ``twotower.indexing.vector_file``). ``Segments`` is the set an ``IndexStore`` searches:

* committed segments, each loaded once (memory-mapped) and never written again;
* deletions from them as *tombstones* — ids hidden at search time (``VectorIndex.hide``),
  recorded as rows of the ``tombstones`` table, so a delete writes a few SQLite rows, not a
  vector file;
* one in-memory segment for the vectors added since the last commit, written as a new file
  at the next commit (its size is the batch, not the index).

Search runs over every segment and merges the per-segment top-k by score. For ``Flat`` that
is exact: the same ids and scores as one index over the same vectors (a segment's k best
include every member of the global k best that it holds). For ANN factories (HNSW, IVF)
each segment is searched approximately and the union is exact over those candidates, so
recall is at least that of each segment alone; results are not bit-identical to one big
graph (a fresh HNSW build is not deterministic under threads either).

Merge policy (``MergePolicy``, log-structured like Lucene's ``LogMergePolicy``): a segment
of ``n`` live vectors has level ``floor(log_factor(max(n, min_segment) / min_segment))``;
when ``factor`` consecutive segments share a level they are merged into one (live vectors
only, tombstones dropped), which lands one level up. Each vector is therefore rewritten at
most once per level — ``log_factor(N / min_segment)`` times over the life of an index of N
vectors — so the amortised bytes written per added vector are ``O(log N)`` vector sizes, and
a single add of B vectors writes B vectors plus, now and then, a merge. A segment with
more than ``max_deleted`` of its stored vectors deleted is rewritten alone (compacted).
Merged files are written *before* the commit point, in the same commit, so merges share
the commit's all-or-nothing visibility; the files they replace are deleted after it.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from twotower.indexing.errors import IndexFormatError
from twotower.indexing.integrity import combine, file_sha256, hex64, set_digest
from twotower.indexing.search_result import MISSING_ID, SearchResult, check_k, empty_result
from twotower.indexing.vector_index import (
    DuplicatePolicy,
    FastScanIVFError,
    Metric,
    VectorIndex,
    fast_scan_ivf_error,
)

logger = logging.getLogger(__name__)

# VectorIndex search/build options a segment set keeps from its manifest (and hands to new segments)
VECTOR_OPTIONS = ("ef_search", "ef_construction", "nprobe", "train_sample", "seed", "auto_rebuild_fraction")
SEGMENT_PREFIX = "seg-"
SEGMENT_SUFFIX = ".faiss"
HASH_ON_OPEN_MAX = 16 << 20  # segment files up to 16 MiB are SHA-256-checked on every open


@dataclass(frozen=True)
class MergePolicy:
    """When segments are merged (see the module docstring). Stored in the index; ``IndexStore.create`` takes one."""

    factor: int = 10
    min_segment: int = 1000
    max_deleted: float = 0.3

    def __post_init__(self) -> None:
        if self.factor < 2 or self.min_segment < 1 or not 0 < self.max_deleted <= 1:
            raise ValueError(f"MergePolicy: need factor >= 2, min_segment >= 1, 0 < max_deleted <= 1; got {self}")

    def level(self, live: int) -> int:
        return int(math.floor(math.log(max(live, self.min_segment) / self.min_segment, self.factor) + 1e-9))

    def plan(self, sizes: Sequence[tuple[int, int]]) -> list[list[int]]:
        """Groups of segment positions to rewrite as one segment each, given ``(live, stored)`` per segment.

        A heavily deleted segment is a group of its own (compaction; with no live vector left it
        is simply dropped). Then, repeatedly, the first ``factor`` consecutive segments of one
        level are merged; the merged size is used for the next round, so a merge that fills the
        next level cascades within the same commit.
        """
        entries: list[tuple[int, list[int], bool]] = []  # (live, positions, must rewrite)
        for i, (live, stored) in enumerate(sizes):
            deleted = stored - live
            entries.append((live, [i], stored > 0 and (live == 0 or deleted > self.max_deleted * stored)))
        while True:
            run = 0
            for j in range(1, len(entries) + 1):
                if j < len(entries) and self.level(entries[j][0]) == self.level(entries[run][0]):
                    if j - run + 1 == self.factor:
                        break
                    continue
                run = j
            else:
                break
            take = entries[run:run + self.factor]
            entries[run:run + self.factor] = [(sum(e[0] for e in take), [p for e in take for p in e[1]], True)]
        return [positions for _live, positions, rewrite in entries if rewrite]


@dataclass
class CommitPlan:
    """What a commit of ``Segments`` consists of, for the owner to record atomically with its commit point."""

    segments: list[Segment]  # the segment list of the new generation, in order
    added: list[dict[str, Any]]  # records of the files written for it
    dropped: list[str]  # committed segments it no longer has (merged or emptied)
    tombstones: list[tuple[str, str]]  # (segment name, id) deleted from kept segments
    next_seq: int


@dataclass
class Segment:
    """One committed segment: its record (as in the ``segments`` table) and the loaded index."""

    name: str
    seq: int
    stored: int
    bytes: int
    sha256: str
    ids_digest: str
    index: VectorIndex = field(repr=False)
    base: VectorIndex = field(repr=False)  # as loaded (nothing hidden); shared by snapshots

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        del d["index"], d["base"]
        return d


class SegmentVanished(Exception):
    """A committed segment file disappeared while opening it (a writer moved on): retry on a newer commit."""


def segment_name(seq: int) -> str:
    return f"{SEGMENT_PREFIX}{seq:08d}-{secrets.token_hex(4)}{SEGMENT_SUFFIX}"


CHECK_HINT = "; run `twotower index check`"  # what an open adds to a checksum error; `index check` itself leaves it off


def load_segment(directory: Path, rec: dict[str, Any], *, mmap: bool, hash_max: int | None,
                 reuse: Segment | None = None) -> Segment:
    """Load (or reuse) a committed segment and check it against its record.

    ``hash_max``: SHA-256-check files up to this many bytes (None = always). A file missing now
    raises ``SegmentVanished`` — the caller decides whether a newer commit explains it.
    """
    path = directory / rec["name"]
    if reuse is not None and reuse.sha256 == rec["sha256"]:
        base = reuse.base
    else:
        try:
            size = path.stat().st_size
            if size != rec["bytes"]:
                raise IndexFormatError(path, f"file has {size} bytes, the commit record says {rec['bytes']}")
            if rec["sha256"] and (hash_max is None or size <= hash_max):
                if file_sha256(path) != rec["sha256"]:
                    raise IndexFormatError(path, "checksum mismatch: the file is not the one committed "
                                                 "(damaged or changed)" + CHECK_HINT)
            base = VectorIndex.load(path, mmap=mmap)
        except (FileNotFoundError, IndexFormatError):
            if not path.exists():
                raise SegmentVanished(rec["name"]) from None
            raise
        if rec["ids_digest"] and hex64(set_digest(base.ids())) != rec["ids_digest"]:
            raise IndexFormatError(path, "the ids in the file's id map differ from the committed ones "
                                         "(the trailer was changed or damaged)")
        if base.stored_count != rec["stored"]:
            raise IndexFormatError(path, f"holds {base.stored_count} vectors, the commit record says {rec['stored']}")
    return Segment(rec["name"], rec["seq"], rec["stored"], rec["bytes"], rec["sha256"], rec["ids_digest"],
                   base.shallow_copy(), base)


class Segments:
    """Vectors with string ids over committed segments plus staged changes: add, remove, search, commit.

    The small interface an ``IndexStore`` needs from its vectors (and the seam for other
    backends): ``add`` / ``remove`` stage, ``search`` / ``__len__`` / ``ids`` see staged changes,
    ``prepare_commit`` writes the files of the next commit and says what to record, and ``apply``
    makes them the committed state once the owner's commit point has passed.
    """

    def __init__(self, dim: int, factory: str, metric: Metric, options: dict[str, Any],
                 segments: Sequence[Segment] = (), policy: MergePolicy | None = None) -> None:
        self.dim, self.factory, self.metric = dim, factory, metric
        self.options = dict(options)
        self.policy = policy or MergePolicy()
        self.segments: list[Segment] = list(segments)
        self._template: VectorIndex | None = None
        self._pending: VectorIndex | None = None
        self._staged_tombstones: list[tuple[str, str]] = []  # (segment name, id)
        self._where: dict[str, int] = {}  # id -> position in self.segments (committed, live)
        self._allowed_cache: dict[int, tuple[Any, tuple, list[np.ndarray]]] = {}  # see _allowed_labels
        self._allowed_lock = threading.Lock()
        for pos, seg in enumerate(self.segments):
            for i in seg.index.ids():
                self._where[i] = pos

    native_filters = False  # a filter reaches search() as the allowed ids (twotower.indexing.vectors)
    max_k = None

    # ------------------------------------------------------------------ configuration
    def __getattr__(self, name: str) -> Any:  # ef_search, nprobe, ... as stored
        if name in VECTOR_OPTIONS:
            return self.__dict__["options"].get(name)
        raise AttributeError(name)

    def template(self) -> VectorIndex:
        """An empty index of this configuration, trained when the factory needs training and any segment is."""
        if self._template is None:
            try:
                fresh = VectorIndex(self.dim, self.factory, self.metric, **self._vi_options())
            except FastScanIVFError:
                if not self.segments:
                    raise
                raise fast_scan_ivf_error(self.factory, built=True) from None  # built before it was refused
            trained = next((s.base for s in self.segments if s.base.is_trained), None)
            self._template = trained.empty_copy() if trained is not None and not fresh.is_trained else fresh
        return self._template

    def _vi_options(self) -> dict[str, Any]:
        return {k: v for k, v in self.options.items() if v is not None}

    def _new_index(self) -> VectorIndex:
        return self.template().empty_copy()

    @property
    def kind(self) -> str:
        return self.template().kind

    @property
    def is_trained(self) -> bool:
        return self.template().is_trained

    def train_sample_size(self, n: int) -> int:
        return self.template().train_sample_size(n)

    def train(self, vectors: np.ndarray) -> None:
        """Train the IVF/PQ parts once (before the first add); later segments copy the training."""
        tpl = self.template()
        if not tpl.is_trained:
            tpl.train(vectors)
            if self._pending is not None and not len(self._pending):
                self._pending = None

    # ------------------------------------------------------------------ membership
    def __len__(self) -> int:
        return sum(len(s.index) for s in self.segments) + (len(self._pending) if self._pending else 0)

    def __contains__(self, doc_id: object) -> bool:
        return doc_id in self._where or (self._pending is not None and doc_id in self._pending)

    def contains_many(self, ids: Iterable[str]) -> list[bool]:
        return [i in self for i in ids]

    def ids(self) -> list[str]:
        """Live ids, oldest segment first, each in insertion order."""
        out = [i for s in self.segments for i in s.index.ids()]
        return out + (self._pending.ids() if self._pending else [])

    @property
    def tombstone_count(self) -> int:
        """Deleted vectors still stored (hidden in committed segments, graph tombstones)."""
        return sum(s.index.tombstone_count for s in self.segments) + (
            self._pending.tombstone_count if self._pending else 0)

    @property
    def stored_count(self) -> int:
        return sum(s.index.stored_count for s in self.segments) + (self._pending.stored_count if self._pending else 0)

    @property
    def has_changes(self) -> bool:
        return bool(self._staged_tombstones) or (self._pending is not None and self._pending.stored_count > 0)

    # ------------------------------------------------------------------ staging
    def add(self, ids: Sequence[str], vectors: np.ndarray, *, on_duplicate: DuplicatePolicy = "error",
            metadata: Sequence[Mapping[str, Any]] | None = None) -> int:
        """Stage vectors (N, D) under ids; duplicates against any segment follow ``on_duplicate``.

        ``metadata`` (one object per id) is for backends that filter by it themselves; FAISS
        segments do not keep it (filters are resolved to ids from the documents).
        """
        if on_duplicate not in ("error", "skip", "replace"):
            raise ValueError(f"on_duplicate must be 'error', 'skip' or 'replace', got {on_duplicate!r}")
        ids = list(ids)
        present = [i for i in ids if i in self]
        if present and on_duplicate == "error":
            raise ValueError(f"add: {len(present)} id(s) already in the index, e.g. {present[:5]}; "
                             "pass on_duplicate='skip' or 'replace'")
        if present and on_duplicate == "skip":
            keep = [j for j, i in enumerate(ids) if i not in self]
            ids, vectors = [ids[j] for j in keep], np.asarray(vectors)[keep]
        if self._pending is None:
            self._pending = self._new_index()
        pending = self._pending
        committed_present = [i for i in present if i in self._where] if on_duplicate == "replace" else []
        n = pending.add(ids, vectors, on_duplicate="replace" if on_duplicate == "replace" else "error")
        self._hide(committed_present)  # after a successful add: a refused batch changes nothing
        return n

    def remove(self, ids: Iterable[str]) -> list[str]:
        """Stage deletions; returns the ids that were not present (in input order)."""
        ids = list(dict.fromkeys(ids))
        missing = [i for i in ids if i not in self]
        in_pending = [i for i in ids if self._pending is not None and i in self._pending]
        if in_pending:
            self._pending.remove(in_pending)
        self._hide([i for i in ids if i in self._where])
        return missing

    def _hide(self, ids: Sequence[str]) -> None:
        by_segment: dict[int, list[str]] = {}
        for i in ids:
            by_segment.setdefault(self._where.pop(i), []).append(i)
        for pos, group in by_segment.items():  # one id-map release per segment, not per id
            seg = self.segments[pos]
            seg.index.hide(group)
            self._staged_tombstones.extend((seg.name, i) for i in group)

    # ------------------------------------------------------------------ reading
    def reconstruct(self, ids: Sequence[str]) -> np.ndarray:
        """Stored vectors (N, D) of ``ids``; KeyError if absent."""
        out = np.empty((len(ids), self.dim), dtype=np.float32)  # (N, D)
        groups: dict[int, list[int]] = {}
        for j, i in enumerate(ids):
            if i in self._where:
                groups.setdefault(self._where[i], []).append(j)
            elif self._pending is not None and i in self._pending:
                groups.setdefault(-1, []).append(j)
            else:
                raise KeyError(f"reconstruct: id {i!r} is not in the index")
        for pos, rows in groups.items():
            index = self._pending if pos == -1 else self.segments[pos].index
            out[rows] = index.reconstruct([ids[j] for j in rows])
        return out

    def search(self, queries: np.ndarray, k: int = 10, *, filter: Any = None,
               allowed: Collection[str] | None = None, **params: Any) -> SearchResult:
        """Top-k over all segments: each segment's top-k, merged by score (ties: older segment first).

        ``allowed``: only these ids may be hits; each segment gets the labels of its own allowed
        ids and returns k of them whenever it holds k (``VectorIndex.search``), so the merge has
        no shortfall either. ``filter`` is ignored: FAISS knows no metadata, the store resolves a
        filter to ``allowed`` (``native_filters = False``).
        """
        parts = [s.index for s in self.segments if len(s.index)]
        if self._pending is not None and len(self._pending):
            parts.append(self._pending)
        if allowed is not None and parts:
            per_part = self._allowed_labels(parts, allowed)
            if len(parts) == 1:
                return parts[0].search(queries, k, allowed=per_part[0], **params)
            results = [p.search(queries, k, allowed=lab, **params) for p, lab in zip(parts, per_part)]
            return _merge(results, k)
        if len(parts) == 1:
            return parts[0].search(queries, k, **params)
        if not parts:
            q = np.asarray(queries)
            k = check_k(k)
            if q.ndim not in (1, 2) or q.shape[-1] != self.dim:
                raise ValueError(f"queries have shape {q.shape}; this index holds vectors of dimension {self.dim}")
            return empty_result(1 if q.ndim == 1 else q.shape[0], k)
        return _merge([p.search(queries, k, **params) for p in parts], k)

    def _allowed_labels(self, parts: list[VectorIndex], allowed: Collection[str]) -> list[np.ndarray]:
        """Each part's labels of the ``allowed`` ids, cached per allowed object while the parts are unchanged.

        A reader snapshot reuses one allowed set for every query with the same filter, so the
        O(allowed) mapping from ids to labels is paid once, not per query.
        """
        key = tuple((id(p), len(p), p._ids.next_label) for p in parts)
        with self._allowed_lock:
            hit = self._allowed_cache.get(id(allowed))
        if hit is not None and hit[0]() is allowed and hit[1] == key:
            return hit[2]
        labels = [p.allowed_labels(allowed) for p in parts]
        try:
            ref = weakref.ref(allowed)  # sets and frozensets: cacheable; lists are not
        except TypeError:
            return labels
        with self._allowed_lock:
            if len(self._allowed_cache) >= 8:
                self._allowed_cache.pop(next(iter(self._allowed_cache)))
            self._allowed_cache[id(allowed)] = (ref, key, labels)
        return labels

    # ------------------------------------------------------------------ commit
    def digest(self) -> int:
        """Digest of the live ids (committed segments minus tombstones, plus staged additions)."""
        parts = [int(s.ids_digest, 16) if s.ids_digest else set_digest(s.base.ids()) for s in self.segments]
        hidden = [set_digest(set(s.base.ids()) - set(s.index.ids())) for s in self.segments
                  if s.index.tombstone_count != s.base.tombstone_count]
        if self._pending is not None:
            parts.append(set_digest(self._pending.ids()))
        return combine(*parts, minus=hidden)

    def prepare_commit(self, directory: Path, seq: int, written: list[Path],
                       checkpoint: Callable[[str], None] = lambda stage: None) -> CommitPlan:
        """Write the files of the next commit: the staged vectors as a new segment, and any merges.

        Nothing becomes visible: the caller records ``CommitPlan`` in its commit transaction and,
        once that has committed, calls ``apply(plan.segments)``. Files written are appended to
        `written` as they appear (a caller that fails before its commit point deletes them);
        `checkpoint` is called after each file (the crash tests' kill points).
        """
        old = list(self.segments)
        pending = self._pending if self._pending is not None and self._pending.stored_count else None
        sizes = [(len(s.index), s.index.stored_count) for s in old]
        if pending is not None:
            sizes.append((len(pending), pending.stored_count))
        groups = self.policy.plan(sizes)
        checkpoint("before_vectors")
        members = [s.index for s in old] + ([pending] if pending is not None else [])
        group_of = {p: g for g in groups for p in g}
        result: list[Segment] = []
        for pos, member in enumerate(members):
            group = group_of.get(pos)
            if group is None and pos < len(old):
                result.append(old[pos])  # unchanged: its tombstones stay recorded
                continue
            if group is not None and pos != group[0]:
                continue  # merged into the group's first position
            index = member if group is None else self.merged_index([members[p] for p in group])
            if len(index) == 0 and group is not None:
                continue  # everything in the group was deleted: the segments are dropped
            seg = write_segment(directory, index, seq)
            seq += 1
            written.append(directory / seg.name)
            if group is not None:
                logger.info("merged %d segments into %s (%d vectors)", len(group), seg.name, len(index))
            checkpoint("segment_written" if group is None else "merge_written")
            result.append(seg)
        dropped = [old[p].name for g in groups for p in g if p < len(old)]
        keep = {s.name for s in result}
        old_names = {s.name for s in old}
        return CommitPlan(
            segments=result,
            added=[s.record() for s in result if s.name not in old_names],
            dropped=dropped,
            tombstones=[(name, i) for name, i in self._staged_tombstones if name in keep],
            next_seq=seq,
        )

    def merged_index(self, members: Sequence[VectorIndex]) -> VectorIndex:
        """One new index holding the live vectors of ``members`` (in order), bit-identical as stored."""
        out = self._new_index()
        for m in members:
            ids = m.ids()
            for s in range(0, len(ids), 65536):
                chunk = ids[s:s + 65536]
                out.add_stored(chunk, m.reconstruct(chunk))
        return out

    def apply(self, segments: list[Segment]) -> None:
        """The committed state after a commit: these segments, nothing staged."""
        self.segments = segments
        self._pending = None
        self._staged_tombstones = []
        self._where = {i: pos for pos, s in enumerate(segments) for i in s.index.ids()}

    def repair(self) -> None:
        """Nothing to do: the store deletes segment files no commit names (``IndexStore._sweep``)."""

    def close(self) -> None:
        """Nothing to release: the store deletes merged-away files itself."""

    def __repr__(self) -> str:
        return (f"Segments(dim={self.dim}, factory={self.factory!r}, metric={self.metric!r}, "
                f"segments={len(self.segments)}, live={len(self)}, tombstones={self.tombstone_count})")


def _merge(results: Sequence[SearchResult], k: int) -> SearchResult:
    """One top-k from per-segment top-k results, by score (ties: earlier result first)."""
    scores = np.concatenate([r.scores for r in results], axis=1)  # (Q, S*k)
    names = np.concatenate([np.array(r.ids, dtype=object).reshape(len(r.ids), -1) for r in results], axis=1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # (Q, k)
    top = np.take_along_axis(scores, order, 1).astype(np.float32)
    ids = np.take_along_axis(names, order, 1)
    out_ids = [[i if np.isfinite(s) else MISSING_ID for i, s in zip(row, srow)]
               for row, srow in zip(ids.tolist(), top.tolist())]
    return SearchResult(ids=out_ids, scores=top)


def write_segment(directory: Path, index: VectorIndex, seq: int) -> Segment:
    """Save `index` as a new segment file (atomic rename, fsync) and return its record."""
    name = segment_name(seq)
    path = directory / name
    index.save(path)
    base = index
    return Segment(name, seq, index.stored_count, path.stat().st_size, file_sha256(path),
                   hex64(set_digest(index.ids())), base.shallow_copy(), base)
