"""The reader behind `SearchPipeline.answer`: an extractive-QA head run over the top retrieved passages.

retrieve -> rerank -> read: each of the top passages is paired with the
question, cut into overlapping windows (a long passage is not unanswerable,
its answer may just sit past the first window), and the best span of each
passage is kept.  A passage whose [CLS] "no answer" score beats its best span
by more than the threshold the reader chose on dev answers nothing; when every
passage answers nothing the result is one explicit "no answer".  Spans from
different passages are ranked by their start + end score, as DrQA does, or
(``retrieval_weight`` > 0) by that score plus a weight times the passage's
retrieval score, as BERTserini does: raw span logits from different passages
are not calibrated against each other, and the retriever's opinion of the
passage is evidence the reader does not see.  The weight depends on the
retriever's score scale (cosine, BM25, fused, reranked), so it is chosen on dev
for a given index + reader pair (benchmarks/tasks_xquad_answer.py does).

Optional labels on hits (topic, sentiment ...) come from a classification
head and are computed only for the hits actually returned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from twotower.encoder.finetuning.task_examples import QAExample, TextExample


@dataclass(frozen=True)
class Answer:
    """One answer span, or the explicit "no answer" (``no_answer=True``, ``text == ""``).

    ``start``/``end`` are character offsets into the passage text (end
    exclusive), None for "no answer"; ``passage_rank`` is the passage's rank in
    the hit list (1-based).  ``score`` is the reader's start + end logit;
    ``retrieval_score`` the passage's score in the hit list (None for hits
    without one); ``rank_score`` = score + retrieval_weight * retrieval_score
    is what answers are ordered by.
    """

    text: str
    passage_id: str | None
    start: int | None
    end: int | None
    score: float
    null_score: float
    no_answer: bool = False
    passage_rank: int | None = None
    title: str = ""
    retrieval_score: float | None = None
    rank_score: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _field(hit: Any, name: str, default: Any = None) -> Any:
    if isinstance(hit, Mapping):
        return hit.get(name, default)
    return getattr(hit, name, default)


def read_answers(
    reader: Any,
    question: str,
    hits: Sequence[Any],
    top_passages: int | None = None,
    max_answers: int = 3,
    batch_size: int | None = None,
    retrieval_weight: float = 0.0,
) -> list[Answer]:
    """Answer spans for ``question`` from the passages of ``hits`` (best first).

    Args:
        reader: an ``twotower.encoder.finetuning.task_model.TaskModel`` with a QA head (``TaskModel.from_pretrained(dir)``).
        hits: ranked passages: ``retrieval.Hit`` objects or mappings with ``id``, ``text`` (and ``title``).
        top_passages: read only the first this many hits (default: all of them).
        max_answers: at most this many spans, from distinct passages.
        batch_size: the reader's windows a forward; None: by token budget (`TaskModel.predict`).
        retrieval_weight: answers are ranked by span score + this * the hit's ``score``
            (0: by span score alone); > 0 needs hits that carry a score.
    Returns:
        Up to ``max_answers`` answers, or ``[Answer(no_answer=True, ...)]`` when no
        passage holds an answer above the reader's threshold (or there are no hits).
    """
    if getattr(reader, "info", None) is None or reader.info.head != "qa":
        raise ValueError("the reader must be a fine-tuned QA model (twotower finetune qa)")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("the question is empty")
    if max_answers < 1:
        raise ValueError(f"max_answers must be >= 1, got {max_answers}")
    if not retrieval_weight >= 0:
        raise ValueError(f"retrieval_weight must be >= 0, got {retrieval_weight}")
    passages = list(hits[:top_passages] if top_passages else hits)
    examples, retrieval_scores = [], []
    for i, hit in enumerate(passages):
        text = _field(hit, "text")
        if not isinstance(text, str):
            raise ValueError(f"hit {i + 1} has no passage text")
        examples.append(QAExample(str(_field(hit, "id", i)), question, text))
        score = _field(hit, "score")
        if retrieval_weight and not isinstance(score, (int, float)):
            raise ValueError(f"hit {i + 1} has no score; retrieval_weight > 0 needs ranked hits")
        retrieval_scores.append(float(score) if isinstance(score, (int, float)) else None)
    readable = [k for k, ex in enumerate(examples) if ex.context.strip()]
    preds = reader.predict([examples[k] for k in readable], batch_size=batch_size) if readable else []
    answers, null = [], float("inf")
    for k, pred in zip(readable, preds):
        null = min(null, pred.null_score)
        if pred.no_answer:
            continue
        answers.append(Answer(pred.text, examples[k].id, pred.start, pred.end, pred.score, pred.null_score,
                              passage_rank=k + 1, title=str(_field(passages[k], "title", "") or ""),
                              retrieval_score=retrieval_scores[k]))
    if not answers:
        best = max(preds, key=lambda p: p.score, default=None)
        return [Answer("", None, None, None, best.score if best else float("-inf"), null, no_answer=True)]
    return rank_answers(answers, retrieval_weight)[:max_answers]


def rank_answers(answers: Sequence[Answer], retrieval_weight: float = 0.0) -> list[Answer]:
    """Answers ordered by span score + ``retrieval_weight`` * passage score (ties: better passage first).

    `read_answers` ends with this; a benchmark that reads every passage once can call it again with
    other weights to choose one on dev without re-running the reader.
    """
    if not retrieval_weight >= 0:
        raise ValueError(f"retrieval_weight must be >= 0, got {retrieval_weight}")
    out = []
    for a in answers:
        if a.no_answer:
            continue
        if retrieval_weight and a.retrieval_score is None:
            raise ValueError(f"answer from passage {a.passage_id!r} has no retrieval score")
        out.append(replace(a, rank_score=a.score + retrieval_weight * a.retrieval_score if retrieval_weight
                           else a.score))
    out.sort(key=lambda a: (-a.rank_score, a.passage_rank if a.passage_rank is not None else 0))
    return out


@dataclass(frozen=True)
class AnswerResult:
    """What `SearchPipeline.answer` returns for one question: the answers and the hits they were read from."""

    question: str
    answers: list[Answer]
    hits: list[Any]

    @property
    def best(self) -> Answer:
        """The first answer (an explicit "no answer" when no passage held one)."""
        return self.answers[0]

    def to_dict(self) -> dict[str, Any]:
        return {"question": self.question, "answers": [a.to_dict() for a in self.answers],
                "hits": [h.to_dict() if hasattr(h, "to_dict") else dict(h) for h in self.hits]}


def label_hits(classifier: Any, hits: Sequence[Any], batch_size: int | None = None) -> list[dict[str, Any]]:
    """A label (and its probability) for each hit's text from a classification head, the hits batched by
    `TaskModel.predict` (``batch_size`` texts a forward; None: by token budget)."""
    if getattr(classifier, "info", None) is None or classifier.info.head != "classify":
        raise ValueError("the hit classifier must be a fine-tuned classification model (twotower finetune classify)")
    texts = [str(_field(h, "text", "") or "") for h in hits]
    todo = [i for i, t in enumerate(texts) if t.strip()]
    preds = classifier.predict([TextExample(texts[i]) for i in todo], batch_size=batch_size) if todo else []
    out: list[dict[str, Any]] = [{"label": None, "score": None} for _ in hits]
    for i, p in zip(todo, preds):
        out[i] = {"label": p.label, "score": p.score}
    return out
