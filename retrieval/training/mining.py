"""Hard-negative mining: documents a first-stage retriever ranks high for a query but that are not its positives.

Random negatives are too easy to teach a retriever or reranker much; the
documents the current system confuses with the answer are the informative ones
(DPR's BM25 negatives, ANCE's dense negatives).  Two guards keep mining honest:

* a rank window (default ranks 10-100): the very top of the list is where
  *unlabelled positives* concentrate (SciFact and MS MARCO judge one or two
  documents per query; many top hits are relevant but unjudged);
* a score margin: a candidate scored within `margin` of the positive (or above
  `max_ratio` x the positive's score, NV-Retriever's "TopK-PercPos") is dropped
  as a likely false negative.

The retriever is any callable ``retrieve(queries, k) -> [[(doc_id, score), ...]]``
(best first), so mining works with BM25, a dense index, a hybrid, or the
SearchPipeline, without this module knowing which.  The result is written as
JSONL (one query a line, ``pos_ids``/``neg_ids`` plus ranks, scores and sources)
with a ``.meta.json`` beside it, so a run can be inspected and reused by
`twotower.retrieval.training.training_data.read_jsonl_training`.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from twotower.common.atomic import atomic_path, atomic_write_text
from twotower.common.errors import DataError
from twotower.common.lines import json_lines
from twotower.retrieval.training.training_data import TrainExample, text_id

logger = logging.getLogger(__name__)

Ranked = list[tuple[str, float]]
Retrieve = Callable[[Sequence[str], int], list[Ranked]]
# (queries, doc ids per query) -> scores per query: exact first-stage scores of given documents.
ScoreDocs = Callable[[Sequence[str], Sequence[Sequence[str]]], list[list[float]]]


@dataclass
class MiningConfig:
    """Which candidates become negatives.

    rank_start / rank_end: 1-based inclusive window of the retrieved list (10-100: skip the likeliest
        unlabelled positives at the top, stay within what the first stage will hand the reranker).
    num_negatives: hard negatives kept per query (sampled uniformly from the window, seeded).
    margin: drop candidates with score > positive score - margin (None: no absolute margin).
    max_ratio: drop candidates with score > max_ratio * positive score (e.g. 0.95; None: off).
    num_random: extra negatives drawn uniformly from the corpus (easy negatives keep calibration).
    """

    rank_start: int = 10
    rank_end: int = 100
    num_negatives: int = 8
    margin: float | None = None
    max_ratio: float | None = None
    num_random: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.rank_start <= self.rank_end:
            raise ValueError(f"rank window {self.rank_start}-{self.rank_end} must satisfy 1 <= start <= end")
        if self.num_negatives < 0 or self.num_random < 0:
            raise ValueError("num_negatives and num_random must be >= 0")
        if self.max_ratio is not None and not 0 < self.max_ratio:
            raise ValueError(f"max_ratio must be > 0, got {self.max_ratio}")


@dataclass
class MinedQuery:
    query_id: str
    query: str
    positives: list[str]
    negatives: list[str]
    ranks: list[int | None]  # 1-based first-stage rank; None for random negatives
    scores: list[float | None]
    sources: list[str]  # "hard" | "random"
    positive_score: float | None = None


@dataclass
class MiningStats:
    queries: int = 0
    candidates: int = 0
    dropped_positive: int = 0
    dropped_margin: int = 0
    positive_score_unknown: int = 0
    short_of_negatives: int = 0
    random_negatives: int = 0
    counts: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("counts")
        return d


def mine_hard_negatives(
    examples: Sequence[TrainExample],
    retrieve: Retrieve,
    corpus_ids: Sequence[str],
    config: MiningConfig | None = None,
    score_docs: ScoreDocs | None = None,
    batch_size: int = 64,
    progress: bool = False,
) -> tuple[list[MinedQuery], MiningStats]:
    """Mine negatives for every example from `retrieve`'s ranks `rank_start..rank_end`.

    The positive's score (for the margin) is read from the retrieved list when a
    positive was retrieved, else from `score_docs` when given; when neither
    knows it the margin cannot apply to that query, which is counted
    (``positive_score_unknown``), not hidden.
    """
    config = config or MiningConfig()
    rng = random.Random(config.seed)
    stats = MiningStats()
    all_ids = list(corpus_ids)
    out: list[MinedQuery] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(examples), desc="mine negatives", unit="query")
    for start in range(0, len(examples), batch_size):
        chunk = list(examples[start:start + batch_size])
        # no rank past the corpus exists: `--ranks 1-1000000000000` allocated result arrays of that size (MemoryError)
        ranked = retrieve([e.query for e in chunk], min(config.rank_end, max(1, len(all_ids))))
        if len(ranked) != len(chunk):
            raise ValueError(f"retrieve returned {len(ranked)} lists for {len(chunk)} queries")
        pos_scores: list[float | None] = []
        need = []
        for i, (ex, hits) in enumerate(zip(chunk, ranked)):
            found = [s for d, s in hits if d in ex.positives]
            pos_scores.append(max(found) if found else None)
            if not found and score_docs is not None and (config.margin is not None or config.max_ratio is not None):
                need.append(i)
        if need:
            exact = score_docs([chunk[i].query for i in need], [list(chunk[i].positives) for i in need])
            for i, s in zip(need, exact):
                pos_scores[i] = max(s) if len(s) else None
        for ex, hits, pos_score in zip(chunk, ranked, pos_scores):
            out.append(_select(ex, hits, pos_score, config, rng, all_ids, stats))
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    logger.info("mined negatives: %s", stats.as_dict())
    return out, stats


def _select(
    ex: TrainExample, hits: Ranked, pos_score: float | None, config: MiningConfig,
    rng: random.Random, all_ids: list[str], stats: MiningStats,
) -> MinedQuery:
    stats.queries += 1
    positives = set(ex.positives)
    margin_on = config.margin is not None or config.max_ratio is not None
    if margin_on and pos_score is None:
        stats.positive_score_unknown += 1
    candidates = []
    for rank, (doc_id, score) in enumerate(hits, 1):
        if rank < config.rank_start or not doc_id or not np.isfinite(score):
            continue
        stats.candidates += 1
        if doc_id in positives:
            stats.dropped_positive += 1
            continue
        if pos_score is not None and _too_close(score, pos_score, config):
            stats.dropped_margin += 1
            continue
        candidates.append((rank, doc_id, float(score)))
    chosen = sorted(rng.sample(candidates, min(config.num_negatives, len(candidates))))
    if len(chosen) < config.num_negatives:
        stats.short_of_negatives += 1
    taken = positives | {d for _, d, _ in chosen}
    randoms: list[str] = []
    if config.num_random:
        tries = 0
        while len(randoms) < config.num_random and tries < 20 * config.num_random:
            tries += 1
            d = all_ids[rng.randrange(len(all_ids))]
            if d not in taken:
                taken.add(d)
                randoms.append(d)
        stats.random_negatives += len(randoms)
    return MinedQuery(
        ex.query_id, ex.query, list(ex.positives),
        negatives=[d for _, d, _ in chosen] + randoms,
        ranks=[r for r, _, _ in chosen] + [None] * len(randoms),
        scores=[s for _, _, s in chosen] + [None] * len(randoms),
        sources=["hard"] * len(chosen) + ["random"] * len(randoms),
        positive_score=pos_score,
    )


def _too_close(score: float, pos_score: float, config: MiningConfig) -> bool:
    if config.margin is not None and score > pos_score - config.margin:
        return True
    return config.max_ratio is not None and pos_score > 0 and score > config.max_ratio * pos_score


# ---- files -------------------------------------------------------------------------------------------
def write_mined(path: str, mined: Sequence[MinedQuery], meta: Mapping | None = None) -> None:
    """JSONL (``query_id, query, pos_ids, neg_ids, neg_ranks, neg_scores, neg_sources``) + ``<path>.meta.json``."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for m in mined:
            f.write(json.dumps({
                "query_id": m.query_id, "query": m.query, "pos_ids": m.positives, "neg_ids": m.negatives,
                "neg_ranks": m.ranks, "neg_scores": m.scores, "neg_sources": m.sources,
                "positive_score": m.positive_score,
            }, ensure_ascii=False) + "\n")
    atomic_write_text(path + ".meta.json", json.dumps(dict(meta or {}), indent=2, default=str) + "\n")


def _mined_id(value: object) -> str | None:
    """An id of a mined file as the corpus reader takes one: a string, or an integer as its decimal text
    (`twotower.eval.io.beir`'s ``_id`` rule); None for anything else (null, a float, a boolean, a list)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value if isinstance(value, str) else None


def iter_mined(path: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line number, query id, negative ids) of each line of a file written by `write_mined`.

    Ids are strings, or integers read as their decimal text, as the corpus reader reads an integer ``_id``;
    any other value is refused naming the line and the field. Why: ``str()`` turned a null into the id
    "None" and a float into "5.0", which then matched nothing (or, worse, a document of that name).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"mined negatives file not found: {path}")
    for lineno, obj in json_lines(path):
        qid, neg = obj.get("query_id"), obj.get("neg_ids")
        if qid is None or not isinstance(neg, list):
            raise DataError(path, lineno, "expected fields 'query_id' (string) and 'neg_ids' (list)")
        if _mined_id(qid) is None:
            raise DataError(path, lineno, f"field 'query_id' must be a string (or an integer), got {json.dumps(qid)}",
                            field="query_id")
        ids = [_mined_id(d) for d in neg]
        if None in ids:
            i = ids.index(None)
            raise DataError(path, lineno, f"field 'neg_ids' must hold document ids, strings (or integers); item "
                            f"{i + 1} is {json.dumps(neg[i])}", field="neg_ids")
        yield lineno, _mined_id(qid), ids


def read_mined_negatives(path: str) -> dict[str, list[str]]:
    """{query id: negative ids} from a file written by `write_mined` (to merge into training examples)."""
    out: dict[str, list[str]] = {}
    for _, qid, neg in iter_mined(path):
        out.setdefault(qid, []).extend(neg)
    if not out:
        raise DataError(path, None, "no mined queries")
    return out


# ---- retrievers --------------------------------------------------------------------------------------
def bm25_retriever(corpus: Mapping[str, str], **bm25_kwargs) -> Retrieve:
    """A `Retrieve` over an in-memory corpus with the index package's BM25 (Lucene variant, k1=0.9, b=0.4)."""
    from twotower.indexing.bm25 import BM25

    bm = BM25(**bm25_kwargs)
    bm.add(list(corpus), list(corpus.values()))

    def retrieve(queries: Sequence[str], k: int) -> list[Ranked]:
        res = bm.search(list(queries), k=k)
        return [[(d, float(s)) for d, s in zip(ids, row) if d] for ids, row in zip(res.ids, res.scores)]

    return retrieve


class DenseRetriever:
    """Exact inner-product search over a corpus embedded once with a dual encoder (for mining and dev runs).

    The vectors live in a flat `twotower.indexing.VectorIndex` (metric "ip"), the index the
    search pipeline uses, so mining and dev runs rank exactly as a Flat index would.
    `__call__` is a `Retrieve` (ties by doc id); `score_docs` a `ScoreDocs` (exact scores of named documents).
    """

    def __init__(self, dual, corpus: Mapping[str, str], batch_size: int | None = None, progress: bool = False) -> None:
        vectors = dual.encode_documents(list(corpus.values()), batch_size=batch_size, progress=progress)  # (N, H)
        self._setup(dual, list(corpus), vectors)

    @classmethod
    def from_vectors(cls, dual, ids: Sequence[str], vectors: np.ndarray) -> DenseRetriever:
        """A retriever over document vectors (N, H) encoded earlier (e.g. saved by a frozen-document run)."""
        self = cls.__new__(cls)
        self._setup(dual, list(ids), vectors)
        return self

    @classmethod
    def from_index(cls, directory: str, corpus: Mapping[str, str], bf16: bool | str = "auto",
                   device: str | None = None) -> DenseRetriever:
        """A retriever over an index's own vectors of `corpus`, with the index's query encoder.

        Why: the index already holds every document's vector, and encoding a corpus again costs
        minutes on a CPU. Refused, naming the document, when one of `corpus` is missing from the
        index or its text differs from the index's copy (its vector would be another text's).
        """
        from twotower.indexing import document_text
        from twotower.retrieval.pipeline import SearchPipeline

        pipe = SearchPipeline.load(directory, use_default_reranker=False, bf16=bf16, device=device or "cpu")
        try:
            if pipe.passages is not None:
                raise ValueError(f"--teacher {directory}: an index of passages has no vector per document; "
                                 "give the dual encoder's directory instead")
            if pipe.store.manifest.metric == "l2":
                raise ValueError(f"--teacher {directory}: an l2 index; a teacher scores by inner product "
                                 "(give the dual encoder's directory instead)")
            ids = list(corpus)
            for doc_id, doc in zip(ids, pipe.store.get(ids)):
                if doc is None and doc_id == text_id(corpus[doc_id]):  # labeled pairs given as text: no real id
                    raise ValueError(f"--teacher {directory}: the training documents are given as text, without "
                                     "the ids of the index's corpus, so the index cannot lend their vectors; give "
                                     "the dual encoder's directory (or --teacher embedded) instead")
                if doc is None:
                    raise ValueError(f"--teacher {directory}: document {doc_id!r} of the training corpus is not in "
                                     "the index; index it, or give the dual encoder's directory instead")
                if document_text(doc) != corpus[doc_id]:
                    raise ValueError(f"--teacher {directory}: document {doc_id!r} differs from the index's copy; "
                                     "rebuild the index from the training corpus, or give the dual encoder's "
                                     "directory instead")
            vectors = np.asarray(pipe.store.vectors.reconstruct(ids), dtype=np.float32)  # (N, H)
            return cls.from_vectors(pipe.encoder, ids, vectors)
        finally:
            pipe.close()

    def _setup(self, dual, ids: list[str], vectors: np.ndarray) -> None:
        from twotower.indexing import VectorIndex

        self.dual = dual
        self.index = VectorIndex.build(ids, vectors, factory="Flat", metric="ip")

    def __call__(self, queries: Sequence[str], k: int) -> list[Ranked]:
        res = self.index.search(self.dual.encode_queries(list(queries)), k)  # (Q, H) -> Q rows of k
        # Rows are padded with "" ids when k exceeds the corpus; equal scores are ordered by doc id.
        return [sorted(((d, s) for d, s in zip(ids, row) if d), key=lambda x: (-x[1], x[0]))
                for ids, row in zip(res.ids, res.scores.tolist())]

    def score_docs(self, queries: Sequence[str], doc_ids: Sequence[Sequence[str]]) -> list[list[float]]:
        q = self.dual.encode_queries(list(queries))  # (Q, H)
        known = [[d for d in ids if d in self.index] for ids in doc_ids]
        return [(self.index.reconstruct(ids) @ q[i]).tolist() for i, ids in enumerate(known)]
