"""The endpoints against the library: hits equal `SearchPipeline.search`, writes are visible, stats count."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
from concurrent.futures import Future

import pytest

from tests.retrieval.pipeline_fixtures import tiny_model_dir
from tests.serve.serve_fixtures import AUTH, TOKEN, client, hold, live_server, stats, wait_until
from twotower.indexing import document_text
from twotower.retrieval import Hit, SearchPipeline
from twotower.retrieval.interpolation import write_alpha
from twotower.serve.app import STATIC
from twotower.serve.batcher import SearchParams

QUERIES = ["tea coffee cold", "gene protein expression", "patient drug dose trial risk"]


def _reference(index: str, reranker: str | None = None):
    return SearchPipeline.load(index, tiny_model_dir(), reranker=reranker, use_default_reranker=False, bf16=False)


def _same(got: list[dict], want: list[Hit]) -> None:
    assert [h["id"] for h in got] == [h.id for h in want]
    for g, w in zip(got, want):
        w = w.to_dict()
        assert set(g) == set(w)
        for key, value in w.items():
            assert g[key] == (pytest.approx(value, rel=1e-5, abs=1e-6) if isinstance(value, float) else value), key


def test_get_search_returns_the_pipelines_hits_with_the_cli_json_fields(index_template):
    with client(index_template) as c, _reference(index_template) as ref:
        for q in QUERIES:
            r = c.get("/search", params={"q": q, "k": 7})
            assert r.status_code == 200, r.text
            body = r.json()
            want = ref.search(q, k=7, recall_k=100)
            _same(body["hits"], want)
            assert set(body["hits"][0]) == set(want[0].to_dict())  # the `twotower search --json` record
            assert (body["query"], body["reranked"], body["hybrid"], body["bm25"]) == (q, False, False, False)
            assert body["generation"] == ref.store.generation


def test_hybrid_and_rerank_match_the_pipeline(index_template, reranker_dir):
    with client(index_template, reranker=reranker_dir) as c, _reference(index_template, reranker_dir) as ref:
        for hybrid in (False, True):
            for rerank in (False, True):
                r = c.get("/search", params={"q": QUERIES[0], "k": 5, "recall_k": 20, "hybrid": hybrid,
                                             "rerank": rerank})
                assert r.status_code == 200, r.text
                body = r.json()
                _same(body["hits"], ref.search(QUERIES[0], k=5, recall_k=20, hybrid=hybrid, rerank=rerank))
                assert (body["hybrid"], body["reranked"]) == (hybrid, rerank)
        # rerank_k: only the first stage's top 4 are scored; the rest follow in first-stage order
        r = c.get("/search", params={"q": QUERIES[2], "k": 8, "recall_k": 20, "rerank_k": 4})
        assert r.status_code == 200, r.text
        want = ref.search(QUERIES[2], k=8, recall_k=20, rerank_k=4)
        _same(r.json()["hits"], want)
        assert [h["rerank_score"] is None for h in r.json()["hits"]] == [False] * 4 + [True] * 4
        batch = c.post("/search", json={"queries": QUERIES, "k": 8, "recall_k": 20, "rerank_k": 4}).json()
        for res, w in zip(batch["results"], ref.search(QUERIES, k=8, recall_k=20, rerank_k=4)):
            _same(res["hits"], w)
        off = c.get("/search", params={"q": QUERIES[2], "rerank": "false", "rerank_k": 4})  # was ignored
        assert off.status_code == 400 and "rerank=false turns reranking off" in off.json()["message"]
        default = c.get("/search", params={"q": QUERIES[1], "k": 3, "recall_k": 10}).json()
        assert default["reranked"] is True  # a loaded reranker is used unless rerank=false
        assert all(h["rerank_score"] is not None for h in default["hits"])


def _ids(hits) -> list[str]:
    return [h["id"] if isinstance(h, dict) else h.id for h in hits]


def test_bm25_recall_and_rerank_match_the_pipeline(index_template, reranker_dir):
    """bm25=true recalls by BM25 alone (the pipeline's `search(bm25=True)`), reranked or not, and says so."""
    with client(index_template, reranker=reranker_dir) as c, _reference(index_template, reranker_dir) as ref:
        for q in QUERIES:
            # the index's own BM25 ranking, not the dense one the tiny random encoder gives
            lexical = ref.search(q, k=5, recall_k=20, bm25=True, rerank=False)
            assert _ids(lexical) != _ids(ref.search(q, k=5, recall_k=20, rerank=False)), q
            for rerank in (False, True):
                r = c.get("/search", params={"q": q, "k": 5, "recall_k": 20, "bm25": True, "rerank": rerank})
                assert r.status_code == 200, r.text
                body = r.json()
                _same(body["hits"], ref.search(q, k=5, recall_k=20, bm25=True, rerank=rerank))
                assert (body["bm25"], body["hybrid"], body["reranked"]) == (True, False, rerank)
            assert _ids(c.get("/search", params={"q": q, "k": 5, "recall_k": 20, "bm25": "true", "rerank": "false"})
                        .json()["hits"]) == _ids(lexical)
        body = c.post("/search", json={"queries": QUERIES, "k": 4, "recall_k": 12, "bm25": True}).json()
        for res, w in zip(body["results"], ref.search(QUERIES, k=4, recall_k=12, bm25=True)):
            _same(res["hits"], w)
        assert (body["bm25"], body["hybrid"], body["reranked"]) == (True, False, True)
        dense = c.post("/search", json={"queries": QUERIES[:1], "k": 4, "recall_k": 12, "rerank": False}).json()
        assert (dense["bm25"], dense["hybrid"]) == (False, False)


def test_post_search_answers_a_batch_in_order(index_template, reranker_dir):
    with client(index_template, reranker=reranker_dir) as c, _reference(index_template, reranker_dir) as ref:
        r = c.post("/search", json={"queries": QUERIES, "k": 4, "recall_k": 12, "hybrid": True})
        assert r.status_code == 200, r.text
        body = r.json()
        want = ref.search(QUERIES, k=4, recall_k=12, hybrid=True)
        assert [x["query"] for x in body["results"]] == QUERIES
        for res, w in zip(body["results"], want):
            _same(res["hits"], w)
        assert body["reranked"] is True and body["hybrid"] is True and body["bm25"] is False


def test_get_document_by_id(index_template, docs):
    with client(index_template) as c:
        d = docs[5]
        r = c.get(f"/documents/{d['_id']}")
        assert r.status_code == 200
        got = r.json()
        assert (got["id"], got["title"], got["text"], got["metadata"]) == (d["_id"], d["title"], d["text"], {})


def test_add_replace_delete_round_trip(index_dir):
    new = [{"_id": "new/1", "title": "fresh", "text": "green tea leaf milk sugar"},
           {"_id": "new-2", "text": "mouse brain tumor signal pathway", "metadata": {"source": "test"}}]
    with client(index_dir, token=TOKEN) as c:
        before = stats(c, AUTH)
        r = c.post("/documents", json={"documents": new}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json() == {"added": 2, "replaced": 0, "ids": ["new/1", "new-2"],
                            "generation": before["generation"] + 1, "documents": before["documents"] + 2}
        for d in new:  # searchable as soon as the add returned: its own text is its nearest neighbour
            top = c.get("/search", params={"q": document_text(d), "k": 1}, headers=AUTH).json()["hits"][0]
            assert top["id"] == d["_id"] and top["text"] == d["text"]
        got = c.get("/documents/new-2", headers=AUTH).json()
        assert got["metadata"] == {"source": "test"}
        assert c.get("/documents/new/1", headers=AUTH).json()["title"] == "fresh"  # ids may hold a slash

        changed = {"_id": "new/1", "text": "coffee cup water hot drink"}
        r = c.post("/documents", json={"documents": [changed], "replace": True}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert (r.json()["added"], r.json()["replaced"], r.json()["documents"]) == (0, 1, before["documents"] + 2)
        assert c.get("/documents/new/1", headers=AUTH).json()["text"] == changed["text"]

        r = c.request("DELETE", "/documents", json={"ids": ["new/1", "new-2"]}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["deleted"] == ["new/1", "new-2"] and r.json()["documents"] == before["documents"]
        assert c.get("/documents/new/1", headers=AUTH).status_code == 404
        hits = c.get("/search", params={"q": "green tea leaf milk sugar", "k": 50}, headers=AUTH).json()["hits"]
        assert not {"new/1", "new-2"} & {h["id"] for h in hits}
    with _reference(index_dir) as ref:  # the commits are on disk for any other reader
        assert len(ref) == before["documents"] and ref.store.get(["new/1"]) == [None]


def test_health_and_stats(index_template):
    with client(index_template) as c:
        h = c.get("/health")
        assert h.status_code == 200
        assert h.json()["status"] == "ok" and h.json()["hybrid"] is True and h.json()["reranker"] is False
        assert h.json()["bm25"] is True  # the page's BM25-only switch
        for q in QUERIES:
            assert c.get("/search", params={"q": q}).status_code == 200
        assert c.get("/search", params={"q": " "}).status_code == 400
        s = stats(c)
        with _reference(index_template) as ref:
            manifest_fp = ref.store.manifest.extra["pipeline"]["encoder"]["fingerprint"]
            assert s["documents"] == len(ref) and s["generation"] == ref.store.generation
            assert s["model"]["fingerprint"] == ref.encoder.fingerprint() == s["index"]["encoder_fingerprint"]
            assert s["index"]["encoder_fingerprint"] == manifest_fp
            # the page shows the model by name: the tiny test model's directory, not the package's "model"
            assert s["model"]["name"] == os.path.basename(os.path.realpath(s["model"]["source"]))
        assert s["index"]["type"] == "Flat" and s["index"]["bm25"] is True
        assert s["reranker"] == {"loaded": False, "source": None, "weights": {}}
        route = s["requests"]["routes"]["GET /search"]
        assert route["count"] == 4 and route["statuses"] == {"2xx": 3, "4xx": 1}
        assert 0 < route["p50_ms"] <= route["p95_ms"] <= route["p99_ms"] <= route["max_ms"] * 1.01
        assert s["batching"]["queries"] == 3
        assert 0 < s["batching"]["busy_s"] <= s["requests"]["uptime_s"]  # the owner's time in the searches


def test_the_page_and_its_files_forbid_framing_sniffing_and_anything_from_elsewhere(index_template):
    """The page's answers carried no security headers: any site could frame it (and its token box), and a
    browser would run script or style from anywhere it was injected."""
    page_headers = {"content-security-policy": "default-src 'self'; frame-ancestors 'none'",
                    "x-frame-options": "DENY", "x-content-type-options": "nosniff"}
    with client(index_template) as c:
        for path in ["/"] + [f"/static/{name}" for name in sorted(os.listdir(STATIC))]:
            r = c.get(path)
            assert r.status_code == 200, path
            assert {k: r.headers.get(k) for k in page_headers} == page_headers, path
        assert c.head("/").headers["x-frame-options"] == "DENY"
        docs = c.get("/docs")  # its script and style are inline: framing and sniffing only
        assert (docs.headers["x-frame-options"], docs.headers["x-content-type-options"]) == ("DENY", "nosniff")


def test_stats_lists_the_metadata_fields_a_filter_may_name(index_dir):
    """The page puts them by its filter box; no endpoint said which fields an index has."""
    with client(index_dir, token=TOKEN) as c:
        index = stats(c, AUTH)["index"]
        assert (index["metadata_fields"], index["metadata_field_count"]) == ([], 0)
        doc = {"_id": "m1", "text": "tea", "metadata": {"lang": "en", "source": {"name": "x", "year": 2020}}}
        assert c.post("/documents", json={"documents": [doc]}, headers=AUTH).status_code == 200
        index = stats(c, AUTH)["index"]  # the next commit's fields, at once
        assert index["metadata_fields"] == ["lang", "source.name", "source.year"]
        assert index["metadata_field_count"] == 3


def test_page_and_api_reference_load_nothing_from_elsewhere(index_template):
    with client(index_template) as c:
        page = c.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert 'id="q"' in page.text and 'id="hybrid"' in page.text and 'id="rerank"' in page.text
        assert 'id="bm25"' in page.text
        for name in sorted(os.listdir(STATIC)):
            r = c.get(f"/static/{name}")
            assert r.status_code == 200, name
            text = re.sub(r'xmlns="[^"]*"', "", r.text)  # an SVG namespace names a host but loads nothing
            assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), f"{name} names another host"
        referenced = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert referenced and all(u.startswith("/") and not u.startswith("//") for u in referenced)
        assert c.get("/docs").status_code == 200
        spec = c.get("/openapi.json").json()
        assert {"/search", "/documents", "/documents/{doc_id}", "/health", "/stats"} <= set(spec["paths"])
        assert set(spec["paths"]["/search"]) == {"get", "post"} and set(spec["paths"]["/documents"]) == {"post",
                                                                                                         "delete"}
        json.dumps(spec)


def test_a_reranker_with_weight_zero_is_skipped_and_not_reported_as_reranking(index_template, reranker_dir,
                                                                               tmp_path):
    zero = str(tmp_path / "ce-alpha0")
    shutil.copytree(reranker_dir, zero)
    write_alpha(zero, 0.0, {"bm25": 0.0})
    with client(index_template, reranker=zero) as c, _reference(index_template) as ref:
        # /stats names the weight each first stage's searches apply and where it was chosen
        assert stats(c)["reranker"]["weights"] == {"dense": {"alpha": 0.0, "chosen_over": "bm25"},
                                                   "hybrid": {"alpha": 0.0, "chosen_over": "bm25"},
                                                   "bm25": {"alpha": 0.0, "chosen_over": "bm25"}}
        body = c.get("/search", params={"q": QUERIES[0], "k": 5, "recall_k": 20}).json()
        assert body["reranked"] is False  # the final ranking is the first stage's: no cross-encoder was run
        assert all(h["rerank_score"] is None for h in body["hits"])
        _same(body["hits"], ref.search(QUERIES[0], k=5, recall_k=20))


def test_a_bm25_search_applies_and_reports_the_weight_stored_for_bm25(index_template, reranker_dir, tmp_path):
    """/stats lists the "bm25" first stage's weight beside dense's and hybrid's, and a bm25=true search applies it:
    here 0, so it keeps BM25's ranking while a dense search with the same reranker is reranked."""
    ce = str(tmp_path / "ce-by-stage")
    shutil.copytree(reranker_dir, ce)
    write_alpha(ce, 0.5, {"dense": 0.7, "hybrid": 0.6, "bm25": 0.0})
    with client(index_template, reranker=ce) as c, _reference(index_template, ce) as ref:
        assert stats(c)["reranker"]["weights"] == {"dense": {"alpha": 0.7, "chosen_over": "dense"},
                                                   "hybrid": {"alpha": 0.6, "chosen_over": "hybrid"},
                                                   "bm25": {"alpha": 0.0, "chosen_over": "bm25"}}
        body = c.get("/search", params={"q": QUERIES[0], "k": 5, "recall_k": 20, "bm25": True}).json()
        assert body["reranked"] is False and all(h["rerank_score"] is None for h in body["hits"])
        _same(body["hits"], ref.search(QUERIES[0], k=5, recall_k=20, bm25=True))
        assert _ids(body["hits"]) == _ids(ref.search(QUERIES[0], k=5, recall_k=20, bm25=True, rerank=False))
        dense = c.get("/search", params={"q": QUERIES[0], "k": 5, "recall_k": 20}).json()
        assert dense["reranked"] is True


# ---------------------------------------------------------------------- availability: back-pressure, deadlines, writes
def _meanwhile(fn, release: threading.Event, seconds: float = 10.0):
    """fn() in a thread while the owner is held; if it is not answered within `seconds` (it waits for the owner),
    the owner is released and its late answer returned, for the test to refuse."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(seconds)
    release.set()
    t.join(60)
    return out[0]


def test_a_search_past_the_queue_limit_is_a_503_with_retry_after(index_template):
    with client(index_template, max_batch=2) as c:  # at most 4 x 2 queries wait
        owner = c.app.state.service.owner
        release = hold(owner)
        queued = owner.search(QUERIES[:2] * 4, SearchParams(k=1, recall_k=10))  # 8 of 8
        r = _meanwhile(lambda: c.get("/search", params={"q": "tea"}), release)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"] == "unavailable" and "8 queries are waiting" in r.json()["message"]
        assert len(queued.result(30).hits) == 8
        assert stats(c)["batching"]["refused"] == 1


def test_a_search_past_its_deadline_is_a_503_and_never_runs(index_template):
    """A route awaited the owner's answer for ever: a search queued behind minutes of work was answered when it came,
    whoever still waited. Past `request_timeout_s` it is answered 503 with Retry-After and withdrawn from the queue."""
    with client(index_template, request_timeout_s=0.3) as c:
        owner = c.app.state.service.owner
        release = hold(owner)
        r = _meanwhile(lambda: c.get("/search", params={"q": "tea"}), release)
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
        assert "not answered within 0.3 s" in r.json()["message"]
        lookup = c.get("/documents/d1")  # lookups have the deadline too, and the owner still serves
        assert lookup.status_code in (200, 404)
        assert owner.batches == 0  # the search was withdrawn before the owner could run it
        assert stats(c)["batching"]["abandoned"] == 1


def test_a_client_that_disconnects_withdraws_its_search(index_template):
    """Starlette does not cancel a handler whose client has gone: 20 clients giving up after 50 ms left 1,282 queries
    for the owner to run. The handler now watches for the disconnect and withdraws the queued search."""
    with live_server(index_template) as (url, app):
        owner = app.state.service.owner
        release = hold(owner)
        try:
            port = int(url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
                conn.sendall(b"GET /search?q=tea HTTP/1.1\r\nHost: x\r\n\r\n")
                wait_until(lambda: owner._queued_queries == 1, "the search is queued")
            wait_until(lambda: owner._queued_queries == 0, "the search is withdrawn when its client goes", 10)
        finally:
            release.set()
        assert owner.call(lambda pipe: owner.batches).result(30) == 0  # the owner never ran it
        assert owner.batch_stats()["abandoned"] == 1


def test_lookups_past_the_queue_limit_are_a_503(index_template, docs):
    with client(index_template, max_batch=1) as c:  # at most 4 lookups wait
        owner = c.app.state.service.owner
        release = hold(owner)
        waiting = [threading.Thread(target=c.get, args=(f"/documents/{docs[i]['_id']}",)) for i in range(4)]
        for t in waiting:
            t.start()
        wait_until(lambda: len(owner._calls) == 4, "four lookups are queued")
        r = _meanwhile(lambda: c.get(f"/documents/{docs[5]['_id']}"), release)
        for t in waiting:
            t.join(30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "4 lookups are waiting" in r.json()["message"]


def test_a_committed_write_is_answered_as_committed_when_the_searches_cannot_follow(index_dir, monkeypatch, caplog):
    """The add committed, then the model owner failed to move to the new commit: the client got a 500 for a write that
    had landed, and its retry a 409. The answer now gives the commit's generation and says searches lag behind."""
    doc = {"_id": "late-1", "text": "green tea leaf milk sugar"}
    with client(index_dir, token=TOKEN) as c:
        owner = c.app.state.service.owner
        before = stats(c, AUTH)

        def refresh_fails():
            failed: Future = Future()
            failed.set_exception(OSError("segment file unreadable"))
            return failed

        monkeypatch.setattr(owner, "refresh", refresh_fails)
        r = c.post("/documents", json={"documents": [doc]}, headers=AUTH)
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["added"], body["generation"], body["documents"], body["searchable"]) == (
            1, before["generation"] + 1, before["documents"] + 1, False)
        assert "committed (generation" in body["warning"]
        assert "segment file unreadable" in caplog.text
        d = c.request("DELETE", "/documents", json={"ids": ["late-1"]}, headers=AUTH)
        assert d.status_code == 200 and d.json()["generation"] == before["generation"] + 2, d.text
        monkeypatch.undo()
        again = c.post("/documents", json={"documents": [doc]}, headers=AUTH)  # nothing half-done is left behind
        assert again.status_code == 200 and "searchable" not in again.json(), again.text
        top = c.get("/search", params={"q": doc["text"], "k": 1}, headers=AUTH).json()
        assert top["hits"][0]["id"] == "late-1" and top["generation"] == before["generation"] + 3


def test_a_write_waits_for_the_write_in_progress_only_so_long(index_dir):
    """A second write waited for the first with no bound (holding a worker thread): now `lock_wait_s`, then a 503."""
    with client(index_dir, token=TOKEN, lock_wait_s=0.3) as c:
        writer = c.app.state.service.writer
        turn = writer._turn(lambda: False)
        turn.__enter__()  # a write in progress
        done = threading.Event()
        try:
            out: list = []
            t = threading.Thread(target=lambda: (out.append(c.post("/documents", headers=AUTH, json={
                "documents": [{"_id": "w-1", "text": "tea"}]})), done.set()))
            t.start()
            done.wait(10)
        finally:
            turn.__exit__(None, None, None)
        t.join(60)
        r = out[0]
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
        assert "another write is in progress" in r.json()["message"]
        assert c.get("/documents/w-1", headers=AUTH).status_code == 404
