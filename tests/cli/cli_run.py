"""Helpers for the CLI tests: run `twotower.cli.main` in-process, and build a small index through it."""

from __future__ import annotations

from pathlib import Path

from tests.retrieval.pipeline_fixtures import tiny_model_dir, toy_docs, write_corpus
from twotower.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``twotower ARGV``."""
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def build_index(root: Path, documents: int, *flags: str) -> Path:
    """``root/corpus.jsonl`` of `documents` toy documents, indexed with the tiny model into ``root/idx``."""
    corpus = write_corpus(str(root / "corpus.jsonl"), toy_docs(documents))
    assert main(["index", "build", "--corpus", corpus, "--out", str(root / "idx"), "--model", tiny_model_dir(),
                 "--no-progress", *flags]) == 0
    return root


def build_with_an_empty_document(capsys, caplog, docs: list[dict], root: Path, *flags: str) -> str:
    """``index build FLAGS`` of `docs` plus one empty document ("blank", last): without ``--on-empty`` it
    stops naming its line and the flag that skips it; with ``--on-empty skip`` it builds ``root/idx`` and the
    warning names it. Returns the build's stdout."""
    corpus = write_corpus(str(root / "corpus.jsonl"), [*docs, {"_id": "blank", "title": "", "text": "  "}])
    argv = ["index", "build", "--corpus", corpus, "--out", str(root / "idx"), "--model", tiny_model_dir(),
            "--no-progress", *flags]
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and f":{len(docs) + 1}: document 'blank' has empty 'text' and 'title'; use --on-empty skip" in err
    with caplog.at_level("WARNING"):
        rc, out, err = run_cli(capsys, *argv, "--on-empty", "skip")
    assert rc == 0 and f"{len(docs)} documents" in out, err
    assert "1 empty document (blank 'text' and 'title') not indexed: 'blank' (on empty: skip)" in caplog.messages
    return out
