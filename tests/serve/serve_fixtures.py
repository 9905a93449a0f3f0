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
    from twotower.serve.app import ServeConfig

    kw.setdefault("bf16", False)
    kw.setdefault("model", tiny_model_dir())
    kw.setdefault("use_default_reranker", False)
    return ServeConfig(index=index, **kw)


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
    """A real uvicorn server in a thread of this process, on a free loopback port: (base URL, app)."""
    import uvicorn

    from twotower.serve.app import create_app

    app = create_app(config(index, **kw))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
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
