"""CrossEncoder: query and document read together by one BERT, one relevance logit per pair.

Because the query and the document attend to each other, nothing can be
precomputed: a cross-encoder costs one forward pass per (query, document) pair,
which is why it reranks a short list recalled by the dual encoder.

The model is exactly HF `BertForSequenceClassification` with ``num_labels=1``:
``logit = classifier(dropout(pooler(h_[CLS])))``.  Keeping HF's parameter names
(``bert.*``, ``classifier.weight``/``bias``) is what lets a directory we save be
scored by `transformers` and `sentence_transformers.CrossEncoder` unchanged, and
lets us load theirs (ms-marco MiniLM rerankers and the like).

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

import json
import logging
import os
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from twotower.common.device import default_device, resolve_bf16
from twotower.encoder.core.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    load_into,
    read_weights,
    save_pretrained,
    split_prefix,
)
from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.model import BertModel, BertPooler
from twotower.encoder.core.tokenizer import Tokenizer
from twotower.retrieval.interpolation import read_alpha, write_alpha

logger = logging.getLogger(__name__)

ARCHITECTURE = "BertForSequenceClassification"
# Written into config.json so sentence-transformers returns raw logits, as we do.
ST_IDENTITY = "torch.nn.modules.linear.Identity"
# Pairs tokenized at once before being cut into length-sorted batches (bounds padding memory).
_CHUNK = 2048


class _Scorer(nn.Module):
    """bert + dropout + classifier, the part of a CrossEncoder that runs on tensors (copied to bf16 for inference)."""

    def __init__(self, bert: BertModel, dropout: nn.Dropout, classifier: nn.Linear) -> None:
        super().__init__()
        self.bert, self.dropout, self.classifier = bert, dropout, classifier

    def forward(self, input_ids, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        _, pooled = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)  # (B, H)
        # The head runs in its own dtype: fp32 even in the bf16 inference copy, because bf16's 8-bit
        # mantissa would quantise logits (steps of ~0.02 at 5.0) and tie close candidates.
        return self.classifier(self.dropout(pooled).to(self.classifier.weight.dtype)).squeeze(-1)  # (B,)


class CrossEncoder(nn.Module):
    """A BERT pair scorer: ``forward`` gives one logit per [CLS] query [SEP] doc [SEP] input."""

    def __init__(
        self,
        bert: BertModel,
        tokenizer: Tokenizer,
        max_length: int | None = None,
        device: torch.device | str | None = None,
        bf16: bool | str = "auto",
    ) -> None:
        super().__init__()
        config = bert.config
        if bert.pooler is None:
            # HF's classifier reads the pooled [CLS]; an encoder saved without a pooler gets a fresh one.
            bert.pooler = BertPooler(config)
            bert.pooler.apply(bert._init_weights)
        self.bert = bert
        dropout = config.extra.get("classifier_dropout")
        self.dropout = nn.Dropout(config.hidden_dropout_prob if dropout is None else float(dropout))
        self.classifier = nn.Linear(config.hidden_size, 1)
        nn.init.normal_(self.classifier.weight, std=config.initializer_range)
        nn.init.zeros_(self.classifier.bias)
        self.tokenizer = tokenizer
        # The dev-chosen weight of this reranker's scores against the first stage's (retrieval.interpolation);
        # None = pure reranking. Loaded from / saved to ALPHA_FILE next to the weights.
        self.interpolation: float | None = None
        # Not a registered submodule (it shares the parameters above); the key of the bf16 inference copy.
        object.__setattr__(self, "_scorer", _Scorer(self.bert, self.dropout, self.classifier))
        cap = config.max_position_embeddings
        self.max_length = min(int(max_length or tokenizer.model_max_length or cap), cap)
        if self.max_length < 8:
            raise ValueError(f"max_length={self.max_length} is too short for a query-document pair")
        self.device = torch.device(device) if device is not None else default_device()
        self.bf16 = resolve_bf16(bf16, self.device)
        self.to(self.device)
        self.eval()

    @property
    def config(self) -> EncoderConfig:
        return self.bert.config

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        directory: str,
        device: torch.device | str | None = None,
        max_length: int | None = None,
        bf16: bool | str = "auto",
    ) -> CrossEncoder:
        """Load an HF `BertForSequenceClassification` (num_labels=1) or sentence-transformers CrossEncoder dir.

        A bare encoder directory (no ``classifier.*`` tensors) is refused with a
        pointer to `from_encoder`, because silently adding a random head would
        produce a reranker that ranks at random.
        """
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"cross-encoder directory not found: {directory}")
        config = EncoderConfig.load(os.path.join(directory, CONFIG_NAME))
        enc_state, rest = split_prefix(read_weights(directory))
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
        tokenizer = _load_tokenizer(directory)
        bert = BertModel(config, add_pooling_layer=True)
        has_pooler = any(k.startswith("pooler.") for k in enc_state)
        if not has_pooler:
            logger.warning("%s: no pooler weights; the pooler is freshly initialised", directory)
        load_into(bert, enc_state, source=os.path.join(directory, WEIGHTS_NAME),
                  allow_missing=() if has_pooler else ("pooler.",))
        if max_length is None:
            max_length = _st_max_length(directory)
        model = cls(bert, tokenizer, max_length=max_length, device="cpu", bf16=False)
        head = {"weight": rest["classifier.weight"], "bias": rest["classifier.bias"]}
        load_into(model.classifier, head, source=os.path.join(directory, WEIGHTS_NAME))
        model.interpolation = read_alpha(directory)
        return model._place(device, bf16)

    @classmethod
    def from_encoder(
        cls,
        directory: str,
        device: torch.device | str | None = None,
        max_length: int | None = None,
        bf16: bool | str = "auto",
        seed: int | None = 0,
    ) -> CrossEncoder:
        """A fresh (untrained) relevance head on any BERT-family encoder checkpoint, ready for training."""
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"encoder directory not found: {directory}")
        config = EncoderConfig.load(os.path.join(directory, CONFIG_NAME))
        tokenizer = _load_tokenizer(directory)
        enc_state, _ = split_prefix(read_weights(directory))
        has_pooler = any(k.startswith("pooler.") for k in enc_state)
        if seed is not None:
            torch.manual_seed(seed)
        bert = BertModel(config, add_pooling_layer=True)
        load_into(bert, enc_state, source=os.path.join(directory, WEIGHTS_NAME),
                  allow_missing=() if has_pooler else ("pooler.",))
        # Task metadata of the source checkpoint (its labels) does not describe the new head.
        for key in ("num_labels", "id2label", "label2id", "problem_type", "sentence_transformers"):
            config.extra.pop(key, None)
        if max_length is None:
            max_length = _st_max_length(directory)
        return cls(bert, tokenizer, max_length=max_length, device="cpu", bf16=False)._place(device, bf16)

    def _place(self, device: torch.device | str | None, bf16: bool | str) -> CrossEncoder:
        self.device = torch.device(device) if device is not None else default_device()
        self.bf16 = resolve_bf16(bf16, self.device)
        return self.to(self.device).eval()

    # ---- model -------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids/attention_mask/token_type_ids: (B, T) -> logits (B,)."""
        return self._scorer(input_ids, attention_mask, token_type_ids)

    def encode_pairs(self, queries: Sequence[str], docs: Sequence[str]):
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
    @torch.inference_mode()
    def predict(
        self, pairs: Sequence[tuple[str, str]], batch_size: int = 32, progress: bool = False
    ) -> np.ndarray:
        """Relevance logits for (query, document) pairs, in input order. Returns (N,) float32.

        Pairs are tokenized in chunks and batched by length (longest first), so a
        batch pads to similar lengths.  With bf16 (where the device supports it) the
        forward runs on a bf16 copy of the weights, made once and refreshed only when
        the weights change (`twotower.encoder.core.encode.inference_copy`): faster than autocast on CPUs.
        """
        if isinstance(pairs, tuple) and len(pairs) == 2 and isinstance(pairs[0], str):
            raise TypeError("predict takes a list of (query, document) pairs; wrap a single pair in a list")
        pairs = list(pairs)
        for i, p in enumerate(pairs):
            if len(p) != 2 or not isinstance(p[0], str) or not isinstance(p[1], str):
                raise TypeError(f"pair {i} is not a (query: str, document: str) tuple: {p!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        was_training = self.training
        self.eval()
        net = self._scorer
        if self.bf16:
            from twotower.encoder.core.encode import inference_copy

            net = inference_copy(self._scorer, torch.bfloat16, self.device)
            net.classifier.float()  # idempotent on the cached copy; see _Scorer.forward
        scores = np.empty(len(pairs), dtype=np.float32)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(pairs), desc="rerank", unit="pair")
        try:
            for start in range(0, len(pairs), _CHUNK):
                chunk = pairs[start:start + _CHUNK]
                enc = self.encode_pairs([q for q, _ in chunk], [d for _, d in chunk])
                lengths = enc.attention_mask.sum(dim=1)  # (N,)
                order = torch.argsort(lengths, descending=True, stable=True)
                for b in range(0, len(chunk), batch_size):
                    idx = order[b:b + batch_size]
                    T = int(lengths[idx].max())
                    inputs = {k: v[idx, :T].to(self.device) for k, v in enc.model_inputs().items()}  # (b, T)
                    logits = net(**inputs)  # (b,)
                    scores[start + idx.numpy()] = logits.float().cpu().numpy()
                    if bar is not None:
                        bar.update(len(idx))
        finally:
            if bar is not None:
                bar.close()
            self.train(was_training)
        return scores

    def rank(
        self, query: str, docs: Sequence[str], top_k: int | None = None, batch_size: int = 32
    ) -> list[tuple[int, float]]:
        """(index into docs, score) sorted by score, best first; ties keep input order."""
        if isinstance(docs, str):
            raise TypeError("rank takes a list of documents")
        scores = self.predict([(query, d) for d in docs], batch_size=batch_size)
        order = np.argsort(-scores, kind="stable")
        if top_k is not None:
            order = order[:top_k]
        return [(int(i), float(scores[i])) for i in order]

    # ---- saving ------------------------------------------------------------------------------------
    def state_for_hf(self) -> dict[str, torch.Tensor]:
        """Parameters under HF `BertForSequenceClassification` names."""
        state = {f"bert.{k}": v for k, v in self.bert.state_dict().items()}
        state["classifier.weight"] = self.classifier.weight
        state["classifier.bias"] = self.classifier.bias
        return {k: v.detach().float().cpu() for k, v in state.items()}

    def save_pretrained(self, directory: str) -> None:
        """Write an HF seq-classification directory (num_labels=1) that transformers and ST load as-is.

        Every file is written atomically; the tokenizer records `max_length` so
        that other libraries truncate where we do.
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
                },
            )
        finally:
            tok.model_max_length = saved_max
        if self.interpolation is not None:
            write_alpha(directory, self.interpolation)


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
