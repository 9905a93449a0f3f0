"""Writes and reads at the same time: whole commits only, other processes' commits seen, writes serialised."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx

from tests.retrieval.pipeline_fixtures import tiny_model_dir, toy_docs
from tests.serve.serve_fixtures import AUTH, TOKEN, client, live_server, stats, wait_until
from twotower.indexing import IndexStore, document_text

ADDS = 4  # commits made while the searches run
PER_ADD = 5


def test_a_commit_by_another_process_is_picked_up_without_restart(index_dir):
    doc = {"_id": "outside-1", "title": "", "text": "black tea sugar milk cup"}
    script = (
        "import sys\n"
        "from twotower.retrieval import SearchPipeline\n"
        "with SearchPipeline.load(sys.argv[1], sys.argv[2], readonly=False, bf16=False) as p:\n"
        f"    p.add([{doc!r}])\n"
    )
    with client(index_dir) as c:
        before = stats(c)
        assert c.get(f"/documents/{doc['_id']}").status_code == 404
        # the server holds no write lock while idle, so another process can commit
        subprocess.run([sys.executable, "-c", script, index_dir, tiny_model_dir()], check=True, timeout=300)
        top = c.get("/search", params={"q": doc["text"], "k": 1}).json()
        assert top["hits"][0]["id"] == doc["_id"] and top["generation"] == before["generation"] + 1
        assert c.get(f"/documents/{doc['_id']}").json()["text"] == doc["text"]
        after = stats(c)
        assert (after["documents"], after["generation"]) == (before["documents"] + 1, before["generation"] + 1)


def test_stats_show_a_commit_by_another_process_at_once(index_dir):
    """/stats showed the count and generation of the commit before until a search or lookup moved the server."""
    with client(index_dir) as c:
        before = stats(c)
        with IndexStore.open(index_dir, readonly=False) as other:  # as `twotower index delete` would
            other.delete(["d0"])
        after = stats(c)
        assert (after["documents"], after["generation"]) == (before["documents"] - 1, before["generation"] + 1)


def test_searches_during_adds_answer_from_whole_commits(index_dir):
    new = toy_docs(ADDS * PER_ADD, seed=11, prefix="new")
    texts = {d["_id"]: d["text"] for d in new}
    queries = [document_text(d) for d in new]
    results, failures = [], []
    stop = threading.Event()

    with live_server(index_dir, token=TOKEN) as (url, app):
        g0 = app.state.service.owner.view.generation

        def search_loop():
            with httpx.Client(base_url=url, headers=AUTH, timeout=60) as h:
                while not stop.is_set():
                    r = h.post("/search", json={"queries": queries, "k": 3})
                    if r.status_code != 200:
                        failures.append(r.text)
                        return
                    results.append(r.json())

        workers = [threading.Thread(target=search_loop) for _ in range(3)]
        for w in workers:
            w.start()
        with httpx.Client(base_url=url, headers=AUTH, timeout=60) as h:
            for a in range(ADDS):
                part = new[a * PER_ADD:(a + 1) * PER_ADD]
                r = h.post("/documents", json={"documents": part})
                assert r.status_code == 200, r.text
                assert r.json()["generation"] == g0 + a + 1
                # searchable as soon as the add returned
                after = h.post("/search", json={"queries": [document_text(d) for d in part], "k": 1}).json()
                assert [x["hits"][0]["id"] for x in after["results"]] == [d["_id"] for d in part]
        stop.set()
        for w in workers:
            w.join(60)
    assert not failures
    assert len(results) >= 3
    seen = set()
    for body in results:
        g = body["generation"]
        assert g0 <= g <= g0 + ADDS
        seen.add(g)
        committed = {d["_id"] for d in new[:(g - g0) * PER_ADD]}  # what the commits up to g added
        for d, res in zip(new, body["results"]):
            hit_ids = {x["id"] for x in res["hits"]}
            assert not (hit_ids & set(texts)) - committed, "a document of a later commit was visible"
            if d["_id"] in committed:
                assert res["hits"][0]["id"] == d["_id"], "a committed document was missing"
            for x in res["hits"]:
                assert x["text"] is not None and (x["id"] not in texts or x["text"] == texts[x["id"]])
    assert len(seen) >= 2  # the searches did straddle the commits


def test_concurrent_writes_are_serialised(index_dir):
    batches = [toy_docs(6, seed=20 + i, prefix=f"w{i}-") for i in range(3)]
    codes = []
    with live_server(index_dir, token=TOKEN) as (url, app):
        before = app.state.service.owner.view

        def add(part):
            with httpx.Client(base_url=url, headers=AUTH, timeout=60) as h:
                codes.append(h.post("/documents", json={"documents": part}).status_code)

        threads = [threading.Thread(target=add, args=(b,)) for b in batches]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        after = app.state.service.owner.view
    assert codes == [200, 200, 200]
    assert (after.generation, after.documents) == (before.generation + 3, before.documents + 18)


def test_a_write_waits_for_another_writers_lock_then_gives_503(index_dir):
    doc = {"documents": [{"_id": "late", "text": "green tea"}]}
    with client(index_dir, token=TOKEN, lock_wait_s=0.3) as c:
        other = IndexStore.open(index_dir, readonly=False)  # as `twotower index add` would hold it
        try:
            r = c.post("/documents", json=doc, headers=AUTH)
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
            assert "another process" in r.json()["message"]
        finally:
            other.close()
        assert stats(c, AUTH)["documents"] == 40
        assert c.post("/documents", json=doc, headers=AUTH).status_code == 200


def _write_cut_off_by_the_shutdown(index_dir: str, monkeypatch, hold_commit: bool) -> tuple[httpx.Response, int]:
    """POST one document to a server stopped (grace 0.2 s) while the write is held — in its encoding, or in its
    commit (`hold_commit`) — until the writer has been told to stop: (the answer, the generation before)."""
    entered, release = threading.Event(), threading.Event()
    answers: list = []
    with live_server(index_dir, token=TOKEN, graceful_shutdown_s=0.2) as (url, app):
        service = app.state.service
        before = service.owner.view.generation
        owner, name = (IndexStore, "commit") if hold_commit else (service.owner.encoder, "encode_documents")
        run = getattr(owner, name)

        def held(*a, **kw):
            entered.set()
            assert release.wait(30)
            return run(*a, **kw)

        monkeypatch.setattr(owner, name, held)

        def add() -> None:
            with httpx.Client(base_url=url, headers=AUTH, timeout=60) as h:
                answers.append(h.post("/documents", json={"documents": [{"_id": "cut", "text": "green tea"}]}))

        thread = threading.Thread(target=add)
        thread.start()
        try:
            assert entered.wait(30), "the write never started"
            app.state.server.should_exit = True  # past the grace period the request is cancelled
            # (a server that does not wait for the write answers at once: then the answer is checked)
            wait_until(lambda: answers or getattr(service.writer, "stopping", False), "the writer was told to stop")
        finally:
            release.set()
            thread.join(60)
    return answers[0], before


def test_a_write_the_shutdown_cuts_off_before_its_commit_is_a_json_503_and_not_written(index_dir, monkeypatch):
    """Past uvicorn's graceful deadline a write was answered a plain-text 500 (the log: a CancelledError) while its
    thread went on. It stops at its next chunk of documents, before its commit, and says so."""
    r, before = _write_cut_off_by_the_shutdown(index_dir, monkeypatch, hold_commit=False)
    assert r.status_code == 503 and r.headers["content-type"] == "application/json"
    assert r.json()["message"].startswith("the server is stopping; nothing was written")
    with IndexStore.open(index_dir, readonly=True) as store:
        assert (store.generation, len(store), "cut" in store.vectors) == (before, 40, False)


def test_a_write_the_shutdown_cuts_off_in_its_commit_is_answered_as_committed(index_dir, monkeypatch):
    """A commit already under way finishes, and the client is told so (not "nothing was written")."""
    r, before = _write_cut_off_by_the_shutdown(index_dir, monkeypatch, hold_commit=True)
    assert r.status_code == 200, r.text
    assert r.json()["ids"] == ["cut"] and r.json()["generation"] == before + 1
    with IndexStore.open(index_dir, readonly=True) as store:
        assert (store.generation, len(store), "cut" in store.vectors) == (before + 1, 41, True)
