"""CrossEncoder: query and document read together by one BERT, one relevance logit per pair.

Because the query and the document attend to each other, nothing can be
precomputed: a cross-encoder costs one forward pass per (query, document) pair,
which is why it reranks a short list recalled by the dual encoder.

The model is the encoder's sequence-classification head
(`twotower.encoder.core.heads.BertForSequenceClassification`, HF's class of the
same name) with ``num_labels=1`` and the [CLS] pooler:
``logit = classifier(dropout(pooler(h_[CLS])))``.  Keeping HF's parameter names
(``bert.*``, ``classifier.weight``/``bias``) is what lets a directory we save be
scored by `transformers` and `sentence_transformers.CrossEncoder` unchanged, and
lets us load theirs (ms-marco MiniLM rerankers and the like).  This class adds
what a reranker needs around that head: pair tokenization, batched ``predict``
and the interpolation weight stored with the checkpoint.

``pooling="mean"`` puts the head on the mean of the token states instead (no pooler;
``classifier_pooling: "mean"`` in config.json, as ModernBERT writes it).  Why: in
all-MiniLM-L6-v2, a mean-pooling sentence encoder, the [CLS] state is nearly the same
vector for every input through layer 5 (its spread across 32 claim/abstract pairs is
0.3-4 % of its norm, against 31-37 % for the token mean;
``benchmarks/reranker_diagnosis.py --cls-spread``), so a [CLS] head on its first 3 layers
starts blind and a few hundred fp32 steps do not move it (docs/training.md).  transformers'
and sentence-transformers' BERT classes always read the [CLS] pooler, so a mean-pooled
reranker scores correctly only here; they would load it with a freshly drawn pooler
(and say so in a warning).

Long documents (``windows``): a cross-encoder reads at most ``max_length`` tokens of query + document, and
a head-truncated abstract loses what its later sentences say (on SciFact 92 % of title + abstract pairs
with a claim pass 192 tokens, and a claim's evidence is often a result stated near the end).  With
``windows`` set (`RerankWindows`, in tokens of the document text), each document is read as overlapping
windows, the title (when the document is given as ``(title, text)``) in front of every one, and its score
is its best window's (MaxP, Dai & Callan 2019).  So that a long document does not cost a forward pass per
window, only the ``keep`` windows that BM25 (over that document's windows) ranks best for the query are
scored.  The setting is saved in config.json (``rerank_windows``), so a reranker trained on windows scores
on them.

Scores are raw logits.  sentence-transformers applies a sigmoid to
``num_labels=1`` models by default; the directories we write name
``torch.nn.Identity`` as the activation (config.json ``sentence_transformers``
key) so that their ``predict`` returns the same numbers as ours.  A sigmoid is
monotone, so rankings agree either way.

Example:
    >>> ce = CrossEncoder.from_pretrained("runs/reranker/best")        # doctest: +SKIP
    >>> ce.predict([("what is tea", "Tea is a drink."), ("what is tea", "Cars.")])  # doctest: +SKIP
    array([ 4.1, -3.2], dtype=float32)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from twotower.common.device import resolve_bf16
from twotower.common.distributed import launched_as
from twotower.common.errors import refuse_keywords
from twotower.common.malloc import steady_thresholds_for, trim_free_heap_for
from twotower.encoder.core.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_vocab_fits,
    load_into,
    read_weights,
    save_pretrained,
    split_prefix,
)
from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.encode import default_batch_tokens, length_batches
from twotower.encoder.core.heads import BertForSequenceClassification
from twotower.encoder.core.model import BertModel
from twotower.encoder.core.tokenizer import Batch, Tokenizer
from twotower.indexing.search_result import is_count
from twotower.retrieval.dual_encoder import ST_KEYWORDS
from twotower.retrieval.interpolation import read_alpha, read_first_stage_alphas, write_alpha
from twotower.retrieval.passages import passage_spans

logger = logging.getLogger(__name__)

ARCHITECTURE = "BertForSequenceClassification"
# Written into config.json so sentence-transformers returns raw logits, as we do.
ST_IDENTITY = "torch.nn.modules.linear.Identity"
# What the relevance head reads: the [CLS] pooler (HF / sentence-transformers layout) or the token mean.
POOLINGS = ("cls", "mean")
MIN_PAIR_TOKENS = 8  # [CLS] q [SEP] d [SEP] and a few tokens of each: less reads nothing worth scoring
# Pairs tokenized at once before being cut into length-sorted batches (bounds padding memory).
_CHUNK = 2048
# config.json key of the window setting ({"window": W, "stride": S}); absent = head truncation.
WINDOWS_KEY = "rerank_windows"
# What a document is to a reranker: its text, or (title, text) so that windows can each carry the title.
PairDocument = str | tuple[str, str]
# How a training step picks the window of a document it trains on (`CrossEncoder.best_windows`).
WINDOW_CHOICES = ("model", "bm25")


@dataclass(frozen=True)
class RerankWindows:
    """How a reranker reads long documents (module docstring): windows of `window` text tokens every `stride`,
    at most `keep` of them scored per (query, document) (None: all)."""

    window: int
    stride: int
    keep: int | None = None

    def to_json(self) -> dict[str, int]:
        return {"window": self.window, "stride": self.stride, **({"keep": self.keep} if self.keep else {})}


def document_string(doc: PairDocument) -> str:
    """One string for a document: the text, or "title text" (`twotower.indexing.document_text`'s join)."""
    if isinstance(doc, tuple):
        title, text = doc
        return f"{title} {text}" if title else text
    return doc


def check_two_segments(config, source: str) -> None:
    """Refuse a model with one segment embedding, naming `source` (``--model DIR``): a pair's document tokens
    have segment id 1, which was an IndexError traceback inside the embeddings at the first pair."""
    if config.type_vocab_size < 2:
        raise ValueError(f"{source} has one segment embedding (type_vocab_size 1); a reranker reads query and "
                         "document as two segments: give a model with type_vocab_size 2")


class CrossEncoder(nn.Module):
    """A BERT pair scorer: ``forward`` gives one logit per [CLS] query [SEP] doc [SEP] input.

    Args:
        model: the scoring network, a [CLS]-pooled sequence-classification head with one label.
        tokenizer: the tokenizer the encoder was trained with.
        max_length: tokens per pair (query + document); None = the tokenizer's maximum, capped by the model's.
        device: where to run: "cpu" (the default; None too) or a GPU ("cuda", "cuda:1"), as for `DualEncoder` and
            `SearchPipeline`: inference stays on the CPU unless a device is named (training configs pick a GPU
            when there is one).
        bf16: "auto" (where the device has native bf16), True (refused here on a device without it) or False.
        windows: score a document by its best window of this many text tokens (module docstring); None =
            read the head of each document up to `max_length`.
    """

    def __init__(
        self,
        model: BertForSequenceClassification,
        tokenizer: Tokenizer,
        max_length: int | None = None,
        device: torch.device | str | None = "cpu",
        bf16: bool | str = "auto",
        windows: RerankWindows | None = None,
    ) -> None:
        super().__init__()
        check_two_segments(model.config, "the model")
        if model.num_labels != 1 or model.pooling not in POOLINGS:
            raise ValueError(f"a reranker scores with one logit pooled from {' or '.join(POOLINGS)}, got "
                             f"num_labels={model.num_labels} and pooling={model.pooling!r}")
        self.model = model
        self.tokenizer = tokenizer
        # The dev-chosen weight of this reranker's scores against the first stage's (retrieval.interpolation);
        # None = pure reranking. Loaded from / saved to ALPHA_FILE next to the weights.
        self.interpolation: float | None = None
        # Weights chosen over particular first stages ({"dense": .., "hybrid": ..}); they win over
        # `interpolation` when a search names its first stage (`SearchPipeline.rerank_alpha`).
        self.interpolation_by_first_stage: dict[str, float] = {}
        cap = model.config.max_position_embeddings
        if max_length is None:
            max_length = tokenizer.model_max_length or cap
        self.max_length = min(int(max_length), cap)  # 0 was read as "not given"
        if self.max_length < MIN_PAIR_TOKENS:
            raise ValueError(f"max_length={self.max_length} is too short for a query-document pair: give "
                             f"{MIN_PAIR_TOKENS} or more")
        self.windows = check_windows(windows, self.max_length)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.bf16 = resolve_bf16(bf16, self.device)
        self.to(self.device)
        self.eval()

    @property
    def bert(self) -> BertModel:
        return self.model.bert

    @property
    def classifier(self) -> nn.Linear:
        return self.model.classifier

    @property
    def config(self) -> EncoderConfig:
        return self.model.config

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        directory: str,
        device: torch.device | str | None = "cpu",
        max_length: int | None = None,
        bf16: bool | str = "auto",
    ) -> CrossEncoder:
        """Load an HF `BertForSequenceClassification` (num_labels=1) or sentence-transformers CrossEncoder dir.

        A bare encoder directory (no ``classifier.*`` tensors) is refused with a
        pointer to `from_encoder`, because silently adding a random head would
        produce a reranker that ranks at random.  ``"default"`` is the reranker twotower ships, as
        ``--reranker default`` on the command line (``"./default"`` names a directory called so).
        """
        from twotower.retrieval import default_reranker

        if directory == default_reranker.NAME:
            return default_reranker.load(device=device, bf16=bf16, max_length=max_length)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"cross-encoder directory not found: {directory} (\"default\" is the "
                                    "reranker twotower ships)")
        EncoderConfig.load(os.path.join(directory, CONFIG_NAME))  # a bad config.json is named before the weights load
        return cls.from_state(directory, read_weights(directory), device=device, max_length=max_length, bf16=bf16)

    @classmethod
    def from_state(
        cls,
        directory: str,
        weights: dict[str, torch.Tensor],
        tokenizer_dir: str | None = None,
        device: torch.device | str | None = "cpu",
        max_length: int | None = None,
        bf16: bool | str = "auto",
    ) -> CrossEncoder:
        """A reranker from `weights` (``bert.*`` + ``classifier.*``) with `directory`'s config and interpolation
        weight and the tokenizer of `tokenizer_dir` (default `directory`): `from_pretrained` without reading the
        weights file, for weights assembled in memory (`twotower.retrieval.default_reranker`)."""
        config = EncoderConfig.load(os.path.join(directory, CONFIG_NAME))
        windows = _windows_of(config, directory)
        enc_state, rest = split_prefix(weights)
        if "classifier.weight" not in rest or "classifier.bias" not in rest:
            raise ValueError(
                f"{os.path.join(directory, WEIGHTS_NAME)} has no classifier.weight/classifier.bias: it is not a "
                "sequence-classification checkpoint. Use CrossEncoder.from_encoder(dir) for a fresh head."
            )
        num_labels = int(rest["classifier.weight"].shape[0])
        if num_labels != 1 or _num_labels(config) not in (None, 1):
            raise ValueError(
                f"{directory}: num_labels={max(num_labels, _num_labels(config) or 0)}; a reranker needs a single "
                "relevance logit (num_labels=1)"
            )
        tokenizer = _load_tokenizer(tokenizer_dir or directory)
        check_vocab_fits(directory, tokenizer, config)
        model = BertForSequenceClassification(config, num_labels=1)  # pooling: config's classifier_pooling
        has_pooler = model.pooling == "mean" or _has_pooler(enc_state)
        if not has_pooler and launched_as().is_main:  # every torchrun rank loads the same model: said once
            logger.warning("%s: no pooler weights; the pooler is freshly initialised", directory)
        state = {f"bert.{k}": v for k, v in enc_state.items()}
        state.update({k: rest[k] for k in ("classifier.weight", "classifier.bias")})
        load_into(model, state, source=os.path.join(directory, WEIGHTS_NAME),
                  allow_missing=() if has_pooler else ("bert.pooler.",))
        if max_length is None:
            max_length = _st_max_length(directory)
        ce = cls(model, tokenizer, max_length=max_length, device=device, bf16=bf16)
        if windows is not None and windows.window > ce.max_length - 3:  # the saved setting, not a flag the user gave
            raise ValueError(f"{os.path.join(directory, CONFIG_NAME)}: this reranker reads documents as windows of "
                             f"{windows.window} tokens ({WINDOWS_KEY}), which needs a max_length (--max-length) of at "
                             f"least {windows.window + 3}; got {ce.max_length}")
        ce.windows = check_windows(windows, ce.max_length)
        ce.interpolation = read_alpha(directory)
        ce.interpolation_by_first_stage = read_first_stage_alphas(directory)
        return ce

    @classmethod
    def from_encoder(
        cls,
        directory: str,
        device: torch.device | str | None = "cpu",
        max_length: int | None = None,
        bf16: bool | str = "auto",
        seed: int | None = 0,
        pooling: str = "cls",
    ) -> CrossEncoder:
        """A fresh (untrained) relevance head on any BERT-family encoder checkpoint, ready for training.

        pooling: "cls" (the [CLS] pooler: loads in transformers and sentence-transformers) or "mean"
            (the token mean: learns much sooner from a mean-pooling sentence encoder; module docstring).
        seed: the head (and a pooler the checkpoint lacks) is drawn from torch's CPU generator seeded with it,
            inside `torch.random.fork_rng`, so the caller's random stream is as it was (this reseeded it with
            `seed` and advanced it); the draws are the very ones it made, so a seed gives the head it always
            gave (the shipped reranker is rebuilt from seed 0).  None: drawn from the caller's global stream,
            advancing it, as building any torch module does (`train_reranker.load_reranker` asks for that).
        """
        if pooling not in POOLINGS:
            raise ValueError(f"pooling={pooling!r}; choose one of {POOLINGS}")
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"encoder directory not found: {directory}")
        config = EncoderConfig.load(os.path.join(directory, CONFIG_NAME))
        tokenizer = _load_tokenizer(directory)
        check_vocab_fits(directory, tokenizer, config)
        enc_state, _ = split_prefix(read_weights(directory))
        # Task metadata of the source checkpoint (its labels, its head's pooling) does not describe the new head.
        for key in ("num_labels", "id2label", "label2id", "problem_type", "sentence_transformers",
                    "classifier_pooling", WINDOWS_KEY):
            config.extra.pop(key, None)
        if pooling == "mean":
            config.extra["classifier_pooling"] = "mean"  # saved with the checkpoint, read back by from_pretrained
            enc_state = {k: v for k, v in enc_state.items() if not k.startswith("pooler.")}  # no pooler to fill
        with contextlib.ExitStack() as draws:
            if seed is not None:  # the CPU generator alone: the model is built on the CPU, CUDA's are not touched
                draws.enter_context(torch.random.fork_rng(devices=[]))
                torch.default_generator.manual_seed(seed)
            model = BertForSequenceClassification(config, num_labels=1, pooling=pooling)
        load_into(model.bert, enc_state, source=os.path.join(directory, WEIGHTS_NAME),
                  allow_missing=() if pooling == "mean" or _has_pooler(enc_state) else ("pooler.",))
        if max_length is None:
            max_length = _st_max_length(directory)
        return cls(model, tokenizer, max_length=max_length, device=device, bf16=bf16)

    # ---- model -------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids/attention_mask/token_type_ids: (B, T) -> logits (B,)."""
        return self.model(input_ids, attention_mask, token_type_ids).squeeze(-1)  # (B, 1) -> (B,)

    def encode_pairs(self, queries: Sequence[str], docs: Sequence[str]) -> Batch:
        """Tokenize pairs as [CLS] q [SEP] d [SEP], truncating only the document (queries are pre-clipped)."""
        queries = self._clip_queries(queries)
        return self.tokenizer.encode(list(queries), pairs=list(docs), max_length=self.max_length,
                                     truncation="only_second")

    def _clip_queries(self, queries: Sequence[str]) -> list[str]:
        """Cut queries longer than half the budget, so `only_second` truncation always has room for the doc.

        (HF tokenizers raise when only_second cannot fit; a query that long would
        leave no document to judge anyway.)
        """
        limit = self.max_length // 2
        out = list(queries)
        unique = list(dict.fromkeys(out))
        lengths = self.tokenizer.lengths(unique, max_length=10**9)  # with [CLS] [SEP]
        long = {q for q, n in zip(unique, lengths) if n - 2 > limit}
        if not long:
            return out
        clipped = {}
        for q in long:
            enc = self.tokenizer._tok.encode(q, add_special_tokens=False)
            clipped[q] = q[: enc.offsets[limit - 1][1]]
        logger.info("clipped %d queries longer than %d tokens", len(long), limit)
        return [clipped.get(q, q) for q in out]

    # ---- inference ---------------------------------------------------------------------------------
    def document_windows(self, docs: Sequence[PairDocument]) -> list[list[str]]:
        """The texts each document is read as: one (its whole string) without `windows`, else all its windows,
        each prefixed with the title of a ``(title, text)`` document. A text that fits one window is one."""
        if self.windows is None:
            return [[document_string(d)] for d in docs]
        parts = [d if isinstance(d, tuple) else ("", d) for d in docs]
        unique = list(dict.fromkeys(text for _, text in parts))  # a document repeats across queries
        spans = dict(zip(unique, (passage_spans(offsets, words, text, self.windows.window, self.windows.stride)
                                  for text, (offsets, words) in zip(unique, self.tokenizer.token_spans(unique)))))
        return [[f"{title} {text[a:b]}" if title else text[a:b] for a, b in spans[text]] for title, text in parts]

    def pair_windows(self, pairs: Sequence[tuple[str, PairDocument]]) -> list[list[str]]:
        """The windows each pair is scored on: its document's (`document_windows`), cut to the `keep` that BM25
        over that document's windows ranks best for the query (ties: the earlier window)."""
        windows = self.document_windows([d for _, d in pairs])
        keep = self.windows.keep if self.windows is not None else None
        if not keep:
            return windows
        return [[w[i] for i in sorted(_bm25_order(query, w)[:keep])] if len(w) > keep else w
                for (query, _), w in zip(pairs, windows)]

    @torch.inference_mode()
    def predict(
        self, pairs: Sequence[tuple[str, PairDocument]] | tuple[str, PairDocument], batch_size: int | None = None,
        progress: bool = False, **st_keywords: Any,
    ) -> np.ndarray | float:
        """Relevance logits for (query, document) pairs, in input order. Returns (N,) float32; for one pair given
        alone, ``("query", "document")``, its score as a float (as sentence-transformers' ``predict`` does).

        A document is a string, or ``(title, text)``; with `windows` its score is its best window's
        (of those `pair_windows` keeps).
        Pairs are tokenized in chunks and batched by length (longest first), so a
        batch pads to similar lengths.  `batch_size`: pairs per forward pass; None (the default) -> as many as
        keep ``pairs x longest`` within 2,048 tokens on a CPU (65,536 on a GPU), as `encode_texts` batches.
        Why not a fixed 32: 32 pairs of 256 tokens make 50 MB fp32 activations, above glibc's largest mmap
        threshold (32 MiB), so every forward mapped them afresh and page-faulted them in (about 2,800 faults a
        pair, `benchmarks/rerank_throughput.py` on CPU-D); the budget keeps them below it and nearer the cache
        (docs/results.md, reranking throughput).  With bf16 (where the device supports it) the forward runs on
        a bf16 copy of the weights, made once and refreshed only when the weights change
        (`twotower.encoder.core.encode.inference_copy`): faster than autocast on CPUs.
        sentence-transformers' keywords (``show_progress_bar``, ...) are a TypeError saying the way here.
        """
        refuse_keywords("predict", st_keywords, "pairs, batch_size and progress", ST_KEYWORDS)
        if _is_one_pair(pairs):
            return float(self.predict([tuple(pairs)], batch_size=batch_size, progress=progress)[0])
        pairs = _check_pairs(pairs, "predict")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        per = self._window_scores(pairs, self.pair_windows(pairs), batch_size, progress)
        return np.array([s.max() for s in per], dtype=np.float32)  # (N,) the best window's (the head's without windows)

    def best_windows(self, pairs: Sequence[tuple[str, PairDocument]], batch_size: int | None = None,
                     by: str = "model") -> list[str]:
        """For each pair, the text of the document's best window (its string without `windows`).

        by="model": the window this model scores best, of those `pair_windows` keeps. Why: training on
        windows back-propagates through the window a document is scored by (the gradient of a max is its
        argmax's), so a training step first scores every window without gradients, then trains on the
        winners (`twotower.retrieval.training.train_reranker`).
        by="bm25": the window BM25 (over that document's windows) ranks first for the query, which is always
        among those `pair_windows` keeps; no forward pass. Why: scoring the windows is ~40 % of a training step
        on a CPU, and on SciFact dev the cheaper choice trained as well (docs/results.md).
        """
        if by not in WINDOW_CHOICES:
            raise ValueError(f"by={by!r}; choose one of {WINDOW_CHOICES}")
        pairs = _check_pairs(pairs, "best_windows")
        if by == "bm25":
            windows = self.document_windows([d for _, d in pairs])
            return [w[_bm25_order(q, w)[0]] if len(w) > 1 else w[0] for (q, _), w in zip(pairs, windows)]
        windows = self.pair_windows(pairs)
        per = self._window_scores(pairs, windows, batch_size, False, single_too=False)
        return [w[0] if s is None else w[int(np.argmax(s))] for w, s in zip(windows, per)]

    def _window_scores(self, pairs: Sequence[tuple[str, PairDocument]], windows: Sequence[Sequence[str]],
                       batch_size: int | None, progress: bool, single_too: bool = True) -> list[np.ndarray | None]:
        """Each pair's logits for its `windows`, scored in one batched pass over all of them: (n_windows,) per pair.

        single_too=False leaves out (None) the pairs with a single window, which need no forward to pick one.
        """
        take = [single_too or len(w) > 1 for w in windows]
        flat = [(q, t) for (q, _), w, on in zip(pairs, windows, take) if on for t in w]
        scores = self._score(flat, batch_size, progress) if flat else np.empty(0, dtype=np.float32)  # (W,)
        out: list[np.ndarray | None] = []
        start = 0
        for w, on in zip(windows, take):
            out.append(scores[start:start + len(w)] if on else None)
            start += len(w) if on else 0
        return out

    @torch.inference_mode()
    def _score(self, pairs: Sequence[tuple[str, str]], batch_size: int | None, progress: bool) -> np.ndarray:
        """One logit per (query, text) pair: the batched forward of `predict`. (N,) float32."""
        was_training = self.training
        self.eval()
        steady_thresholds_for(self.device)  # a forward's freed activations stay in the heap (common/malloc.py)
        net = self.model
        if self.bf16:
            from twotower.encoder.core.encode import inference_copy

            net = inference_copy(self.model, torch.bfloat16, self.device)
            # The head runs in fp32 even in the bf16 copy (the head casts its input to its own dtype):
            # bf16's 8-bit mantissa would quantise logits (steps of ~0.02 at 5.0) and tie close candidates.
            net.classifier.float()  # idempotent on the cached copy
        scores = np.empty(len(pairs), dtype=np.float32)
        budget = None if batch_size is not None else default_batch_tokens(self.device)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(pairs), desc="rerank", unit="pair")
        try:
            for start in range(0, len(pairs), _CHUNK):
                chunk = pairs[start:start + _CHUNK]
                enc = self.encode_pairs([q for q, _ in chunk], [d for _, d in chunk])
                lengths = enc.attention_mask.sum(dim=1)  # (N,)
                for batch in length_batches(lengths.numpy(), batch_size, budget):  # longest first
                    idx = torch.from_numpy(batch)
                    T = int(lengths[idx].max())
                    inputs = {k: v[idx, :T].to(self.device) for k, v in enc.model_inputs().items()}  # (b, T)
                    logits = net(**inputs).squeeze(-1)  # (b, 1) -> (b,)
                    scores[start + idx.numpy()] = logits.float().cpu().numpy()
                    if bar is not None:
                        bar.update(len(idx))
        finally:
            if bar is not None:
                bar.close()
            self.train(was_training)
            trim_free_heap_for(self.device)  # free pages left in the heap's holes go back (common/malloc.py)
        return scores

    def rank(
        self, query: str, docs: Sequence[str], top_k: int | None = None, batch_size: int | None = None
    ) -> list[tuple[int, float]]:
        """(index into docs, score) sorted by score, best first; ties keep input order.

        top_k: keep the best top_k (None: all); 1 or more (-1 dropped the last document, a numpy slice, and 0
        returned nothing).
        """
        if isinstance(docs, str):
            raise TypeError("rank takes a list of documents")
        if top_k is not None and (not is_count(top_k) or top_k < 1):  # numpy's integers too, as for k
            raise ValueError(f"top_k must be None (all documents) or an int >= 1, got {top_k!r}")
        scores = self.predict([(query, d) for d in docs], batch_size=batch_size)
        order = np.argsort(-scores, kind="stable")
        if top_k is not None:
            order = order[:top_k]
        return [(int(i), float(scores[i])) for i in order]

    def __repr__(self) -> str:
        """One line, like `DualEncoder`'s (nn.Module's repr printed every layer of the network)."""
        windows = f", windows={self.windows}" if self.windows is not None else ""
        return (f"CrossEncoder(layers={self.config.num_hidden_layers}, hidden={self.config.hidden_size}, "
                f"pooling={self.model.pooling!r}, max_length={self.max_length}{windows}, device={str(self.device)!r}, "
                f"bf16={self.bf16}, interpolation={self.interpolation})")

    # ---- saving ------------------------------------------------------------------------------------
    def state_for_hf(self) -> dict[str, torch.Tensor]:
        """Parameters under HF `BertForSequenceClassification` names (those of the head module itself)."""
        return {k: v.detach().float().cpu() for k, v in self.model.state_dict().items()}

    def save_pretrained(self, directory: str) -> None:
        """Write an HF seq-classification directory (num_labels=1) that transformers and ST load as-is.

        Every file is written atomically; the tokenizer records `max_length` so
        that other libraries truncate where we do.

        A reranker with `windows` scores a long document by its best window here; transformers and
        sentence-transformers ignore ``rerank_windows`` (config.json) and read the head of the pair up to
        `max_length`, so they score such documents differently (short ones, which fit one window, alike). They
        also ignore the interpolation weight (rerank_interpolation.json), which only `SearchPipeline` applies.
        """
        tok = self.tokenizer
        saved_max = tok.model_max_length
        tok.model_max_length = self.max_length
        try:
            save_pretrained(
                directory, self.config, self.state_for_hf(), tok, architectures=[ARCHITECTURE],
                config_extra={
                    "id2label": {"0": "LABEL_0"},
                    "label2id": {"LABEL_0": 0},
                    "num_labels": 1,
                    "sentence_transformers": {"activation_fn": ST_IDENTITY},
                    **({WINDOWS_KEY: self.windows.to_json()} if self.windows is not None else {}),
                },
            )
        finally:
            tok.model_max_length = saved_max
        if self.interpolation is not None:
            write_alpha(directory, self.interpolation, self.interpolation_by_first_stage)


def check_windows(windows: RerankWindows | None, max_length: int) -> RerankWindows | None:
    """A window the reranker can read whole next to a query (errors name the training flags)."""
    if windows is None:
        return None
    if not isinstance(windows.window, int) or not 1 <= windows.window <= max_length - 3:
        raise ValueError(f"--passage-window (passage_window) must be between 1 and --max-length less 3 "
                         f"({max_length - 3}) tokens, got {windows.window!r}")
    if not isinstance(windows.stride, int) or not 1 <= windows.stride <= windows.window:
        raise ValueError(f"--passage-stride (passage_stride) must be between 1 and --passage-window "
                         f"({windows.window}), got {windows.stride!r}")
    if windows.keep is not None and (not isinstance(windows.keep, int) or windows.keep < 1):
        raise ValueError(f"--max-windows (max_windows) must be a positive number of windows, got {windows.keep!r}")
    return windows


def _windows_of(config: EncoderConfig, directory: str) -> RerankWindows | None:
    """The window setting a reranker directory's config.json records (popped: the head, not the encoder, owns it)."""
    block = config.extra.pop(WINDOWS_KEY, None)
    if block is None:
        return None
    try:
        keep = block.get("keep")
        return RerankWindows(int(block["window"]), int(block["stride"]), int(keep) if keep is not None else None)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{os.path.join(directory, CONFIG_NAME)}: {WINDOWS_KEY} must be "
                         f'{{"window": tokens, "stride": tokens[, "keep": windows]}}, got {block!r}') from exc


def _bm25_order(query: str, windows: Sequence[str]) -> list[int]:
    """Indices of a document's `windows`, best first by BM25 over those windows for `query` (ties: the earlier)."""
    from twotower.indexing.bm25 import BM25

    bm25 = BM25()
    ids = [str(i) for i in range(len(windows))]
    bm25.add(ids, list(windows))
    return [int(i) for i in np.argsort(-bm25.score(query, ids), kind="stable")]


def _is_one_pair(pairs: object) -> bool:
    """Whether `pairs` is one (query, document) pair, ``("q", "d")`` or ``["q", ("title", "text")]``, rather than
    a list of pairs: a list of pairs never starts with a string."""
    return isinstance(pairs, (tuple, list)) and len(pairs) == 2 and isinstance(pairs[0], str)


def _check_pairs(pairs: Sequence[tuple[str, PairDocument]], method: str) -> list[tuple[str, PairDocument]]:
    """(query, document) pairs, a document a string or (title, text); errors name the pair."""
    if _is_one_pair(pairs):
        raise TypeError(f"{method} takes a list of (query, document) pairs; wrap a single pair in a list")
    pairs = list(pairs)
    for i, p in enumerate(pairs):
        doc = p[1] if len(p) == 2 else None
        if len(p) != 2 or not isinstance(p[0], str) or not (
                isinstance(doc, str) or (isinstance(doc, tuple) and len(doc) == 2
                                         and all(isinstance(x, str) for x in doc))):
            raise TypeError(f"pair {i} is not a (query: str, document: str | (title, text)) tuple: {p!r}")
    return pairs


def _has_pooler(enc_state: dict[str, torch.Tensor]) -> bool:
    return any(k.startswith("pooler.") for k in enc_state)


def _num_labels(config: EncoderConfig) -> int | None:
    """Label count the config declares (id2label wins, as in transformers), or None when it declares none."""
    extra = config.extra
    if "id2label" in extra and isinstance(extra["id2label"], dict):
        return len(extra["id2label"])
    if "num_labels" in extra:
        return int(extra["num_labels"])
    return None


def _load_tokenizer(directory: str) -> Tokenizer:
    try:
        return Tokenizer.from_pretrained(directory)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"{directory}: model directory has no tokenizer (tokenizer.json or vocab.txt); "
            "save the tokenizer the model was trained with beside its weights"
        ) from exc


def _st_max_length(directory: str) -> int | None:
    """max_seq_length from sentence-transformers' sentence_bert_config.json, when present."""
    path = os.path.join(directory, "sentence_bert_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get("max_seq_length")
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    return int(value) if value else None
