"""How a write ends when it is cancelled or the server stops: the answer it gets, the threads it holds, the writes
after it.  Hooks and events, not sleeps: each test waits for the exact point it means."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import httpx
import pytest

from tests.serve.serve_fixtures import AUTH, TOKEN, client, config, live_server, stats, wait_until
from twotower.indexing import IndexStore


def _service(index_dir: str):
    from twotower.serve.app import SearchService

    return SearchService(config(index_dir, token=TOKEN))  # its model owner is not started: writes run as given


def _job(release: threading.Event, cuts: list):
    """A write that returns "committed" once `release` is set; it keeps what stops it (`cuts`)."""

    def job(*cut):
        cuts.extend(cut)
        assert release.wait(30)
        return "committed"

    return job


def test_a_cancel_landing_after_the_write_returned_is_answered_with_what_it_returned(index_dir):
    """The cancel came after the write's thread had returned but before the handler resumed: the handler raised
    CancelledError (a plain-text 500 for a committed write), and what the write returned was never read."""
    service = _service(index_dir)
    release = threading.Event()

    async def main():
        task = asyncio.ensure_future(service.write(_job(release, [])))
        await asyncio.sleep(0)  # the handler is waiting for the write now
        running = next(iter(service._running))
        running.add_done_callback(lambda f: task.cancel())  # after the write returned, before the handler resumes
        release.set()
        return await task

    assert asyncio.run(main()) == "committed"


def test_a_write_cancelled_twice_is_waited_for_and_stops_only_itself(index_dir):
    """A second cancel cancelled the future the handler waited on while the write's thread went on writing (and
    `stop_writes` stopped waiting for it); and any cancel, a shutdown or not, turned writes off until a restart."""
    service = _service(index_dir)
    release, cuts = threading.Event(), []

    async def main():
        task = asyncio.ensure_future(service.write(_job(release, cuts)))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0)  # the handler takes the first cancel and waits again
        task.cancel()
        await asyncio.sleep(0)
        assert not task.done(), "the handler stopped waiting for its write"
        release.set()
        return await task

    assert asyncio.run(main()) == "committed"
    assert cuts and cuts[0].is_set()  # the cancelled write was told to stop
    assert not service.writer.stopping  # the writes after it are not


def test_a_write_that_waited_for_a_thread_past_its_deadline_is_a_503_at_once(index_dir, monkeypatch):
    """The deadline started when a thread took the write: behind `WRITE_THREADS` others, a write waited lock_wait_s
    for each round of them (9 writes, lock_wait_s 0.5: 503s at 0.5, 1.0 and 1.5 s).  It starts at submission now."""
    from twotower.serve import app as app_module
    from twotower.serve.app import SearchService
    from twotower.serve.errors import ApiError

    service = SearchService(config(index_dir, token=TOKEN, lock_wait_s=0.05))
    writer = service.writer
    waits: list = []
    wait = writer._turns.wait
    monkeypatch.setattr(writer._turns, "wait", lambda timeout=None: (waits.append(timeout), wait(timeout))[1])
    release = threading.Event()

    async def main():
        with writer._turn(lambda: False):  # a write in progress
            blockers = [asyncio.ensure_future(service.write(_job(release, []))) for _ in range(app_module.WRITE_THREADS)]
            late = asyncio.ensure_future(service.write(lambda cut, *deadline: writer.delete(["d0"], cut, *deadline)))
            await asyncio.sleep(0)  # submitted: its deadline is set
            submitted = time.monotonic()
            while time.monotonic() <= submitted + writer.lock_wait_s:  # past it, still waiting for a thread
                await asyncio.sleep(0.01)
            release.set()
            await asyncio.gather(*blockers)
            with pytest.raises(ApiError, match="another write is in progress") as e:
                await late
        return e.value

    assert asyncio.run(main()).status_code == 503
    assert waits == []  # answered when a thread took it, without waiting lock_wait_s more
    service._write_threads.shutdown(wait=False)


def test_a_write_submitted_after_the_writes_stopped_is_write_stopped(index_dir):
    """It reached the shut-down pool of write threads: a RuntimeError, a plain 500."""
    from twotower.serve.writer import WriteStopped

    service = _service(index_dir)

    async def main():
        await service.stop_writes()
        with pytest.raises(WriteStopped):
            await service.write(_job(threading.Event(), []))

    asyncio.run(main())


def test_a_write_stopped_while_it_waited_for_a_thread_parses_nothing(index_dir, monkeypatch):
    """A write the shutdown stopped before a thread took it parsed its documents (a 400 for a bad one) first."""
    with client(index_dir, token=TOKEN) as c:
        writer = c.app.state.service.writer
        deadline = writer.deadline

        def stopping_now():  # the server stops after the write was submitted, before a thread takes it
            writer.stop()
            return deadline()

        monkeypatch.setattr(writer, "deadline", stopping_now)
        r = c.post("/documents", json={"documents": [{"text": "no id"}]}, headers=AUTH)
    assert r.status_code == 503, r.text
    assert r.json()["message"].startswith("the server is stopping; nothing was written")


def test_the_shutdown_does_not_wait_for_a_client_that_does_not_read_its_answer(index_dir, monkeypatch):
    """`stop_writes` waited without a bound for the writes' requests: one whose write had returned but whose client
    did not read its answer (over the socket's buffer) held the shutdown for ever."""
    from twotower.serve import app as app_module

    monkeypatch.setattr(app_module, "STOP_ANSWERS_S", 0.01, raising=False)
    service = _service(index_dir)

    async def main():
        answered, unread = asyncio.Event(), asyncio.Event()

        async def request():  # as uvicorn's task: the write, then sending an answer nobody reads
            await service.write(lambda *cut: "committed")
            answered.set()
            await unread.wait()

        task = asyncio.ensure_future(request())
        await answered.wait()
        try:
            await asyncio.wait_for(service.stop_writes(), 30)
        finally:
            unread.set()
            await task

    asyncio.run(main())


def test_writes_run_on_threads_of_their_own(index_dir):
    """Writes ran on asyncio's default pool (6 threads on 2 cores), where one waiting for its turn held a thread up
    to lock_wait_s and the shutdown's `ModelOwner.stop` waited behind them."""
    names = []
    with client(index_dir, token=TOKEN) as c:
        writer = c.app.state.service.writer
        delete = writer.delete
        writer.delete = lambda *a: (names.append(threading.current_thread().name), delete(*a))[1]
        r = c.request("DELETE", "/documents", json={"ids": ["d0"]}, headers=AUTH)
        assert r.status_code == 200, r.text
    assert names and names[0].startswith("twotower-write")


def _waits_for(writer, where: str, monkeypatch) -> threading.Event:
    """An event set once a write of `writer` waits: for its turn (`where` "turn"), or for another writer's lock."""
    import twotower.serve.writer as writer_module

    waiting = threading.Event()
    if where == "turn":
        wait = writer._turns.wait

        def turn_wait(timeout=None):
            waiting.set()
            return wait(timeout)

        monkeypatch.setattr(writer._turns, "wait", turn_wait)
    else:
        wait_for_lock = writer_module.wait_for_lock

        def locked(open_writer, *a, **kw):
            def opening():
                try:
                    return open_writer()
                except Exception:
                    waiting.set()
                    raise

            return wait_for_lock(opening, *a, **kw)

        monkeypatch.setattr(writer_module, "wait_for_lock", locked)
    return waiting


def _run(fn) -> tuple[threading.Thread, list]:
    out: list = []

    def target():
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    return thread, out


@pytest.mark.parametrize("how", ["stop", "stop_write"])
def test_a_write_waiting_for_the_write_in_progress_stops_at_once(index_dir, how, monkeypatch):
    """A second write waited in the lock's acquire for up to lock_wait_s, deaf to the stop."""
    from twotower.serve.writer import IndexWriter, WriteStopped

    writer = IndexWriter(index_dir, None, lock_wait_s=60)
    waiting = _waits_for(writer, "turn", monkeypatch)
    cut = threading.Event()
    with writer._turn(lambda: False):  # a write in progress
        thread, out = _run(lambda: writer.delete(["d0"], cut))
        assert waiting.wait(30)
        writer.stop() if how == "stop" else writer.stop_write(cut)
        thread.join(10)
        assert not thread.is_alive(), "the waiting write did not stop"
    assert isinstance(out[0], WriteStopped)
    assert writer.stopping == (how == "stop")
    with IndexStore.open(index_dir, readonly=True) as store:
        assert "d0" in store.vectors


@pytest.mark.parametrize("how", ["stop", "stop_write"])
def test_a_write_waiting_for_another_processs_lock_stops_at_once(index_dir, how, monkeypatch):
    from twotower.serve.writer import IndexWriter, WriteStopped

    writer = IndexWriter(index_dir, None, lock_wait_s=60)
    waiting = _waits_for(writer, "lock", monkeypatch)
    cut = threading.Event()
    other = IndexStore.open(index_dir, readonly=False)  # as `twotower index add` would hold it
    try:
        thread, out = _run(lambda: writer.delete(["d0"], cut))
        assert waiting.wait(30)
        writer.stop() if how == "stop" else writer.stop_write(cut)
        thread.join(10)
        assert not thread.is_alive(), "the waiting write did not stop"
    finally:
        other.close()
    assert isinstance(out[0], WriteStopped)
    with IndexStore.open(index_dir, readonly=True) as store:
        assert "d0" in store.vectors


def test_a_stopped_write_queues_nothing_to_encode():
    """`encode_documents` queued every chunk for the model owner even when the stop was already set."""
    from twotower.serve.writer import OwnerEncoder, WriteStopped

    class Owner:
        encoder_describe = {"dim": 4}
        calls = 0

        def call(self, *a, **kw):
            Owner.calls += 1
            raise AssertionError("queued")

    with pytest.raises(WriteStopped):
        OwnerEncoder(Owner(), stopped=lambda: True).encode_documents(["a", "b"])
    assert Owner.calls == 0


def test_a_delete_the_shutdown_cuts_off_before_its_commit_is_a_json_503_and_not_written(index_dir, monkeypatch):
    """A DELETE waiting for another process's lock when the server stops is answered 503 "nothing was written"."""
    answers: list = []
    with live_server(index_dir, token=TOKEN, graceful_shutdown_s=0.2, lock_wait_s=60) as (url, app):
        writer = app.state.service.writer
        waiting = _waits_for(writer, "lock", monkeypatch)
        other = IndexStore.open(index_dir, readonly=False)
        try:
            def delete() -> None:
                with httpx.Client(base_url=url, headers=AUTH, timeout=60) as h:
                    answers.append(h.request("DELETE", "/documents", json={"ids": ["d0"]}))

            thread = threading.Thread(target=delete)
            thread.start()
            assert waiting.wait(30)
            app.state.server.should_exit = True
            thread.join(30)
        finally:
            other.close()
    r = answers[0]
    assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["message"].startswith("the server is stopping; nothing was written")
    with IndexStore.open(index_dir, readonly=True) as store:
        assert "d0" in store.vectors


@pytest.mark.parametrize("seconds", [math.nan, math.inf, -1.0])
def test_a_lock_wait_that_never_ends_or_is_negative_is_refused(index_dir, seconds):
    """NaN seconds waited for ever (every comparison with it is false), inf too; the server took either."""
    from twotower.indexing.store import wait_for_lock
    from twotower.serve.app import create_app

    with pytest.raises(ValueError, match="must be a number of seconds >= 0"):
        wait_for_lock(lambda: "opened", seconds)
    with pytest.raises(ValueError, match="lock_wait_s must be a number of seconds >= 0"):
        create_app(config(index_dir, lock_wait_s=seconds))


# ---------------------------------------------------------------------- /stats and another process's commit
def test_stats_answer_at_once_while_the_owner_is_busy_and_say_a_newer_commit_exists(index_dir, monkeypatch):
    """/stats after another process's commit waited for the owner (up to request_timeout_s, then a 503)."""
    from tests.serve.serve_fixtures import hold
    from twotower.serve import app as app_module

    monkeypatch.setattr(app_module, "STATS_MOVE_WAIT_S", 0.05)
    with client(index_dir, request_timeout_s=5) as c:
        before = stats(c)
        assert before["newest_generation"] == before["generation"]
        release = hold(c.app.state.service.owner)  # (any job of the owner first moves it to the newest commit)
        try:
            with IndexStore.open(index_dir, readonly=False) as other:
                other.delete(["d0"])
            busy = stats(c)
        finally:
            release.set()
        assert (busy["generation"], busy["newest_generation"]) == (before["generation"], before["generation"] + 1)
        monkeypatch.setattr(app_module, "STATS_MOVE_WAIT_S", 30.0)  # the owner is free: the move is waited for
        after = stats(c)
        assert (after["documents"], after["generation"]) == (before["documents"] - 1, before["generation"] + 1)


def test_stats_do_not_retry_a_commit_that_failed_to_load(index_dir, caplog, monkeypatch):
    """Each /stats made the owner try the commit again, with a traceback in the log each time."""
    from twotower.serve import app as app_module

    monkeypatch.setattr(app_module, "STATS_MOVE_WAIT_S", 30.0)  # the first /stats waits for the (failed) move
    with client(index_dir) as c:
        owner = c.app.state.service.owner
        before = stats(c)
        store = owner._pipe.store
        tries = []

        def refresh_fails(*a, **kw):
            tries.append(1)
            raise OSError("segment file unreadable")

        store.refresh = refresh_fails
        with IndexStore.open(index_dir, readonly=False) as other:
            other.delete(["d0"])
        first, second = stats(c), stats(c)
        assert len(tries) == 1
        assert first["generation"] == second["generation"] == before["generation"]
        assert second["newest_generation"] == before["generation"] + 1
        del store.refresh
        wait_until(lambda: c.get("/search", params={"q": "tea"}).json()["generation"] == before["generation"] + 1,
                   "a search moved the server (searches retry)")


def test_stats_answer_while_the_owner_is_stopping(index_dir):
    """/stats after another process's commit made the stopping owner a job, refused with a 503."""
    from tests.serve.serve_fixtures import hold

    with client(index_dir) as c:
        owner = c.app.state.service.owner
        release = hold(owner)  # the owner's thread is in this job: it cannot see the flag (and end) before it is reset
        with IndexStore.open(index_dir, readonly=False) as other:
            other.delete(["d0"])
        with owner._cond:
            owner._stopping = True  # as `ModelOwner.stop` sets it, before the owner's thread has ended
        try:
            r = c.get("/stats")
        finally:
            with owner._cond:
                owner._stopping = False
            release.set()
        assert r.status_code == 200, r.text
        assert r.json()["newest_generation"] == r.json()["generation"] + 1


def test_polling_stats_while_the_owner_is_busy_counts_nothing_abandoned_or_refused(index_dir, monkeypatch):
    """Each /stats whose wait for the move timed out withdrew its job (counted "abandoned"), and a full queue of
    lookups refused it (counted "refused", with no 503): the counters of clients' requests grew with polling."""
    from tests.serve.serve_fixtures import hold
    from twotower.serve import app as app_module

    monkeypatch.setattr(app_module, "STATS_MOVE_WAIT_S", 0.01)
    with client(index_dir, max_queued=1) as c:
        before = stats(c)
        release = hold(c.app.state.service.owner)
        try:
            with IndexStore.open(index_dir, readonly=False) as other:
                other.delete(["d0"])
            polled = [stats(c) for _ in range(3)]
        finally:
            release.set()
        assert all(p["generation"] == before["generation"] for p in polled)
        monkeypatch.setattr(app_module, "STATS_MOVE_WAIT_S", 30.0)
        after = stats(c)
    assert after["generation"] == before["generation"] + 1
    assert (after["batching"]["abandoned"], after["batching"]["refused"]) == (0, 0)


def test_the_newest_generation_of_a_stopped_owner_is_none(index_dir):
    """The owner closes its probe when it stops: reading it then raised (a 500 for a /stats in that moment)."""
    with client(index_dir) as c:
        owner = c.app.state.service.owner
        assert owner.newest_generation() == stats(c)["generation"]
    assert owner.newest_generation() is None
