"""The reader behind `SearchPipeline.answer`: an extractive-QA head run over the top retrieved passages.

retrieve -> rerank -> read: each of the top passages is paired with the
question, cut into overlapping windows (a long passage is not unanswerable,
its answer may just sit past the first window), and the best span of each
passage is kept.  A passage whose [CLS] "no answer" score beats its best span
by more than the threshold the reader chose on dev answers nothing; when every
passage answers nothing the result is one explicit "no answer".  Spans from
different passages are ranked by their start + end score, as DrQA and
BERTserini do.

Optional labels on hits (topic, sentiment ...) come from a classification
head and are computed only for the hits actually returned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from encoder.task_examples import QAExample, TextExample


@dataclass(frozen=True)
class Answer:
    """One answer span, or the explicit "no answer" (``no_answer=True``, ``text == ""``).

    ``start``/``end`` are character offsets into the passage text (end
    exclusive), None for "no answer"; ``passage_rank`` is the passage's rank in
    the hit list (1-based).
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
    batch_size: int = 16,
) -> list[Answer]:
    """Answer spans for ``question`` from the passages of ``hits`` (best first).

    Args:
        reader: an ``encoder.task_model.TaskModel`` with a QA head (``TaskModel.from_pretrained(dir)``).
        hits: ranked passages: ``retrieval.Hit`` objects or mappings with ``id``, ``text`` (and ``title``).
        top_passages: read only the first this many hits (default: all of them).
        max_answers: at most this many spans, from distinct passages.
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
    passages = list(hits[:top_passages] if top_passages else hits)
    examples = []
    for i, hit in enumerate(passages):
        text = _field(hit, "text")
        if not isinstance(text, str):
            raise ValueError(f"hit {i + 1} has no passage text")
        examples.append(QAExample(str(_field(hit, "id", i)), question, text))
    readable = [k for k, ex in enumerate(examples) if ex.context.strip()]
    preds = reader.predict([examples[k] for k in readable], batch_size=batch_size) if readable else []
    answers, null = [], float("inf")
    for k, pred in zip(readable, preds):
        null = min(null, pred.null_score)
        if pred.no_answer:
            continue
        answers.append(Answer(pred.text, examples[k].id, pred.start, pred.end, pred.score, pred.null_score,
                              passage_rank=k + 1, title=str(_field(passages[k], "title", "") or "")))
    if not answers:
        best = max(preds, key=lambda p: p.score, default=None)
        return [Answer("", None, None, None, best.score if best else float("-inf"), null, no_answer=True)]
    answers.sort(key=lambda a: (-a.score, a.passage_rank))
    return answers[:max_answers]


def label_hits(classifier: Any, hits: Sequence[Any], batch_size: int = 32) -> list[dict[str, Any]]:
    """A label (and its probability) for each hit's text from a classification head; one forward per hit."""
    if getattr(classifier, "info", None) is None or classifier.info.head != "classify":
        raise ValueError("the hit classifier must be a fine-tuned classification model (twotower finetune classify)")
    texts = [str(_field(h, "text", "") or "") for h in hits]
    todo = [i for i, t in enumerate(texts) if t.strip()]
    preds = classifier.predict([TextExample(texts[i]) for i in todo], batch_size=batch_size) if todo else []
    out: list[dict[str, Any]] = [{"label": None, "score": None} for _ in hits]
    for i, p in zip(todo, preds):
        out[i] = {"label": p.label, "score": p.score}
    return out
