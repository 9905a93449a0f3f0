"""`twotower serve`'s checks: bad flags are refused before anything loads, in the flag's own words."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket

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
