"""The HTTP service over an index with passages: documents come back whole, hits carry passage offsets."""

from __future__ import annotations

import pytest

from tests.retrieval.pipeline_fixtures import write_corpus
from tests.retrieval.test_passages import corpus_docs, long_text
from tests.serve.serve_fixtures import AUTH, TOKEN, client


@pytest.fixture()
def passage_index(tmp_path, encoder) -> str:
    from twotower.retrieval import SearchPipeline

    corpus = write_corpus(str(tmp_path / "c.jsonl"), corpus_docs())
    out = str(tmp_path / "idx")
    SearchPipeline.build(corpus, out, encoder, passages=True, passage_window=16, passage_stride=12, bm25=True,
                         progress=False).close()
    return out


def test_documents_and_hits_over_http(passage_index):
    docs = {d["_id"]: d for d in corpus_docs()}
    with client(passage_index, token=TOKEN) as c:
        got = c.get("/documents/long1", headers=AUTH).json()
        assert got["text"] == docs["long1"]["text"] and len(got["passages"]) > 2
        hits = c.get("/search", params={"q": "zorbania", "k": 14, "hybrid": True}, headers=AUTH).json()["hits"]
        assert len({h["id"] for h in hits}) == len(hits) == 14
        long1 = next(h for h in hits if h["id"] == "long1")
        assert "zorbania" in long1["text"][long1["passage"]["start"]:long1["passage"]["end"]]
        assert all(h["passage"] is None for h in hits if not h["id"].startswith("long"))

        before = c.get("/stats", headers=AUTH).json()["documents"]
        assert before == len(docs)
        r = c.post("/documents", json={"documents": [{"_id": "long1", "text": long_text(30)}]}, headers=AUTH)
        assert r.status_code == 409, r.text  # a split document is a document: no silent second copy
        r = c.post("/documents", json={"documents": [{"_id": "long1", "text": "tea"}], "replace": True},
                   headers=AUTH)
        assert r.status_code == 200 and r.json()["replaced"] == 1 and r.json()["documents"] == before
        assert c.get("/documents/long1", headers=AUTH).json()["text"] == "tea"
        r = c.request("DELETE", "/documents", json={"ids": ["long2"]}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["documents"] == before - 1
        assert c.get("/documents/long2", headers=AUTH).status_code == 404


def test_aggregate_over_http_equals_the_python_api_and_is_refused_where_it_would_be_ignored(passage_index, tmp_path,
                                                                                               encoder):
    """`aggregate` was CLI and Python only ("unknown parameter 'aggregate'" here)."""
    from twotower.retrieval import SearchPipeline

    with SearchPipeline.load(passage_index, readonly=True, bf16=False) as pipe:  # as the server (serve_fixtures)
        want = {how: [(h.id, round(h.score, 5)) for h in pipe.search("zorbania tea", k=5, recall_k=8, aggregate=how)]
                for how in ("max", "sum", "first")}
    assert want["sum"] != want["max"]  # the check below can tell them apart
    with client(passage_index, token=TOKEN) as c:
        for how in ("max", "sum", "first"):
            got = c.get("/search", params={"q": "zorbania tea", "k": 5, "recall_k": 8, "aggregate": how},
                        headers=AUTH).json()["hits"]
            assert [(h["id"], round(h["score"], 5)) for h in got] == want[how], how
            got = c.post("/search", json={"queries": ["zorbania tea"], "k": 5, "recall_k": 8, "aggregate": how},
                         headers=AUTH).json()["results"][0]["hits"]
            assert [(h["id"], round(h["score"], 5)) for h in got] == want[how], how
        r = c.get("/search", params={"q": "tea", "aggregate": "mean"}, headers=AUTH)
        assert r.status_code == 400 and "aggregate must be one of max, sum, first, got 'mean'" in r.text
    whole = str(tmp_path / "whole")
    SearchPipeline.build(write_corpus(str(tmp_path / "w.jsonl"), corpus_docs()), whole, encoder,
                         progress=False).close()
    with client(whole, token=TOKEN) as c:
        r = c.get("/search", params={"q": "tea", "aggregate": "sum"}, headers=AUTH)
        assert r.status_code == 400 and "stores documents whole" in r.text
        assert c.get("/search", params={"q": "tea"}, headers=AUTH).status_code == 200


def test_a_passage_row_id_is_no_document_over_http(passage_index):
    """GET /documents/long1%1F1 answered the passage row as a document, and DELETE /documents removed that one
    row (200), after which GET /documents/long1 and every search finding long1 failed."""
    with client(passage_index, token=TOKEN) as c:
        whole = c.get("/documents/long1", headers=AUTH).json()
        assert c.get("/documents/long1%1F1", headers=AUTH).status_code == 404
        r = c.request("DELETE", "/documents", json={"ids": ["long1\x1f1"]}, headers=AUTH)
        assert r.status_code == 404 and r.json()["details"] == {"long1\x1f1": "not found"}, r.text
        assert c.get("/documents/long1", headers=AUTH).json() == whole
