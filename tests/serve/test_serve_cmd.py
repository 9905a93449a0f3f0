"""`twotower serve`'s checks: bad flags are refused before anything loads, in the flag's own words."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.cli.cli_run import run_cli
from tests.serve.serve_fixtures import free_port
from twotower.cli.serve_cmd import _is_loopback


@pytest.mark.parametrize("argv, words", [
    (["--index", "{missing}"], "--index {missing}: no such directory"),
    (["--index", "{empty}"], "not an index directory (no manifest.json)"),
    (["--index", "{index}", "--port", "0"], "--port 0: must be between 1 and 65535"),
    (["--index", "{index}", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["--index", "{index}", "--batch-wait-ms", "-1"], "--batch-wait-ms must be a number >= 0, got -1"),
    (["--index", "{index}", "--batch-wait-ms", "nan"], "--batch-wait-ms must be a number >= 0, got nan"),
    (["--index", "{index}", "--max-body-mb", "0"], "--max-body-mb must be a number > 0, got 0"),
    (["--index", "{index}", "--max-body-mb", "nan"], "--max-body-mb must be a number > 0, got nan"),
    (["--index", "{index}", "--max-body-mb", "inf"], "--max-body-mb must be a number > 0, got inf"),  # OverflowError
    (["--index", "{index}", "--reranker", "{empty}"], "--reranker {empty}: not a model directory"),
    (["--index", "{index}", "--reranker", "{empty}", "--no-reranker"], "not both"),
    (["--index", "{index}", "--token-file", "{missing}"], "--token-file: {missing} not found"),
])
def test_bad_flags_are_refused_by_name(argv, words, tmp_path, index_template, capsys):
    paths = {"missing": str(tmp_path / "absent"), "empty": str(tmp_path), "index": index_template}
    rc, out, err = run_cli(capsys, "serve", *[a.format(**paths) for a in argv])
    assert rc == 2 and out == ""
    assert words.format(**paths) in err, err


def test_loopback_addresses():
    assert all(_is_loopback(h) for h in ("127.0.0.1", "127.8.9.10", "::1", "localhost"))
    assert not any(_is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.4", "example.org"))


def test_a_port_in_use_is_refused_before_anything_loads(index_template, capsys, monkeypatch):
    """uvicorn found the port taken only after the index and models had loaded, and the command then said
    "error: None"; the port is now bound first, and the error names the flag."""
    import twotower.serve.app as app

    monkeypatch.setattr(app, "create_app", lambda config: pytest.fail("the app was created"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        rc, out, err = run_cli(capsys, "serve", "--index", index_template, "--port", str(port))
    assert rc == 2 and f"--port {port}: cannot listen on 127.0.0.1:{port}: already in use" in err, err
    # an address that is not this machine's (TEST-NET-1, RFC 5737)
    rc, out, err = run_cli(capsys, "serve", "--index", index_template, "--host", "192.0.2.1", "--port", str(port))
    assert rc == 2 and f"--port {port}: cannot listen on 192.0.2.1:{port}: " in err, err


def test_an_index_that_fails_to_load_is_one_line_not_a_traceback(index_template, tmp_path, capsys, caplog):
    index = str(tmp_path / "index")
    shutil.copytree(index_template, index)
    with open(os.path.join(index, "manifest.json"), "w") as f:
        json.dump({}, f)  # damaged after the build: the directory check passes, loading fails
    rc, out, err = run_cli(capsys, "serve", "--index", index, "--port", str(free_port()), "--no-reranker",
                           "--threads", "1")
    assert rc == 1 and "Traceback" not in err, err
    # the log (stderr under the command) had the 20-line traceback of an expected failure at ERROR
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info], caplog.text
    assert [line for line in err.splitlines() if "error" in line.lower()] == [
        next(line for line in err.splitlines() if line.startswith("twotower serve: error: IndexFormatError: "))]


def _wait_for(path, words: str, proc, seconds: float = 120.0) -> str:
    """The stderr written to `path` once it holds `words` (the server still running until then)."""
    deadline = time.monotonic() + seconds
    while True:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if words in text:
            return text
        assert proc.poll() is None or words in text, f"twotower serve exited ({proc.returncode}): {text}"
        assert time.monotonic() < deadline, f"no {words!r} from twotower serve: {text}"
        time.sleep(0.05)


def test_sigterm_answers_the_request_in_flight_says_so_and_exits_as_the_signal(index_template, tmp_path):
    """`twotower serve` stopped by SIGTERM exited without a word. It still shuts down as uvicorn does (exit status
    that of the signal: 143 in a shell) but says that it is stopping and that it stopped, and a request it was
    reading when the signal came is answered. Deterministic: the request asks for ``100 Continue``, which the
    server sends once the app reads the body, so the request is in flight before the signal; its body is sent
    only after the server said it is stopping."""
    from tests.retrieval.pipeline_fixtures import tiny_model_dir

    err = tmp_path / "serve.err"
    port = free_port()
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "twotower", "serve", "--index", index_template, "--model",
                                 tiny_model_dir(), "--no-reranker", "--threads", "1", "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=stderr, env={**os.environ, "TWOTOWER_TOKEN": ""})
    try:
        _wait_for(err, "twotower serve: ready", proc)
        body = json.dumps({"queries": ["tea"], "k": 3}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
            conn.sendall(f"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode())
            assert conn.recv(1024).startswith(b"HTTP/1.1 100 ")  # the app is reading the body
            proc.send_signal(signal.SIGTERM)
            _wait_for(err, "stopping (SIGTERM)", proc, seconds=30)
            conn.sendall(body)
            response = b""
            while chunk := conn.recv(65536):  # the server closes the connection after answering
                response += chunk
        head, _, payload = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 "), response
        assert len(json.loads(payload)["results"][0]["hits"]) == 3
        assert proc.wait(60) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = err.read_text(encoding="utf-8").splitlines()
    assert lines[-2:] == ["twotower serve: stopping (SIGTERM): finishing requests in flight",
                          "twotower serve: stopped"], lines


def test_the_server_bounds_its_shutdown_connections_and_request_heads(index_template, capsys, monkeypatch):
    """uvicorn ran with its defaults: no bound on connections, none on a request head's arrival, and a graceful
    shutdown that waited for a stalled request for ever (one slow body kept the process alive after SIGTERM)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    import twotower.cli.serve_cmd as serve_cmd

    seen = {}

    class Server:  # records the configuration instead of serving
        def __init__(self, config):
            seen["config"] = config

        def run(self, sockets=None):
            pass

    monkeypatch.setattr(serve_cmd, "_server_class", lambda uvicorn: Server)
    rc, out, err = run_cli(capsys, "serve", "--index", index_template, "--port", str(free_port()), "--no-reranker",
                           "--threads", "1")
    assert rc == 0, err
    config = seen["config"]
    assert config.timeout_graceful_shutdown == 30 and config.limit_concurrency == 512
    assert config.h11_max_incomplete_event_size == 16 * 1024
    assert isinstance(config.http, type) and issubclass(config.http, H11Protocol)  # with the request-head deadline
