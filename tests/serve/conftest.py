"""Fixtures for the service tests: tiny indexes (built once, copied per test), a tiny reranker, servers.

The indexes use the tiny random BERT of tests/retrieval/pipeline_fixtures.py, so loading a
server takes a fraction of a second and a search a few milliseconds.
"""

from __future__ import annotations

import shutil

import pytest

from tests.retrieval.pipeline_fixtures import tiny_model_dir, toy_docs, write_corpus
from tests.retrieval.test_pipeline import reranker_dir  # noqa: F401  (a random-weight CrossEncoder)

N_DOCS = 40


@pytest.fixture(scope="session")
def encoder():
    from twotower.retrieval import DualEncoder

    return DualEncoder.from_pretrained(tiny_model_dir(), bf16=False)


@pytest.fixture(scope="session")
def docs() -> list[dict]:
    return toy_docs(N_DOCS)


def _build(root, docs, encoder, bm25: bool) -> str:
    from twotower.retrieval import SearchPipeline

    corpus = write_corpus(str(root / "corpus.jsonl"), docs)
    out = str(root / "idx")
    SearchPipeline.build(corpus, out, encoder, metric="cosine", bm25=bm25, progress=False).close()
    return out


@pytest.fixture(scope="session")
def index_template(tmp_path_factory, docs, encoder) -> str:
    """A 40-document index with BM25 (never written to: tests copy it)."""
    return _build(tmp_path_factory.mktemp("serve-index"), docs, encoder, bm25=True)


@pytest.fixture(scope="session")
def dense_only_template(tmp_path_factory, docs, encoder) -> str:
    return _build(tmp_path_factory.mktemp("serve-dense"), docs, encoder, bm25=False)


@pytest.fixture()
def index_dir(tmp_path, index_template) -> str:
    """A private copy of the template index, free to be written."""
    out = str(tmp_path / "idx")
    shutil.copytree(index_template, out)
    return out

