"""Task heads on the BERT encoder: sequence classification, token classification, extractive QA.

Each is HF's class of the same name in miniature: the encoder sits under
``bert.`` and the head parameters carry HF's names (``classifier.*``,
``qa_outputs.*``), so a directory we save loads in
``transformers.BertFor*.from_pretrained`` and theirs load here (tested).
The fine-tuned task models (`twotower.encoder.finetuning.task_model`) and the
reranker (`twotower.retrieval.cross_encoder`, sequence classification with
one label) are all built on these classes.

Every head splits its forward into ``encode`` (the encoder, producing the
features the head reads) and ``head`` (dropout + linear).  That split is what
makes frozen-encoder training cheap: ``encode`` runs once per example, its
output is cached, and each epoch only runs ``head``.

Classification: z = W·pooled + b, where pooled = tanh(dense(h_[CLS])) is the
pooler output (docs/architecture.md, "Heads").  Example: logits [1, 3], true class 1 ->
p = 0.880797, cross-entropy = 0.126928.

``pooling="mean"`` reads the average of the real-token states instead (no
pooler), stored as ``classifier_pooling`` in config.json as ModernBERT does.
Why: an MLM-only checkpoint never trains [CLS] or the pooler -- [CLS] is never
a target -- while every token state is trained; a mean-pooled head starts from
what pretraining learned.  transformers' BertForSequenceClassification ignores
that key and would read such a checkpoint with its [CLS] pooler, so only the
default ``cls`` head round-trips through transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.model import BertModel
from twotower.encoder.core.pooling import mean_pool
from twotower.encoder.finetuning.tagging import IGNORE_INDEX

HEAD_TYPES = ("classify", "tag", "qa")
CLASSIFIER_POOLING = ("cls", "mean")
ARCHITECTURES = {
    "classify": "BertForSequenceClassification",
    "tag": "BertForTokenClassification",
    "qa": "BertForQuestionAnswering",
}


def _dropout_p(config: EncoderConfig, dropout: float | None) -> float:
    """HF: ``classifier_dropout`` when set, else the hidden dropout."""
    if dropout is not None:
        return dropout
    p = config.extra.get("classifier_dropout")
    return config.hidden_dropout_prob if p is None else float(p)


class _Head(nn.Module):
    """Shared plumbing: ``forward = head(encode(...))`` and BERT's init for the new linear layer."""

    head_type = ""
    # True when the encoder came without pooler weights (an MLM checkpoint): the pooler is then part of
    # the fresh head, re-drawn by reset_head(seed) like the classifier, so a seed fixes all of it.
    fresh_pooler = False

    def _init_linear(self, linear: nn.Linear, std: float, generator: torch.Generator | None = None) -> None:
        with torch.no_grad():
            if generator is None:
                linear.weight.normal_(0.0, std)
            else:
                # Drawn where the generator lives (the CPU) and copied: an op on a CUDA weight refuses a CPU
                # generator, and a seed then gives the same head on every device.
                w = linear.weight
                draw = torch.empty(w.shape, dtype=w.dtype, device=generator.device).normal_(0.0, std, generator=generator)
                w.copy_(draw)
            linear.bias.zero_()

    def encode(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def head(self, features: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.head(self.encode(input_ids, attention_mask, token_type_ids))

    def reset_head(self, seed: int) -> None:
        """Re-draw the head's weights from N(0, initializer_range) with a seeded generator."""
        raise NotImplementedError


class BertForSequenceClassification(_Head):
    """pooled [CLS] (or mean of tokens) -> dropout -> linear. ``forward`` returns logits (B, num_labels)."""

    head_type = "classify"

    def __init__(self, config: EncoderConfig, num_labels: int, dropout: float | None = None,
                 pooling: str | None = None) -> None:
        super().__init__()
        if num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {num_labels}")
        pooling = pooling or config.extra.get("classifier_pooling") or "cls"
        if pooling not in CLASSIFIER_POOLING:
            raise ValueError(f"classifier pooling must be one of {CLASSIFIER_POOLING}, got {pooling!r}")
        self.config, self.num_labels, self.pooling = config, num_labels, pooling
        self.bert = BertModel(config, add_pooling_layer=pooling == "cls")
        self.dropout = nn.Dropout(_dropout_p(config, dropout))
        self.classifier = nn.Linear(config.hidden_size, num_labels)
        self._init_linear(self.classifier, config.initializer_range)

    def encode(self, input_ids, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        if self.pooling == "cls":
            # Inference reads only the [CLS] state, so the last layer runs at that position alone (its keys
            # and values still see every token): the same logits for ~14 % fewer dense-layer FLOPs with 6
            # layers (the last keeps only its key and value projections for the other tokens). Training
            # keeps the whole last layer, so its dropout draws, and a seeded run, stay as they were.
            cls = None
            if not self.training and not torch.is_grad_enabled():
                cls = torch.zeros((input_ids.shape[0], 1), dtype=torch.long, device=input_ids.device)  # (B, 1)
            _, pooled = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                  query_positions=cls)
            return pooled  # (B, H)
        hidden, _ = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                              return_pooled=False)  # (B, T, H)
        if attention_mask is None:
            attention_mask = torch.ones(input_ids.shape, dtype=torch.long, device=input_ids.device)
        return mean_pool(hidden, attention_mask).to(hidden.dtype)  # (B, H)

    def head(self, features: torch.Tensor) -> torch.Tensor:
        # In the classifier's own dtype: a bf16 inference copy may keep its classifier in fp32 (the
        # cross-encoder does, so that close logits are not quantised to bf16 steps and tied).
        return self.classifier(self.dropout(features).to(self.classifier.weight.dtype))  # (B, H) -> (B, C)

    def reset_head(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self._init_linear(self.classifier, self.config.initializer_range, g)
        if self.fresh_pooler and self.bert.pooler is not None:
            self._init_linear(self.bert.pooler.dense, self.config.initializer_range, g)


class BertForTokenClassification(_Head):
    """per-token hidden state -> dropout -> linear. ``forward`` returns logits (B, T, num_labels)."""

    head_type = "tag"

    def __init__(self, config: EncoderConfig, num_labels: int, dropout: float | None = None) -> None:
        super().__init__()
        if num_labels < 1:
            raise ValueError(f"num_labels must be >= 1, got {num_labels}")
        self.config, self.num_labels = config, num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        self.dropout = nn.Dropout(_dropout_p(config, dropout))
        self.classifier = nn.Linear(config.hidden_size, num_labels)
        self._init_linear(self.classifier, config.initializer_range)

    def encode(self, input_ids, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        hidden, _ = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                              return_pooled=False)
        return hidden  # (B, T, H)

    def head(self, features: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(features))  # (B, T, H) -> (B, T, C)

    def reset_head(self, seed: int) -> None:
        self._init_linear(self.classifier, self.config.initializer_range, torch.Generator().manual_seed(seed))


class BertForQuestionAnswering(_Head):
    """per-token hidden state -> linear to (start, end). ``forward`` returns logits (B, T, 2).

    HF applies no dropout before ``qa_outputs``; neither do we.
    """

    head_type = "qa"

    def __init__(self, config: EncoderConfig, num_labels: int = 2, dropout: float | None = None) -> None:
        super().__init__()
        if num_labels != 2:
            raise ValueError(f"a QA head scores start and end: num_labels must be 2, got {num_labels}")
        self.config, self.num_labels = config, 2
        self.bert = BertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self._init_linear(self.qa_outputs, config.initializer_range)

    def encode(self, input_ids, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        hidden, _ = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                              return_pooled=False)
        return hidden  # (B, T, H)

    def head(self, features: torch.Tensor) -> torch.Tensor:
        return self.qa_outputs(features)  # (B, T, H) -> (B, T, 2): start, end

    def reset_head(self, seed: int) -> None:
        self._init_linear(self.qa_outputs, self.config.initializer_range, torch.Generator().manual_seed(seed))


HEAD_CLASSES: dict[str, type[_Head]] = {
    "classify": BertForSequenceClassification,
    "tag": BertForTokenClassification,
    "qa": BertForQuestionAnswering,
}


def build_head(head_type: str, config: EncoderConfig, num_labels: int, dropout: float | None = None,
               pooling: str | None = None) -> _Head:
    """A freshly initialised task model of ``head_type`` (one of HEAD_TYPES).

    ``pooling`` (classification only): "cls" or "mean"; None reads ``classifier_pooling`` from the config.
    """
    if head_type not in HEAD_CLASSES:
        raise ValueError(f"unknown head {head_type!r}; choose one of {HEAD_TYPES}")
    if head_type == "classify":
        return BertForSequenceClassification(config, num_labels, dropout, pooling)
    if pooling is not None:
        raise ValueError(f"pooling applies to the classification head only, not {head_type!r}")
    return HEAD_CLASSES[head_type](config, num_labels, dropout)


# ---- losses -------------------------------------------------------------------------------------------


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy. logits (B, C), labels (B,) class ids."""
    return F.cross_entropy(logits.float(), labels)


def tagging_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over labelled sub-tokens only (first sub-token of each word). logits (B, T, C), labels (B, T)."""
    if not bool((labels != IGNORE_INDEX).any()):
        raise ValueError("a tagging batch with no labelled token")
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def qa_loss(
    logits: torch.Tensor, start: torch.Tensor, end: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean of start and end cross-entropy over positions. logits (B, T, 2), start/end (B,) positions.

    Padding positions are excluded from the softmax (HF includes them, which
    makes the loss depend on how a batch was padded).
    """
    logits = logits.float()
    if attention_mask is not None:
        logits = logits.masked_fill(~attention_mask.bool()[..., None], -1e4)
    s, e = logits.unbind(-1)  # (B, T) each
    return (F.cross_entropy(s, start) + F.cross_entropy(e, end)) / 2
