"""The QA reader behind `answer`: spans from passages, explicit "no answer", hit labels, the CLI end to end."""

from __future__ import annotations

import json

import pytest

from twotower.encoder.finetuning.task_model import TaskModel
from twotower.encoder.finetuning.tasks import TaskInfo
from twotower.retrieval.hit import Hit
from twotower.retrieval.reader import Answer, AnswerResult, label_hits, rank_answers, read_answers

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny_dir, one_thread: tests/conftest.py


@pytest.fixture(scope="module")
def reader(tiny_dir):
    return TaskModel.from_encoder(tiny_dir, TaskInfo("qa", max_length=24, doc_stride=6, max_answer_length=4),
                                  seed=3)


PASSAGES = [
    {"id": "p1", "title": "Tower", "text": "the tower was built in 1889 for the world fair in paris ."},
    {"id": "p2", "text": "paris is the capital of france and the river flows north through the city ."},
    {"id": "p3", "text": "many people live in the city"},
]


def test_answers_are_spans_of_their_passages_best_first(reader):
    reader.info.null_threshold = None  # never abstain
    hits = [Hit(p["id"], p.get("title", ""), p["text"], i + 1, 1.0, 1.0, i + 1) for i, p in enumerate(PASSAGES)]
    answers = read_answers(reader, "when was the tower built", hits, max_answers=3)
    assert len(answers) == 3 and len({a.passage_id for a in answers}) == 3
    assert [a.score for a in answers] == sorted((a.score for a in answers), reverse=True)
    by_id = {p["id"]: p["text"] for p in PASSAGES}
    for a in answers:
        assert not a.no_answer and by_id[a.passage_id][a.start:a.end] == a.text and a.text
        assert a.passage_rank == int(a.passage_id[1])
    # the same answers from plain mappings; top_passages limits what is read
    assert [a.passage_id for a in read_answers(reader, "when was the tower built", PASSAGES)] == \
        [a.passage_id for a in answers]
    (only,) = read_answers(reader, "when was the tower built", PASSAGES, top_passages=1)
    assert only.passage_id == "p1" and only.title == "Tower"


def test_explicit_no_answer_below_the_threshold(reader):
    reader.info.null_threshold = -1e9  # every passage's [CLS] score wins
    (a,) = read_answers(reader, "who wrote the book", PASSAGES)
    assert a == Answer("", None, None, None, a.score, a.null_score, no_answer=True)
    reader.info.null_threshold = None
    assert read_answers(reader, "who", [])[0].no_answer


def test_reader_rejects_bad_input(reader, tiny_dir):
    with pytest.raises(ValueError, match="question is empty"):
        read_answers(reader, "  ", PASSAGES)
    with pytest.raises(ValueError, match="hit 1 has no passage text"):
        read_answers(reader, "who", [{"id": "x"}])
    clf = TaskModel.from_encoder(tiny_dir, TaskInfo("classify", ["neg", "pos"]))
    with pytest.raises(ValueError, match="must be a fine-tuned QA model"):
        read_answers(clf, "who", PASSAGES)
    labels = label_hits(clf, PASSAGES + [{"id": "e", "text": ""}])
    assert [lab["label"] in ("neg", "pos") for lab in labels[:3]] == [True] * 3 and labels[3]["label"] is None


def test_retrieval_weight_ranks_by_span_plus_passage_score(reader):
    reader.info.null_threshold = None
    hits = [Hit(p["id"], p.get("title", ""), p["text"], i + 1, s, s, i + 1)
            for i, (p, s) in enumerate(zip(PASSAGES, (0.1, 0.5, 0.9)))]
    q = "when was the tower built"
    plain = read_answers(reader, q, hits, max_answers=3)
    assert [a.rank_score for a in plain] == [a.score for a in plain]
    assert [a.retrieval_score for a in plain] == [hits[a.passage_rank - 1].score for a in plain]
    mixed = read_answers(reader, q, hits, max_answers=3, retrieval_weight=2.5)
    assert {(a.passage_id, a.score) for a in mixed} == {(a.passage_id, a.score) for a in plain}  # same spans
    for a in mixed:
        assert a.rank_score == pytest.approx(a.score + 2.5 * a.retrieval_score)
    assert [a.rank_score for a in mixed] == sorted((a.rank_score for a in mixed), reverse=True)
    assert rank_answers(plain, 2.5) == mixed  # re-weighting read answers == reading again with the weight
    # a weight that dwarfs the span logits orders the answers as the retriever ordered the passages
    assert [a.passage_id for a in read_answers(reader, q, hits, max_answers=3, retrieval_weight=1e6)] == \
        ["p3", "p2", "p1"]
    with pytest.raises(ValueError, match="hit 1 has no score"):
        read_answers(reader, q, PASSAGES, retrieval_weight=1.0)
    with pytest.raises(ValueError, match="retrieval_weight must be >= 0"):
        read_answers(reader, q, hits, retrieval_weight=-1.0)


@pytest.fixture()
def index_dir(tmp_path):
    from tests.retrieval.pipeline_fixtures import tiny_model_dir, write_corpus
    from twotower.retrieval.pipeline import SearchPipeline

    corpus = write_corpus(str(tmp_path / "c.jsonl"), [{"_id": p["id"], "title": p.get("title", ""),
                                                       "text": p["text"]} for p in PASSAGES])
    SearchPipeline.build(corpus, tmp_path / "idx", tiny_model_dir(), progress=False, bf16=False).close()
    return tmp_path / "idx"


def test_pipeline_answer_reads_the_hits_it_returns(reader, tiny_dir, index_dir, tmp_path):
    from twotower.retrieval.pipeline import SearchPipeline

    reader.info.null_threshold = None
    reader.save(str(tmp_path / "reader"))
    clf = TaskModel.from_encoder(tiny_dir, TaskInfo("classify", ["neg", "pos"]))
    q = "when was the tower built"
    with SearchPipeline.load(index_dir) as pipe:
        r = pipe.answer(q, reader, k=2)
        assert isinstance(r, AnswerResult) and r.question == q
        assert [h.id for h in r.hits] == [h.id for h in pipe.search(q, k=2)]
        assert r.answers == read_answers(reader, q, r.hits) and r.best == r.answers[0]
        texts = {p["id"]: p["text"] for p in PASSAGES}
        assert all(texts[a.passage_id][a.start:a.end] == a.text for a in r.answers)
        # a reader directory is loaded (once) and answers the same
        by_path = pipe.answer(q, str(tmp_path / "reader"), k=2)
        assert [(a.passage_id, a.text) for a in by_path.answers] == [(a.passage_id, a.text) for a in r.answers]
        assert len(pipe._task_models) == 1
        many = pipe.answer([q, "who lives in the city"], reader, k=1, max_answers=1)
        assert [m.question for m in many] == [q, "who lives in the city"] and all(len(m.hits) == 1 for m in many)
        # labels on hits come from the classification head, for the returned hits only
        labelled = pipe.search(q, k=3, classifier=clf)
        assert [(h.label, h.label_score) for h in labelled] == \
            [(lab["label"], lab["score"]) for lab in label_hits(clf, labelled)]
        assert all(h.label in ("neg", "pos") and 0.5 <= h.label_score <= 1.0 for h in labelled)
        assert all(h.label is None for h in pipe.search(q, k=3))
        assert all(h.label is not None for h in pipe.answer(q, reader, k=2, classifier=clf).hits)
        with pytest.raises(ValueError, match="reader must be a fine-tuned 'qa' model"):
            pipe.answer(q, clf)
        with pytest.raises(ValueError, match="classifier must be a fine-tuned 'classify' model"):
            pipe.search(q, classifier=reader)
        with pytest.raises(ValueError, match="needs their text"):
            pipe.search(q, classifier=clf, fetch_documents=False)
        with pytest.raises(ValueError, match="query is empty"):
            pipe.answer(" ", reader)


def test_answer_cli_end_to_end(reader, tiny_dir, index_dir, tmp_path, capsys):
    from twotower.cli import main

    reader.info.null_threshold = None
    reader.save(str(tmp_path / "reader"))
    clf = TaskModel.from_encoder(tiny_dir, TaskInfo("classify", ["neg", "pos"]))
    clf.save(str(tmp_path / "clf"))
    rc = main(["answer", "--index", str(index_dir), "--reader", str(tmp_path / "reader"), "-k", "2",
               "--classifier", str(tmp_path / "clf"), "--json", "when was the tower built"])
    assert rc == 0
    (out,) = json.loads(capsys.readouterr().out)
    assert out["question"] == "when was the tower built" and len(out["hits"]) == 2
    assert 1 <= len(out["answers"]) <= 2 and all(h["label"]["label"] in ("neg", "pos") for h in out["hits"])
    texts = {p["id"]: p["text"] for p in PASSAGES}
    for a in out["answers"]:
        assert texts[a["passage_id"]][a["start"]:a["end"]] == a["text"]
    # the table for a person; an explicit "no answer" when the threshold rejects every passage
    assert main(["answer", "--index", str(index_dir), "--reader", str(tmp_path / "reader"), "-k", "1",
                 "when was the tower built"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Q: when was the tower built" and "passage p" in lines[1] and "chars" in lines[1]
    reader.info.null_threshold = -1e9
    reader.save(str(tmp_path / "reader"))
    assert main(["answer", "--index", str(index_dir), "--reader", str(tmp_path / "reader"), "who"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "  no answer in the top passages"
    reader.info.null_threshold = None
    assert main(["answer", "--index", str(index_dir), "--reader", str(tmp_path / "clf"), "who"]) == 2
    assert "needs a QA model" in capsys.readouterr().err
    assert main(["answer", "--index", str(index_dir), "--reader", str(tmp_path / "reader"), "-k", "5",
                 "--recall-k", "2", "who"]) == 2
    assert "--recall-k (2) must be at least -k (5)" in capsys.readouterr().err
    for flags, message in ((["--retrieval-weight", "nan"], "--retrieval-weight must be a number >= 0, got nan"),
                           (["--retrieval-weight", "-1"], "got -1.0"),
                           (["--no-rerank", "--reranker", "default"], "--no-rerank turns reranking off")):
        assert main(["answer", "--index", str(index_dir), "--reader", str(tmp_path / "reader"), *flags, "who"]) == 2
        assert message in capsys.readouterr().err


def test_answer_reads_bm25s_passages_with_bm25(reader, index_dir, tmp_path, capsys):
    """answer(..., bm25=True) and `answer --bm25` read the passages BM25 recalls; an index without BM25 is refused."""
    from tests.retrieval.pipeline_fixtures import tiny_model_dir, write_corpus
    from twotower.cli import main
    from twotower.retrieval.pipeline import SearchPipeline

    corpus = write_corpus(str(tmp_path / "c.jsonl"), [{"_id": p["id"], "title": p.get("title", ""),
                                                       "text": p["text"]} for p in PASSAGES])
    SearchPipeline.build(corpus, tmp_path / "bm", tiny_model_dir(), bm25=True, progress=False, bf16=False).close()
    reader.info.null_threshold = None
    reader.save(str(tmp_path / "reader"))
    q = "capital of france river"  # only p2 shares a word with it: BM25 recalls p2 alone, dense recall ranks all
    with SearchPipeline.load(tmp_path / "bm") as pipe:
        want = [h.id for h in pipe.search(q, k=2, bm25=True)]
        assert want == [i for i in pipe.store.search_bm25([q], 2).ids[0] if i]  # BM25's own top 2
        assert want == ["p2"] and len(pipe.search(q, k=2)) == 2  # not the dense ranking
        assert [h.id for h in pipe.answer(q, reader, k=2, bm25=True).hits] == want
    assert main(["answer", "--index", str(tmp_path / "bm"), "--reader", str(tmp_path / "reader"), "-k", "2", "--bm25",
                 "--json", q]) == 0
    assert [h["id"] for h in json.loads(capsys.readouterr().out)[0]["hits"]] == want
    assert main(["answer", "--index", str(index_dir), "--reader", str(tmp_path / "reader"), "--bm25", q]) == 2
    assert "--bm25: the index" in capsys.readouterr().err


def test_answer_reads_only_documents_the_filter_allows(reader, tmp_path, capsys):
    from tests.retrieval.pipeline_fixtures import tiny_model_dir, write_corpus
    from twotower.cli import main
    from twotower.retrieval.pipeline import SearchPipeline

    kinds = {p["id"]: ("a" if i % 2 else "b") for i, p in enumerate(PASSAGES)}
    allowed = {i for i, k in kinds.items() if k == "a"}
    corpus = write_corpus(str(tmp_path / "c.jsonl"), [{"_id": p["id"], "title": p.get("title", ""), "text": p["text"],
                                                       "kind": kinds[p["id"]]} for p in PASSAGES])
    SearchPipeline.build(corpus, tmp_path / "idx", tiny_model_dir(), progress=False, bf16=False).close()
    reader.info.null_threshold = None
    reader.save(str(tmp_path / "reader"))
    q = "when was the tower built"
    with SearchPipeline.load(tmp_path / "idx") as pipe:
        r = pipe.answer(q, reader, k=len(PASSAGES), filter='kind == "a"')
        assert {h.id for h in r.hits} == allowed and {a.passage_id for a in r.answers} <= allowed
    rc = main(["answer", "--index", str(tmp_path / "idx"), "--reader", str(tmp_path / "reader"), "--json",
               "--filter", 'kind == "a"', q])
    assert rc == 0 and {h["id"] for h in json.loads(capsys.readouterr().out)[0]["hits"]} <= allowed
    rc = main(["answer", "--index", str(tmp_path / "idx"), "--reader", str(tmp_path / "reader"),
               "--filter", 'knid == "a"', q])
    assert rc == 2 and "--filter" in capsys.readouterr().err
