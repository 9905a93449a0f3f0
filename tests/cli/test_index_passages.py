"""`twotower index build --passages` and the commands around it speak documents, not passage rows."""

from __future__ import annotations

import json

from tests.cli.cli_run import run_cli
from tests.retrieval.pipeline_fixtures import tiny_model_dir, write_corpus
from tests.retrieval.test_passages import corpus_docs


def test_build_info_search_delete_with_passages(tmp_path, capsys):
    corpus = write_corpus(str(tmp_path / "c.jsonl"), corpus_docs())
    idx = str(tmp_path / "idx")
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--out", idx, "--model", tiny_model_dir(),
                         "--no-progress", "--passages", "--passage-window", "100")
    assert rc == 2 and "--passage-window" in err and "at most 38" in err
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--out", idx, "--model", tiny_model_dir(),
                         "--passage-window", "16")
    assert rc == 2 and "need --passages" in err
    rc, out, _ = run_cli(capsys, "index", "build", "--corpus", corpus, "--out", idx, "--model", tiny_model_dir(),
                         "--no-progress", "--passages", "--passage-window", "16", "--passage-stride", "12", "--bm25")
    assert rc == 0 and "built" in out and "14 documents (" in out and "passages)" in out
    rc, out, _ = run_cli(capsys, "index", "info", "--index", idx)
    assert rc == 0 and "documents   14" in out and "window 16, stride 12 tokens" in out
    rc, out, _ = run_cli(capsys, "search", "--index", idx, "--json", "--hybrid", "-k", "14", "zorbania")
    hits = json.loads(out)[0]["hits"]
    long1 = next(h for h in hits if h["id"] == "long1")
    assert long1["passage"]["end"] > long1["passage"]["start"]
    rc, out, _ = run_cli(capsys, "search", "--index", idx, "-k", "3", "--aggregate", "sum", "tea")
    assert rc == 0 and "\x1f" not in out
    rc, out, err = run_cli(capsys, "index", "delete", "--index", idx, "long1", "ghost")
    assert rc == 1 and "deleted 1 documents" in out and "(now 13)" in out and "ghost" in err
