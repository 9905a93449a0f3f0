"""The model owner: queued searches share one batch and give the answers of one search each; loading states."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from tests.retrieval.pipeline_fixtures import tiny_model_dir
from tests.serve.serve_fixtures import client, hold, wait_until
from twotower.retrieval import SearchPipeline
from twotower.serve.batcher import ModelOwner, SearchParams
from twotower.serve.errors import ApiError

QUERIES = ["tea coffee", "gene protein", "mouse brain tumor", "drug dose", "cold water cup", "risk study effect"]


def _loader(index: str, reranker: str | None = None):
    return lambda: SearchPipeline.load(index, tiny_model_dir(), reranker=reranker, use_default_reranker=False,
                                       bf16=False)


def test_queued_searches_share_a_batch_and_match_single_searches(index_template, reranker_dir):
    owner = ModelOwner(_loader(index_template, reranker_dir), threads=1, max_wait_ms=0).start()
    try:
        assert owner.wait_ready(60)
        release = hold(owner)
        asks = [(q, SearchParams(k=1 + i % 4, recall_k=12, hybrid=i % 2 == 1, rerank=i % 3 == 0))
                for i, q in enumerate(QUERIES)]
        futures = [owner.search([q], p) for q, p in asks]
        batch = owner.search(QUERIES[:3], SearchParams(k=5, recall_k=12, hybrid=True, rerank=True))
        release.set()
        answers = [f.result(30) for f in futures]
        groups = {p.group for _, p in asks} | {SearchParams(k=5, recall_k=12, hybrid=True, rerank=True).group}
        assert owner.batches == len(groups)  # one pipeline search per (recall_k, hybrid, rerank), not per request
        assert owner.max_batch_seen >= 2
        with _loader(index_template, reranker_dir)() as ref:
            for (q, p), a in zip(asks, answers):
                want = ref.search(q, k=p.k, recall_k=p.recall_k, hybrid=p.hybrid, rerank=p.rerank)
                assert [h.id for h in a.hits[0]] == [h.id for h in want]
                assert [h.score for h in a.hits[0]] == pytest.approx([h.score for h in want], rel=1e-5, abs=1e-6)
                assert a.generation == ref.store.generation
            want = ref.search(QUERIES[:3], k=5, recall_k=12, hybrid=True, rerank=True)
            assert [[h.id for h in row] for row in batch.result(30).hits] == [[h.id for h in row] for row in want]
    finally:
        owner.stop()


def test_a_bm25_search_is_not_batched_with_a_dense_or_hybrid_one(index_template):
    """Queued with dense and hybrid searches asking for the same otherwise, a bm25 search is its own pipeline call
    (BM25's hits, not the dense ones of the batch it would have joined), and equal bm25 searches share one."""
    owner = ModelOwner(_loader(index_template), threads=1, max_wait_ms=0).start()
    try:
        assert owner.wait_ready(60)
        kinds = {"dense": SearchParams(k=4, recall_k=12), "hybrid": SearchParams(k=4, recall_k=12, hybrid=True),
                 "bm25": SearchParams(k=4, recall_k=12, bm25=True)}
        assert len({p.group for p in kinds.values()}) == 3
        release = hold(owner)
        futures = {(name, q): owner.search([q], p) for q in QUERIES[:2] for name, p in kinds.items()}
        release.set()
        answers = {key: f.result(30).hits[0] for key, f in futures.items()}
        assert owner.batches == 3  # one pipeline search per first stage, each holding both queries
        with _loader(index_template)() as ref:
            for (name, q), hits in answers.items():
                want = ref.search(q, k=4, recall_k=12, hybrid=name == "hybrid", bm25=name == "bm25")
                assert [h.id for h in hits] == [h.id for h in want], (name, q)
            lexical = [h.id for h in ref.search(QUERIES[0], k=4, recall_k=12, bm25=True)]
        assert lexical != [h.id for h in answers["dense", QUERIES[0]]]  # the test could tell them apart
    finally:
        owner.stop()


def test_a_request_that_fails_its_batch_fails_alone(index_template):
    """One request whose query the pipeline refuses, queued with others asking the same: the others get their
    hits (as one batch would have given them) and only that request gets the error. Before, every request of
    the batch got it: a lone surrogate from one client made the searches of everyone else a 500."""
    owner = ModelOwner(_loader(index_template), threads=1, max_wait_ms=0).start()
    try:
        assert owner.wait_ready(60)
        release = hold(owner)
        params = SearchParams(k=3, recall_k=12)
        good = [owner.search([q], params) for q in QUERIES[:2]]
        bad = owner.search(["tea \ud800"], params)
        last = owner.search(QUERIES[2:4], params)
        release.set()
        with pytest.raises(ValueError, match="lone surrogate"):
            bad.result(30)
        answers = [f.result(30).hits for f in good] + [last.result(30).hits]
        with _loader(index_template)() as ref:
            want = [ref.search([q], k=3, recall_k=12) for q in QUERIES[:2]] + [ref.search(QUERIES[2:4], k=3, recall_k=12)]
        assert [[[h.id for h in row] for row in a] for a in answers] == [[[h.id for h in row] for row in w] for w in want]
    finally:
        owner.stop()


def test_waits_for_the_rest_of_a_batch_only_under_load(index_template):
    owner = ModelOwner(_loader(index_template), threads=1, max_wait_ms=2000).start()
    try:
        assert owner.wait_ready(60)
        start = time.monotonic()
        owner.search(["tea"], SearchParams()).result(30)
        assert time.monotonic() - start < 1.5  # one client alone: its last batch held one query, no waiting
        release = hold(owner)
        first = [owner.search([q], SearchParams()) for q in QUERIES[:4]]
        release.set()
        for f in first:
            f.result(30)  # one batch of 4: now the owner expects 4 at a time
        batches = owner.batches
        early = owner.search([QUERIES[4]], SearchParams())

        def later():
            time.sleep(0.1)
            for q in QUERIES[:3]:
                owner.search([q], SearchParams())

        t = threading.Thread(target=later)
        t.start()
        early.result(30)
        t.join()
        assert owner.batches == batches + 1  # the early query waited for the three that came 0.1 s later
    finally:
        owner.stop()


def test_the_owner_runs_torch_and_faiss_with_its_thread_count(index_template):
    import faiss

    before = (torch.get_num_threads(), faiss.omp_get_max_threads())
    owner = ModelOwner(_loader(index_template), threads=1).start()
    assert owner.wait_ready(60)
    assert owner.call(lambda pipe: (torch.get_num_threads(), faiss.omp_get_max_threads())).result(30) == (1, 1)
    owner.stop()
    assert (torch.get_num_threads(), faiss.omp_get_max_threads()) == before


def test_503_while_loading_then_ready(index_template, monkeypatch):
    loaded = threading.Event()
    real = SearchPipeline.load.__func__

    def slow_load(cls, *a, **kw):
        assert loaded.wait(30)
        return real(cls, *a, **kw)

    monkeypatch.setattr(SearchPipeline, "load", classmethod(slow_load))
    with client(index_template, wait=False) as c:
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "loading" and h.headers["retry-after"] == "2"
        r = c.get("/search", params={"q": "tea"})
        assert r.status_code == 503 and r.json()["error"] == "unavailable" and r.headers["retry-after"] == "2"
        assert c.get("/stats").status_code == 503
        assert c.get("/").status_code == 200  # the page itself is there at once, and says "loading"
        loaded.set()
        assert c.app.state.service.owner.wait_ready(60)
        assert c.get("/health").status_code == 200
        assert c.get("/search", params={"q": "tea"}).status_code == 200


def test_a_failed_load_is_reported_not_raised(tmp_path):
    bad = tmp_path / "idx"
    bad.mkdir()
    (bad / "manifest.json").write_text("{not json")
    with client(str(bad), wait=False) as c:
        owner = c.app.state.service.owner
        assert owner.wait_ready(60) is False
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "failed" and "manifest.json" in h.json()["error"]
        assert "retry-after" not in h.headers  # retrying cannot mend a failed load
        r = c.get("/search", params={"q": "tea"})
        assert r.status_code == 503 and "could not be loaded" in r.json()["message"]


def test_stop_refuses_what_is_queued(index_template):
    owner = ModelOwner(_loader(index_template), threads=1).start()
    assert owner.wait_ready(60)
    release = hold(owner)
    queued = owner.search(["tea"], SearchParams())
    stopper = threading.Thread(target=owner.stop)
    stopper.start()
    release.set()
    stopper.join(30)
    with pytest.raises(ApiError) as err:
        queued.result(30)
    assert err.value.status_code == 503
    with pytest.raises(ApiError):
        owner.search(["tea"], SearchParams())


def test_default_threads_leave_a_core_to_the_event_loop_only_with_bf16(monkeypatch):
    from twotower.serve.batcher import default_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert default_threads(bf16=False) == 4
    assert default_threads(bf16=True) == 3
    monkeypatch.setenv("TWOTOWER_BF16", "0")  # no bf16 whatever the CPU: fp32, so every core
    assert default_threads() == 4
    monkeypatch.setenv("TWOTOWER_BF16", "0")  # "auto" resolves to fp32
    assert default_threads() == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert default_threads(bf16=True) == 1  # never zero


def test_a_full_queue_refuses_searches_at_once_and_withdrawn_ones_free_their_place(index_template):
    """The queue had no bound: 20 clients each sending 64 queries and giving up after 50 ms made the owner run all
    1,282 queries, and the next search waited 25 s behind them. At most 4 x max_batch queries wait now (one search
    always fits an empty queue); past that a search is refused at once with a 503 and Retry-After, and a search
    cancelled while it waits leaves the count at once and is never run."""
    owner = ModelOwner(_loader(index_template), threads=1, max_batch=2, max_wait_ms=0).start()
    try:
        assert owner.wait_ready(60)
        release = hold(owner)
        params = SearchParams(k=2, recall_k=12)
        first = owner.search(QUERIES[:3], params)
        second = owner.search(QUERIES[3:6], params)  # 6 of 8 queued
        with pytest.raises(ApiError) as err:
            owner.search(QUERIES[:3], params)  # 9 > 8
        assert err.value.status_code == 503 and err.value.headers["Retry-After"] == "1"
        assert "busy" in err.value.detail
        third = owner.search(QUERIES[:2], params)  # exactly 8
        assert first.cancel()  # its client went away: 5 queued, 3 more fit
        fourth = owner.search(QUERIES[2:5], params)
        release.set()
        assert [len(f.result(30).hits) for f in (second, third, fourth)] == [3, 2, 3]
        assert first.cancelled() and owner.batched_queries == 8  # the withdrawn search never ran
        assert owner.batch_stats()["refused"] == 1 and owner.batch_stats()["abandoned"] == 1
        # a search larger than the whole queue is still answered when nothing waits
        assert len(owner.search(QUERIES * 2, params).result(30).hits) == 12
    finally:
        owner.stop()


def test_a_cancelled_search_never_stops_the_owner(index_template, monkeypatch):
    """A failed move to a new commit answered each queued search with `set_exception`, a search cancelled by its
    waiter included: `InvalidStateError` then ended the model owner's thread, and every later request got 503s.
    Searches are marked running when the owner takes them, withdrawn ones are dropped, and every answer is given
    through a guard."""
    owner = ModelOwner(_loader(index_template), threads=1, max_wait_ms=0).start()
    try:
        assert owner.wait_ready(60)
        release = hold(owner)
        params = SearchParams(k=2, recall_k=12)
        waiting, gone = owner.search(["gene"], params), owner.search(["tea"], params)
        assert gone.cancel()
        real = owner._refresh
        fails = iter([True])

        def refresh_once(force=False):
            if next(fails, False):
                raise RuntimeError("the new commit could not be read")
            return real(force)

        monkeypatch.setattr(owner, "_refresh", refresh_once)
        release.set()
        with pytest.raises(RuntimeError, match="could not be read"):
            waiting.result(30)
        assert gone.cancelled()
        assert len(owner.search(["tea"], params).result(30).hits[0]) == 2  # the owner is still serving
        assert owner.state == "ready"
    finally:
        owner.stop()


def test_a_lookup_during_a_large_add_runs_before_the_adds_remaining_chunks(index_dir, monkeypatch):
    """Owner jobs ran first come, first served: during a 256-document add, GET /documents/ID waited 22 s behind every
    encoding chunk of the add. The chunks are background jobs now: a lookup queued after them runs next."""
    from tests.retrieval.pipeline_fixtures import toy_docs
    from tests.serve.serve_fixtures import AUTH, TOKEN
    from twotower.serve.writer import ENCODE_CHUNK

    ran: list[str] = []
    with client(index_dir, token=TOKEN) as c:
        owner = c.app.state.service.owner
        real = owner._run_call

        def record(call):
            ran.append(os.path.basename(call.fn.__code__.co_filename))  # app.py: the lookup; writer.py: a chunk
            real(call)

        monkeypatch.setattr(owner, "_run_call", record)
        release = hold(owner)
        new = toy_docs(2 * ENCODE_CHUNK + 1, seed=5, prefix="big")  # three chunks
        write = threading.Thread(target=lambda: c.post("/documents", json={"documents": new}, headers=AUTH))
        write.start()

        def queued() -> int:
            return len(owner._calls) + len(getattr(owner, "_background", ()))

        wait_until(lambda: queued() == 3, "the add's three chunks are queued")
        lookup = threading.Thread(target=lambda: ran.append(c.get("/documents/d1", headers=AUTH).status_code))
        lookup.start()
        wait_until(lambda: queued() == 4, "the lookup is queued after them")
        release.set()
        lookup.join(60)
        write.join(60)
    chunks_and_lookup = [name for name in ran if name in ("app.py", "writer.py")]
    assert chunks_and_lookup == ["app.py", "writer.py", "writer.py", "writer.py"], ran
