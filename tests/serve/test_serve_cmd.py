"""`twotower serve`'s checks: bad flags are refused before anything loads, in the flag's own words."""

from __future__ import annotations

import pytest

from tests.cli.cli_run import run_cli
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
    (["--index", "{index}", "--read-only", "--token-file", "{empty}"], "--read-only refuses them all"),
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
