"""`twotower index build --passages` and the commands around it speak documents, not passage rows."""

from __future__ import annotations

import json

from tests.cli.cli_run import build_with_an_empty_document, run_cli
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
    assert rc == 2 and "error: --passage-window needs --passages\n" in err  # it named --passage-stride, not given
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--out", idx, "--model", tiny_model_dir(),
                         "--passage-window", "16", "--passage-stride", "8")
    assert rc == 2 and "error: --passage-window and --passage-stride need --passages\n" in err
    rc, out, _ = run_cli(capsys, "index", "build", "--corpus", corpus, "--out", idx, "--model", tiny_model_dir(),
                         "--no-progress", "--passages", "--passage-window", "16", "--passage-stride", "12", "--bm25")
    assert rc == 0 and "built" in out and "14 documents (" in out and "passages)" in out
    rc, out, _ = run_cli(capsys, "index", "info", "--index", idx)
    assert rc == 0 and "documents   14" in out and "window 16, stride 12 tokens" in out
    rc, out, _ = run_cli(capsys, "index", "check", idx)
    passages = out.split("14 documents (")[1].split(" passages)")[0]  # it counted each passage as a document
    assert rc == 0 and int(passages) > 14 and f"({passages} passages)" in out
    rc, out, _ = run_cli(capsys, "search", "--index", idx, "--json", "--hybrid", "-k", "14", "zorbania")
    hits = json.loads(out)[0]["hits"]
    long1 = next(h for h in hits if h["id"] == "long1")
    assert long1["passage"]["end"] > long1["passage"]["start"]
    rc, out, _ = run_cli(capsys, "search", "--index", idx, "-k", "3", "--aggregate", "sum", "tea")
    assert rc == 0 and "\x1f" not in out
    rc, out, err = run_cli(capsys, "index", "delete", "--index", idx, "long1", "ghost")
    assert rc == 1 and "deleted 1 document from" in out and "(now 13)" in out and "ghost" in err


def test_delete_takes_no_passage_row_id_and_check_finds_a_document_an_old_delete_broke(tmp_path, capsys):
    """`index delete $'long1\\x1f1'` (or that id in --ids-file) deleted that one passage row ("deleted 1 document from",
    the count unchanged); every search finding long1 then failed, and `index check` said ok."""
    from twotower.indexing import IndexStore

    corpus = write_corpus(str(tmp_path / "c.jsonl"), corpus_docs())
    idx = str(tmp_path / "idx")
    assert run_cli(capsys, "index", "build", "--corpus", corpus, "--out", idx, "--model", tiny_model_dir(),
                   "--no-progress", "--passages", "--passage-window", "16", "--passage-stride", "12")[0] == 0
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text("long2\x1f0\n")
    for given, shown in ((["long1\x1f1"], r"'long1\x1f1'"), (["--ids-file", str(ids_file)], r"'long2\x1f0'")):
        rc, out, err = run_cli(capsys, "index", "delete", "--index", idx, *given)
        assert rc == 1 and "deleted 0 documents" in out and "(now 14)" in out
        assert f"1 id(s) not in the index: {shown}\n" in err  # escaped: the raw \x1f is invisible on a terminal
    rc, out, err = run_cli(capsys, "search", "--index", idx, "--json", "-k", "14", "zorbania")
    assert rc == 0 and len(json.loads(out)[0]["hits"]) == 14, err
    assert run_cli(capsys, "index", "check", idx)[0] == 0

    with IndexStore.open(idx) as store:  # what an earlier version's delete of that id did
        store.delete(["long1\x1f1"])
    rc, out, err = run_cli(capsys, "index", "check", idx)
    assert rc == 2 and "document 'long1' cannot be rebuilt from its passages" in err, err
    assert "twotower index delete" in err and "ok" not in out
    rc, out, _ = run_cli(capsys, "index", "delete", "--index", idx, "long1")  # the way out: delete it, add it again
    assert rc == 0 and "deleted 1 document from" in out and "(now 13)" in out
    assert run_cli(capsys, "index", "check", idx)[0] == 0


def test_on_empty_skip_with_passages(tmp_path, capsys, caplog):
    """An empty document is left out before any splitting: the plan's passage counts match the shards."""
    out = build_with_an_empty_document(capsys, caplog, corpus_docs(), tmp_path, "--passages", "--passage-window",
                                       "16", "--shard-size", "4")
    assert "14 documents (" in out
    assert run_cli(capsys, "index", "check", str(tmp_path / "idx"))[0] == 0
