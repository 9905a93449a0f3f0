"""Helpers for the service tests: apps over TestClient, a live uvicorn server in a thread, and constants."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from tests.retrieval.pipeline_fixtures import tiny_model_dir

TOKEN = "test-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def config(index: str, **kw):
    """A `ServeConfig` for the tiny model; `kw` set as attributes (what a server of an older tree lacks is then
    ignored by it, rather than a TypeError here: the tests fail on its behaviour)."""
    from twotower.serve.app import ServeConfig

    kw.setdefault("bf16", False)
    kw.setdefault("model", tiny_model_dir())
    kw.setdefault("use_default_reranker", False)
    cfg = ServeConfig(index=index)
    for name, value in kw.items():
        setattr(cfg, name, value)
    return cfg


@contextlib.contextmanager
def client(index: str, wait: bool = True, raise_server_exceptions: bool = True, **kw) -> Iterator:
    """A TestClient over a fresh app (its lifespan runs: the model owner loads the index)."""
    from fastapi.testclient import TestClient

    from twotower.serve.app import create_app

    app = create_app(config(index, **kw))
    with TestClient(app, raise_server_exceptions=raise_server_exceptions) as c:
        if wait:
            assert app.state.service.owner.wait_ready(60), app.state.service.owner.error
        yield c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(index: str, **kw) -> Iterator[tuple[str, object]]:
    """A real uvicorn server in a thread of this process, on a free loopback port: (base URL, app), configured as
    `twotower serve` configures it (`uvicorn_config`: its max_connections, head_timeout_s and graceful_shutdown_s
    may be given here)."""
    import uvicorn

    from twotower.serve.app import create_app
    from twotower.serve.server import uvicorn_config

    server_kw = {name: kw.pop(name) for name in ("max_connections", "head_timeout_s", "graceful_shutdown_s")
                 if name in kw}
    app = create_app(config(index, **kw))
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, **server_kw))
    app.state.server = server  # a test may stop it (server.should_exit) or count its connections
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        assert app.state.service.owner.wait_ready(60), app.state.service.owner.error
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(30)


def stats(c, headers=None) -> dict:
    r = c.get("/stats", headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()


def hold(owner) -> threading.Event:
    """Keep the model owner busy in a job until the returned event is set (so that requests queue up)."""
    release, busy = threading.Event(), threading.Event()

    def wait(pipe):
        busy.set()
        release.wait(60)

    owner.call(wait)
    assert busy.wait(30)
    return release


def wait_until(check, what: str, seconds: float = 20.0) -> None:
    """Poll `check()` until it is true; fail naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def read_answer(conn: socket.socket) -> tuple[bytes, bytes]:
    """(status line and headers, body) of the answer on a raw connection, read until the server closes it."""
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body
