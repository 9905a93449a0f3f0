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
