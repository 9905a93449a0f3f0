"""Lexical BM25 search over the same documents, for hybrid retrieval.

Variant: Lucene BM25 (Lin et al. 2016, "Toward Reproducible Baselines"; bm25s
``method="lucene"``): idf = ln(1 + (N - df + 0.5) / (df + 0.5)) and
tf-part = tf / (tf + k1·(1 - b + b·|d|/avgdl)). Defaults k1=0.9, b=0.4 are the
Anserini/Pyserini BEIR defaults. Scoring and the sparse index are bm25s's
(Lù 2024, "BM25S: Orders of magnitude faster lexical search via eager sparse scoring").

Tokenizer (bm25s ``Tokenizer``): Unicode NFC, lowercase, split on the regex ``\\b\\w\\w+\\b`` (words of
two or more word characters), drop bm25s's English stopword list, then stem with the
Snowball English stemmer (PyStemmer). A document is indexed as ``title + " " + text``.
NFC because the same word typed in its decomposed form ("e" + U+0301) is otherwise split at
the accent, which the regex does not count as a word character, and matches nothing. A document
with no word left (only stopwords or punctuation) has length 0 in ``avgdl``.

Updates: bm25s indexes are static (idf and avgdl are global), so this class keeps every
live document's token ids and marks the index stale on ``add``/``delete``; the next
``search`` rebuilds the bm25s index from the stored tokens (no re-tokenising; about a
second per ~20k documents on one core). Batch your changes: each rebuild is O(corpus).

Persistence: ``save(path)`` writes one ``.npz`` (token ids, offsets, ids, vocabulary and
parameters; no pickles) atomically; ``load`` rebuilds the scorer lazily from it.
"""

from __future__ import annotations

import io
import json
import unicodedata
import weakref
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from twotower.common.atomic import atomic_write_bytes
from twotower.indexing.errors import IndexFormatError
from twotower.indexing.search_result import SearchResult, check_k, empty_result

if TYPE_CHECKING:  # bm25s pulls in scipy (~1 s): imported on first use, not with the package
    import bm25s


def _import_bm25s():
    """Import bm25s and undo its logger's hard-coded DEBUG level, so its per-call debug lines stay quiet.

    (bm25s sets ``logging.getLogger("bm25s").setLevel(DEBUG)`` at import; with any root handler
    configured, e.g. by our CLI, every search then printed "Building index from IDs".)
    """
    import logging

    import bm25s

    log = logging.getLogger("bm25s")
    if log.level == logging.DEBUG:
        log.setLevel(logging.NOTSET)  # inherit the application's level
    return bm25s

FORMAT_NAME = "twotower-bm25"
FORMAT_VERSION = 1


def document_text(doc: Mapping[str, Any]) -> str:
    """The text BM25 indexes for a document: title and body joined by a space."""
    title = doc.get("title") or ""
    text = doc.get("text") or ""
    return f"{title} {text}" if title else text


class BM25:
    """BM25 over string-id documents, with lazy rebuild on change.

    Args:
        k1, b: BM25 parameters (Anserini defaults).
        method: bm25s scoring variant (``"lucene"``, ``"robertson"``, ``"atire"``, ``"bm25l"``, ``"bm25+"``).
        stopwords: ``"en"`` (bm25s English list), ``None`` or a list of words.
        stemmer: Snowball language for PyStemmer (``"english"``) or ``None``.

    Example:
        >>> bm = BM25()
        >>> bm.add(["d1", "d2"], ["Cats are sleeping", "Dogs bark loudly"])
        >>> bm.search(["sleeping cat"], k=2).ids
        [['d1', '']]
    """

    @classmethod
    def params(cls, options: dict[str, Any]) -> dict[str, Any]:
        """Every parameter in force for `options` (the arguments given, as a manifest records them)."""
        import inspect

        return {**{n: p.default for n, p in inspect.signature(cls).parameters.items()}, **options}

    def __init__(
        self,
        k1: float = 0.9,
        b: float = 0.4,
        method: str = "lucene",
        stopwords: str | list[str] | None = "en",
        stemmer: str | None = "english",
        normalization: str | None = "NFC",
    ) -> None:
        if normalization not in ("NFC", None):
            raise ValueError(f"BM25: normalization must be 'NFC' or None, got {normalization!r}")
        self.k1 = float(k1)
        self.b = float(b)
        self.method = method
        self.stopwords = stopwords
        self.stemmer = stemmer
        self.normalization = normalization
        self._tokenizer = self._make_tokenizer()
        self._ids: list[str] = []  # document ids, aligned with _tokens
        self._tokens: list[np.ndarray | None] = []  # token ids per document; None once deleted
        self._pos: dict[str, int] = {}  # id -> position in _ids
        self._retriever: bm25s.BM25 | None = None  # built over _ids order; stale when None
        self._built_ids: list[str] = []
        self._mask_cache: tuple[Any, Any, np.ndarray] | None = None  # (allowed ref, retriever, mask)

    def _make_tokenizer(self) -> bm25s.tokenization.Tokenizer:
        import Stemmer

        bm25s = _import_bm25s()

        stem = Stemmer.Stemmer(self.stemmer) if self.stemmer else None
        return bm25s.tokenization.Tokenizer(lower=True, stopwords=self.stopwords or [], stemmer=stem)

    def _tokenize(self, texts: Sequence[str], update_vocab: bool) -> list[list[int]]:
        """Token ids of each text, after the index's Unicode normalization (documents and queries alike)."""
        if self.normalization:
            texts = [unicodedata.normalize(self.normalization, t) for t in texts]
        return self._tokenizer.tokenize(list(texts), update_vocab=update_vocab, return_as="ids", show_progress=False)

    @classmethod
    def from_documents(cls, docs: Iterable[Mapping[str, Any]], **kwargs: Any) -> BM25:
        """Index documents given as mappings with ``id`` (or ``_id``), ``title`` and ``text``."""
        bm = cls(**kwargs)
        docs = list(docs)
        bm.add([d.get("id", d.get("_id")) for d in docs], [document_text(d) for d in docs])
        return bm

    # ------------------------------------------------------------------ changes
    def __len__(self) -> int:
        return len(self._pos)

    def __contains__(self, doc_id: object) -> bool:
        return doc_id in self._pos

    def add(self, ids: Sequence[str], texts: Sequence[str]) -> None:
        """Tokenise and add documents (use ``document_text`` for title + text). Duplicate id → ValueError."""
        ids = list(ids)
        if len(ids) != len(texts):
            raise ValueError(f"BM25.add: got {len(ids)} ids but {len(texts)} texts")
        for j, i in enumerate(ids):
            if not isinstance(i, str) or not i:
                raise ValueError(f"BM25.add: ids must be non-empty strings; item {j} is {i!r}")
        seen: set[str] = set()
        dups = [i for i in ids if i in self._pos or i in seen or seen.add(i)]
        if dups:
            raise ValueError(f"BM25.add: id(s) already indexed or repeated, e.g. {dups[:5]}")
        for j, t in enumerate(texts):
            if not isinstance(t, str):
                raise ValueError(f"BM25.add: text for id {ids[j]!r} must be a string, got {type(t).__name__}")
        token_ids = self._tokenize(texts, update_vocab=True)
        for i, toks in zip(ids, token_ids):
            self._pos[i] = len(self._ids)
            self._ids.append(i)
            self._tokens.append(np.asarray(toks, dtype=np.int32))
        if ids:
            self._retriever = None

    def delete(self, ids: Iterable[str]) -> list[str]:
        """Remove documents; returns the ids that were not indexed."""
        missing = []
        for i in dict.fromkeys(ids):
            pos = self._pos.pop(i, None)
            if pos is None:
                missing.append(i)
            else:
                self._tokens[pos] = None
                self._retriever = None
        return missing

    def _compact(self) -> None:
        keep = [p for p, t in enumerate(self._tokens) if t is not None]
        if len(keep) != len(self._tokens):
            self._ids = [self._ids[p] for p in keep]
            self._tokens = [self._tokens[p] for p in keep]
            self._pos = {i: p for p, i in enumerate(self._ids)}

    def _ensure_built(self) -> bm25s.BM25:
        if self._retriever is None:
            bm25s = _import_bm25s()
            self._compact()
            retriever = bm25s.BM25(k1=self.k1, b=self.b, method=self.method)
            vocab = dict(self._tokenizer.get_vocab_dict())  # token -> id, ids 0..V-1
            # bm25s's tokenizer gives a document with no word the one token "": length 0, not 1, in avgdl
            empty = vocab.get("")
            corpus = [(t if empty is None else t[t != empty]).tolist() for t in self._tokens]
            retriever.index((corpus, vocab), create_empty_token=False, show_progress=False)
            self._retriever = retriever
            self._built_ids = list(self._ids)
        return self._retriever

    # ------------------------------------------------------------------ search
    def search(self, queries: Sequence[str], k: int = 10, *, allowed: Collection[str] | None = None) -> SearchResult:
        """Top-``k`` documents per query; only documents sharing a term score (> 0).

        Ties are broken by document id (descending), as trec_eval orders equal scores.
        Rows with fewer matches are padded with ``""`` / ``-inf``. ``allowed`` (ids) masks the
        scores of every other document before the top-k is taken, so a filtered search returns k
        hits whenever k allowed documents share a term with the query.
        """
        if isinstance(queries, str):
            raise ValueError("BM25.search: pass a list of query strings, not one string")
        k = check_k(k, "BM25.search: ")  # k=True was searched as 1, a float failed inside numpy
        if len(self) == 0 or len(queries) == 0:
            return empty_result(len(queries), k)
        retriever = self._ensure_built()
        doc_ids = np.array(self._built_ids, dtype=object)
        result = empty_result(len(queries), k)
        mask = None if allowed is None else self._allowed_mask(allowed)  # (N,) bool
        for qi, toks in enumerate(self._query_tokens(queries)):
            if not toks:
                continue
            scores = retriever.get_scores_from_ids(toks)  # (N,)
            if mask is not None:
                scores = np.where(mask, scores, 0.0)
            hits = np.flatnonzero(scores > 0)
            if len(hits) > k:  # partial select, then exact order below
                hits = hits[np.argpartition(-scores[hits], k - 1)[:k]]
                cut = scores[hits].min()  # keep every doc tied with the k-th for the id tie-break
                hits = np.flatnonzero(scores >= cut)
            order = sorted(hits.tolist(), key=lambda d: (scores[d], self._built_ids[d]), reverse=True)[:k]
            result.ids[qi][: len(order)] = doc_ids[order].tolist()
            result.scores[qi, : len(order)] = scores[order]
        return result

    def score(self, query: str, ids: Sequence[str]) -> np.ndarray:
        """BM25 scores (len(ids),) of the named documents for one query; 0 where no term is shared.

        Why: a teacher or a fusion needs the scores of given documents (a reranker's group), not a top-k.
        """
        if not isinstance(query, str):
            raise ValueError("BM25.score: pass one query string")
        retriever = self._ensure_built()
        missing = [i for i in ids if i not in self._pos]
        if missing:
            raise KeyError(f"BM25.score: document(s) not indexed, e.g. {missing[:5]}")
        toks = self._query_tokens([query])[0]
        if not toks:
            return np.zeros(len(ids), dtype=np.float32)
        scores = retriever.get_scores_from_ids(toks)  # (N,)
        return np.asarray(scores[[self._pos[i] for i in ids]], dtype=np.float32)

    def _query_tokens(self, queries: Sequence[str]) -> list[list[int]]:
        """Token ids of each query that the built index knows (unknown and empty tokens dropped)."""
        vocab_size = len(self._ensure_built().vocab_dict)
        empty_id = self._tokenizer.get_vocab_dict().get("")
        query_ids = self._tokenize(queries, update_vocab=False)
        return [[t for t in toks if t != empty_id and t < vocab_size] for toks in query_ids]

    def _allowed_mask(self, allowed: Collection[str]) -> np.ndarray:
        """Bool mask (N,) over the built documents; the last one is reused for the same allowed set."""
        cached = self._mask_cache
        if cached is not None and cached[0]() is allowed and cached[1] is self._retriever:
            return cached[2]
        mask = np.zeros(len(self._built_ids), dtype=bool)  # (N,)
        get = self._pos.get
        pos = np.fromiter((p for p in map(get, allowed) if p is not None), dtype=np.int64)
        mask[pos] = True
        try:
            self._mask_cache = (weakref.ref(allowed), self._retriever, mask)
        except TypeError:  # a list: not cacheable
            pass
        return mask

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> None:
        """Write everything needed to search again to one ``.npz`` file, atomically."""
        self._compact()
        lengths = np.array([len(t) for t in self._tokens], dtype=np.int64)
        tokens = np.concatenate(self._tokens) if self._tokens else np.zeros(0, dtype=np.int32)
        params = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "k1": self.k1,
            "b": self.b,
            "method": self.method,
            "stopwords": self.stopwords,
            "stemmer": self.stemmer,
            "normalization": self.normalization,
        }
        tok = self._tokenizer
        vocab = {
            "word_to_stem": tok.word_to_stem,
            "stem_to_sid": tok.stem_to_sid,
            "word_to_id": tok.word_to_id,
        }
        buf = io.BytesIO()
        np.savez(
            buf,
            params=_json_bytes(params),
            ids=_json_bytes(self._ids),
            vocab=_json_bytes(vocab),
            tokens=tokens.astype(np.int32),
            lengths=lengths,
        )
        atomic_write_bytes(path, buf.getvalue())

    @classmethod
    def load(cls, path: str | Path) -> BM25:
        """Read a file written by ``save`` (the scorer is rebuilt at the first search)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: BM25 file not found")
        try:
            with np.load(path, allow_pickle=False) as z:
                params = json.loads(z["params"].tobytes())
                ids = json.loads(z["ids"].tobytes())
                vocab = json.loads(z["vocab"].tobytes())
                tokens = z["tokens"]
                lengths = z["lengths"]
        except FileNotFoundError:  # removed since the check above (an index store's sweep): not damage
            raise FileNotFoundError(f"{path}: BM25 file not found") from None
        except (OSError, KeyError, ValueError) as e:
            raise IndexFormatError(path, f"not a readable BM25 file ({e})") from None
        if params.get("format") != FORMAT_NAME:
            raise IndexFormatError(path, f"format is not {FORMAT_NAME!r}")
        if not isinstance(params.get("format_version"), int) or params["format_version"] > FORMAT_VERSION:
            raise IndexFormatError(path, f"format_version {params.get('format_version')!r} is not supported")
        if len(ids) != len(lengths) or int(lengths.sum()) != len(tokens):
            raise IndexFormatError(path, "ids, lengths and tokens disagree")
        # a file written before normalization was recorded holds tokens of the text as given: search it so
        bm = cls(params["k1"], params["b"], params["method"], params["stopwords"], params["stemmer"],
                 params.get("normalization"))
        bm._tokenizer.word_to_stem = vocab["word_to_stem"]
        bm._tokenizer.stem_to_sid = vocab["stem_to_sid"]
        bm._tokenizer.word_to_id = vocab["word_to_id"]
        bm._ids = list(ids)
        bm._tokens = list(np.split(tokens, np.cumsum(lengths)[:-1])) if len(ids) else []
        bm._pos = {i: p for p, i in enumerate(bm._ids)}
        return bm

    def __repr__(self) -> str:
        return f"BM25(k1={self.k1}, b={self.b}, method={self.method!r}, docs={len(self)})"


def _json_bytes(obj: Any) -> np.ndarray:
    return np.frombuffer(json.dumps(obj, ensure_ascii=False).encode("utf-8"), dtype=np.uint8)
