"""What differs between classification, tagging and QA, behind one small interface.

The fine-tuning loop and the predictor are written once; each task supplies
how examples become model inputs (``featurize``), how targets are batched and
scored by the loss, how model outputs become predictions (``decode``) and the
dev metric that picks the best epoch (``score``).

Inputs are kept as unpadded lists and padded per batch to the batch's longest
item (docs/architecture.md, "Input format"), so sorting by length (done by the loop) removes most padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from twotower.encoder.core.heads import classification_loss, qa_loss, tagging_loss
from twotower.encoder.core.tokenizer import Tokenizer
from twotower.encoder.finetuning.qa_decode import QAPrediction, decode_predictions, make_windows, span_scores
from twotower.encoder.finetuning.tagging import (
    IGNORE_INDEX,
    bio_entities,
    entity_scores,
    first_subtokens,
    join_words,
    subtoken_labels,
)
from twotower.encoder.finetuning.task_examples import (
    QAExample,
    TagExample,
    TextExample,
    check_qa_examples,
    check_tag_examples,
    check_text_examples,
)


@dataclass
class TaskInfo:
    """Everything besides weights and tokenizer that a checkpoint needs to predict again.

    Stored in config.json (``id2label``/``label2id`` HF-style, the rest under
    ``twotower_task``); ``max_length`` is also written as the tokenizer's
    ``model_max_length`` so HF pipelines truncate the same way.
    """

    head: str
    labels: list[str] = field(default_factory=list)
    max_length: int = 128
    doc_stride: int = 128  # QA: overlap between windows, in tokens
    max_query_length: int = 64  # QA
    max_answer_length: int = 30  # QA, in tokens
    null_threshold: float | None = None  # QA: "no answer" when null - span score exceeds it; None = never
    pairs: bool = False  # classify: trained on text pairs (so a lone text at prediction is out of its depth)

    def to_dict(self) -> dict[str, Any]:
        d = {"head": self.head, "max_length": self.max_length}
        if self.head == "classify" and self.pairs:
            d["pairs"] = True
        if self.head == "qa":
            d.update(doc_stride=self.doc_stride, max_query_length=self.max_query_length,
                     max_answer_length=self.max_answer_length, null_threshold=self.null_threshold)
        return d


@dataclass
class Featurized:
    """Model inputs of a list of examples: one item per model row (a QA example may give several)."""

    input_ids: list[list[int]]
    token_type_ids: list[list[int]]
    targets: list[Any]  # classify: int; tag: list[int] per position; qa: (start, end)
    aux: Any = None  # tag: first sub-token per word, per row; qa: the QAWindow list

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> np.ndarray:
        return np.fromiter((len(x) for x in self.input_ids), dtype=np.int64, count=len(self.input_ids))


def pad(rows: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    """Pad lists of ints to the longest. -> (B, T) long"""
    T = max(len(r) for r in rows)
    out = torch.full((len(rows), T), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out


def _rows(batch, n: int) -> tuple[list[list[int]], list[list[int]]]:
    lengths = batch.attention_mask.sum(1).tolist()
    ids = [batch.input_ids[i, :lengths[i]].tolist() for i in range(n)]
    types = [batch.token_type_ids[i, :lengths[i]].tolist() for i in range(n)]
    return ids, types


class Task:
    """Interface; see the module docstring."""

    head = ""
    main_metric = ""

    def check(self, examples: Sequence, labels: Sequence[str] | None, need_targets: bool) -> None:
        raise NotImplementedError

    def labels_of(self, examples: Sequence) -> list[str]:
        """Labels present in training examples (the label map is built from them)."""
        return []

    def featurize(self, tokenizer: Tokenizer, examples: Sequence, info: TaskInfo, with_targets: bool) -> Featurized:
        raise NotImplementedError

    def batch_targets(self, feats: Featurized, idx: Sequence[int]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, examples: Sequence, feats: Featurized, outputs: list[np.ndarray], info: TaskInfo) -> list:
        """``outputs[k]`` is row k's logits, unpadded: (C,), (T_k, C) or (T_k, 2)."""
        raise NotImplementedError

    def score(self, preds: Sequence, examples: Sequence) -> dict[str, float]:
        raise NotImplementedError


# ---- classification -----------------------------------------------------------------------------------


@dataclass
class ClassPrediction:
    label: str
    score: float  # probability of `label`
    probs: dict[str, float]


class ClassifyTask(Task):
    head, main_metric = "classify", "accuracy"

    def check(self, examples, labels, need_targets):
        check_text_examples(examples, labels, need_targets)

    def labels_of(self, examples):
        return [ex.label for ex in examples if ex.label is not None]

    def featurize(self, tokenizer, examples: Sequence[TextExample], info, with_targets):
        if not examples:
            return Featurized([], [], [])
        index = {label: i for i, label in enumerate(info.labels)}
        pairs = [ex.pair or "" for ex in examples] if any(ex.pair is not None for ex in examples) else None
        ids, types = [], []
        for a in range(0, len(examples), 4096):  # bounded padding memory
            chunk = examples[a:a + 4096]
            batch = tokenizer.encode([ex.text for ex in chunk], pairs[a:a + 4096] if pairs else None,
                                     max_length=info.max_length)
            i, t = _rows(batch, len(chunk))
            ids += i
            types += t
        targets = [index[ex.label] if with_targets else -1 for ex in examples]
        return Featurized(ids, types, targets)

    def batch_targets(self, feats, idx):
        return {"labels": torch.tensor([feats.targets[i] for i in idx], dtype=torch.long)}

    def loss(self, logits, batch):
        return classification_loss(logits, batch["labels"])

    def decode(self, examples, feats, outputs, info):
        preds = []
        for out in outputs:
            p = torch.softmax(torch.as_tensor(out, dtype=torch.float32), -1).numpy()
            k = int(p.argmax())
            preds.append(ClassPrediction(info.labels[k], float(p[k]), dict(zip(info.labels, map(float, p)))))
        return preds

    def score(self, preds, examples):
        n = max(1, len(examples))
        return {"accuracy": sum(p.label == ex.label for p, ex in zip(preds, examples)) / n}


# ---- token tagging ------------------------------------------------------------------------------------


@dataclass
class TagPrediction:
    tags: list[str]  # one per input word
    entities: list[tuple[str, int, int, str]]  # (type, first word, end word exclusive, text)
    cut: int = 0  # words after the last one the model saw (the input was longer than max_length): tagged "O"


class TagTask(Task):
    head, main_metric = "tag", "f1"

    def check(self, examples, labels, need_targets):
        check_tag_examples(examples, labels, need_targets)

    def labels_of(self, examples):
        return [t for ex in examples for t in (ex.tags or [])]

    def featurize(self, tokenizer, examples: Sequence[TagExample], info, with_targets):
        index = {label: i for i, label in enumerate(info.labels)}
        ids, types, targets, firsts = [], [], [], []
        for a in range(0, len(examples), 4096):
            chunk = examples[a:a + 4096]
            joined = [join_words(ex.words) for ex in chunk]
            batch = tokenizer.encode([text for text, _ in joined], max_length=info.max_length)
            i, t = _rows(batch, len(chunk))
            ids += i
            types += t
            for k, (ex, (_, starts)) in enumerate(zip(chunk, joined)):
                first = first_subtokens(starts, batch.offsets[k], batch.sequence_ids[k])
                firsts.append(first)
                y = [index[tag] for tag in ex.tags] if with_targets else [IGNORE_INDEX] * len(first)
                targets.append(subtoken_labels(first, y, len(i[k])))
        return Featurized(ids, types, targets, aux=firsts)

    def batch_targets(self, feats, idx):
        return {"labels": pad([feats.targets[i] for i in idx], IGNORE_INDEX)}

    def loss(self, logits, batch):
        return tagging_loss(logits, batch["labels"])

    def decode(self, examples, feats, outputs, info):
        preds = []
        for ex, first, out, ids in zip(examples, feats.aux, outputs, feats.input_ids):
            best = np.asarray(out).argmax(-1)  # (T,)
            tags = [info.labels[int(best[t])] if t >= 0 else "O" for t in first]
            tags = _repair_bio(tags)
            ents = [(k, s, e, " ".join(ex.words[s:e])) for k, s, e in bio_entities(tags)]
            seen = [k for k, t in enumerate(first) if t >= 0]
            cut = (len(first) - 1 - seen[-1] if seen else len(first)) if len(ids) >= info.max_length else 0
            preds.append(TagPrediction(tags, ents, cut))
        return preds

    def score(self, preds, examples):
        s = entity_scores([ex.tags for ex in examples], [p.tags for p in preds])
        return {"precision": s["precision"], "recall": s["recall"], "f1": s["f1"]}


def _repair_bio(tags: list[str]) -> list[str]:
    """Map non-BIO labels (a label set may hold any strings) to "O" so decoding never fails on them."""
    return [t if t == "O" or t[:2] in ("B-", "I-") else "O" for t in tags]


# ---- extractive QA ------------------------------------------------------------------------------------


class QATask(Task):
    head, main_metric = "qa", "span_f1"

    def check(self, examples, labels, need_targets):
        check_qa_examples(examples)

    def featurize(self, tokenizer, examples: Sequence[QAExample], info, with_targets):
        windows = make_windows(tokenizer, examples, info.max_length, info.doc_stride, info.max_query_length,
                               with_targets=with_targets)
        return Featurized([w.input_ids for w in windows], [w.token_type_ids for w in windows],
                          [(w.start, w.end) for w in windows], aux=windows)

    def batch_targets(self, feats, idx):
        return {"start": torch.tensor([feats.targets[i][0] for i in idx], dtype=torch.long),
                "end": torch.tensor([feats.targets[i][1] for i in idx], dtype=torch.long)}

    def loss(self, logits, batch):
        return qa_loss(logits, batch["start"], batch["end"], batch["attention_mask"])

    def decode(self, examples, feats, outputs, info) -> list[QAPrediction]:
        return decode_predictions(examples, feats.aux, [o[:, 0] for o in outputs], [o[:, 1] for o in outputs],
                                  info.max_answer_length, info.null_threshold)

    def score(self, preds, examples):
        return span_scores(preds, examples)


TASKS: dict[str, Task] = {"classify": ClassifyTask(), "tag": TagTask(), "qa": QATask()}


def get_task(head: str) -> Task:
    if head not in TASKS:
        raise ValueError(f"unknown task {head!r}; choose one of {sorted(TASKS)}")
    return TASKS[head]
