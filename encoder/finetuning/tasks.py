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
    unk_for_tokenless,
)
from twotower.encoder.finetuning.task_examples import (
    QAExample,
    TagExample,
    TextExample,
    check_qa_examples,
    check_tag_examples,
    check_text_examples,
)
from twotower.encoder.finetuning.windows import max_context_owners, qa_window, tag_window, window_spans


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
    doc_stride: int | None = None  # QA, tag: overlap between windows, in tokens; None: derived (windows.py)
    max_query_length: int = 64  # QA
    max_answer_length: int = 30  # QA, in tokens
    null_threshold: float | None = None  # QA: "no answer" when null - span score exceeds it; None = never
    pairs: bool = False  # classify: trained on text pairs (so a lone text at prediction is out of its depth)

    def to_dict(self) -> dict[str, Any]:
        d = {"head": self.head, "max_length": self.max_length}
        if self.head == "classify" and self.pairs:
            d["pairs"] = True
        if self.head == "qa":  # the overlap as a number, derived if unset: what the checkpoint predicts with
            d.update(doc_stride=qa_window(self.max_length, self.doc_stride, self.max_query_length)[0],
                     max_query_length=self.max_query_length, max_answer_length=self.max_answer_length,
                     null_threshold=self.null_threshold)
        if self.head == "tag":
            d["doc_stride"] = tag_window(self.max_length, self.doc_stride)[0]
        return d


@dataclass
class Featurized:
    """Model inputs of a list of examples: one item per model row (a QA example may give several)."""

    input_ids: list[list[int]]
    token_type_ids: list[list[int]]
    targets: list[Any]  # classify: int; tag: list[int] per position; qa: (start, end)
    aux: Any = None  # tag: a TagRows per example; qa: the QAWindow list
    truncated: int = 0  # classify: inputs cut at max_length (reported: `Task.notes`)
    tokenless: list[str] = field(default_factory=list)  # tag: "source: word k 'w'" of words given [UNK]

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

    def notes(self, feats: Featurized, info: TaskInfo) -> list[str]:
        """What a user should hear about how inputs were read (cut at max_length, read in windows, words
        with no token): one sentence each, printed by `finetune` (per split) and `predict`."""
        return []


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
        n = len(examples)
        ids: list[list[int]] = [[] for _ in range(n)]
        types: list[list[int]] = [[] for _ in range(n)]
        truncated = 0
        # Lone texts and pairs are encoded apart: each example is `[CLS] a [SEP]` or `[CLS] a [SEP] b [SEP]`
        # whatever the others are. Encoded together, a lone text beside a pair became `[CLS] a [SEP] [SEP]`,
        # so its prediction depended on the rest of the file.
        for paired in (False, True):
            group = [i for i, ex in enumerate(examples) if (ex.pair is not None) == paired]
            for a in range(0, len(group), 4096):  # bounded padding memory
                part = group[a:a + 4096]
                batch = tokenizer.encode([examples[i].text for i in part],
                                         [examples[i].pair for i in part] if paired else None,
                                         max_length=info.max_length)
                truncated += sum(batch.overflowing)
                for i, row_ids, row_types in zip(part, *_rows(batch, len(part))):
                    ids[i], types[i] = row_ids, row_types
        targets = [index[ex.label] if with_targets else -1 for ex in examples]
        return Featurized(ids, types, targets, truncated=truncated)

    def notes(self, feats, info):
        if not feats.truncated:
            return []
        n = len(feats)
        return [f"{feats.truncated} of {n} text{'s' * (n > 1)} {'are' if feats.truncated > 1 else 'is'} longer "
                f"than {info.max_length} tokens (the model's --max-length) and {'were' if feats.truncated > 1 else 'was'} "
                "truncated at it"]

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
    windows: int = 1  # model rows the sentence was read in: more than 1 when it is longer than max_length


@dataclass
class TagRows:
    """Where the words of one sentence are read: its model rows, and per word (row, position) of the first
    sub-token in the window where the word has the most context (a word normalisation deleted is read as
    [UNK]: `unk_for_tokenless`)."""

    rows: range
    words: list[tuple[int, int]]


class TagTask(Task):
    """A sentence longer than ``max_length`` tokens is cut into windows of ``max_length - 2`` tokens (plus
    [CLS] and [SEP]) overlapping by ``doc_stride`` (encoder/finetuning/windows.py), one model row each, batched
    with all other rows. Each word is read, at prediction, and labelled, in training, in one window only: the
    one where its first sub-token has the most context (BERT's max-context rule). So every word gets a real
    prediction, each word counts once in the loss as in a short sentence, and training sees the same windows,
    starting mid-sentence, that prediction reads (HF's run_ner truncates in training, so words past the limit
    are never learned from and mid-sentence windows never seen).
    """

    head, main_metric = "tag", "f1"

    def check(self, examples, labels, need_targets):
        check_tag_examples(examples, labels, need_targets)

    def labels_of(self, examples):
        return [t for ex in examples for t in (ex.tags or [])]

    def featurize(self, tokenizer, examples: Sequence[TagExample], info, with_targets):
        index = {label: i for i, label in enumerate(info.labels)}
        overlap, room = tag_window(info.max_length, info.doc_stride)
        if not 0 <= overlap < room:
            raise ValueError(f"doc_stride={overlap}: a window of max_length={info.max_length} tokens holds {room} "
                             "tokens of a sentence after [CLS] and before [SEP]; the overlap must be smaller")
        ids: list[list[int]] = []
        targets: list[list[int]] = []
        places: list[TagRows] = []
        tokenless: list[str] = []
        for a in range(0, len(examples), 4096):
            chunk = examples[a:a + 4096]
            joined = [join_words(ex.words) for ex in chunk]
            texts = [text for text, _ in joined]
            # whole sentences, unpadded and without special tokens: cut into windows below
            for j, (ex, (_, starts), tokens, (offsets, _)) in enumerate(zip(chunk, joined,
                                                                            tokenizer.encode_ids(texts),
                                                                            tokenizer.token_spans(texts))):
                first = first_subtokens(starts, offsets, [0] * len(tokens))  # token index of each word, or -1
                # ascii(): the words are invisible characters; their escapes are what a user can find
                tokenless += [f"{ex.source or 'sentence ' + str(a + j + 1)}: word {k + 1} {ascii(ex.words[k])}"
                              for k, f in enumerate(first) if f < 0]
                tokens, first = unk_for_tokenless(first, tokens, tokenizer.unk_id)
                n = len(tokens)
                spans = window_spans(n, room, overlap)
                owner = max_context_owners(spans, n)
                row0 = len(ids)
                rows = [[IGNORE_INDEX] * (last - start + 2) for start, last in spans]
                words = []
                y = [index[tag] for tag in ex.tags] if with_targets else [IGNORE_INDEX] * len(first)
                for t, label in zip(first, y):
                    k = owner[t]
                    pos = t - spans[k][0] + 1  # + 1: [CLS]
                    rows[k][pos] = label
                    words.append((row0 + k, pos))
                ids += [[tokenizer.cls_id, *tokens[start:last], tokenizer.sep_id] for start, last in spans]
                targets += rows
                places.append(TagRows(range(row0, len(ids)), words))
        return Featurized(ids, [[0] * len(r) for r in ids], targets, aux=places, tokenless=tokenless)

    def batch_targets(self, feats, idx):
        return {"labels": pad([feats.targets[i] for i in idx], IGNORE_INDEX)}

    def loss(self, logits, batch):
        return tagging_loss(logits, batch["labels"])

    def decode(self, examples, feats, outputs, info):
        best = [np.asarray(out).argmax(-1) for out in outputs]  # (T_k,) per row
        preds = []
        for ex, place in zip(examples, feats.aux):
            tags = _repair_bio([info.labels[int(best[r][p])] for r, p in place.words])
            ents = [(k, s, e, " ".join(ex.words[s:e])) for k, s, e in bio_entities(tags)]
            preds.append(TagPrediction(tags, ents, len(place.rows)))
        return preds

    def notes(self, feats, info):
        out = []
        windowed = [len(place.rows) for place in feats.aux or () if len(place.rows) > 1]
        if windowed:  # every word is tagged; the user learns that a long sentence was read in parts
            n = len(windowed)
            out.append(f"{n} sentence{'s' * (n > 1)} longer than the model's {info.max_length} tokens "
                       f"{'were' if n > 1 else 'was'} read in {sum(windowed)} overlapping windows; each word is tagged from the window where it "
                       "has the most context")
        if feats.tokenless:
            n = len(feats.tokenless)
            shown = "; ".join(feats.tokenless[:3]) + (f"; and {n - 3} more" if n > 3 else "")
            out.append(f"{n} word{'s' * (n > 1)} {'have' if n > 1 else 'has'} no token after normalisation "
                       f"(zero-width or control characters, a lone accent) and {'were' if n > 1 else 'was'} read "
                       f"as [UNK]: {shown}")
        return out

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
        stride, _, _ = qa_window(info.max_length, info.doc_stride, info.max_query_length)
        windows = make_windows(tokenizer, examples, info.max_length, stride, info.max_query_length,
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
