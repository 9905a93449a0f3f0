"""What reranking costs at query time: no cross-encoder at interpolation weight 0, and a rerank_k budget.

The reranker here is a recording stub with a known scoring rule, so the tests can check exactly which
pairs were scored and rebuild the expected ranking by hand.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from tests.retrieval.pipeline_fixtures import spread_reranker_dir, tiny_model_dir, toy_docs, write_corpus
from twotower.indexing import document_text
from twotower.retrieval import SearchPipeline
from twotower.retrieval.interpolation import interpolate


class RecordingReranker:
    """Scores a pair by a CRC of its text (a fixed, order-free rule) and records every pair it was given."""

    def __init__(self, interpolation: float | None = None) -> None:
        self.interpolation = interpolation
        self.pairs: list[tuple[str, str]] = []
        self.calls = 0

    @staticmethod
    def score(text: str) -> float:
        return float(zlib.crc32(text.encode()) % 1000) / 10.0

    def predict(self, pairs, batch_size=32, progress=False):
        self.calls += 1
        self.pairs += list(pairs)
        return np.array([self.score(t) for _, t in pairs], dtype=np.float32)


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    corpus = write_corpus(str(root / "corpus.jsonl"), toy_docs(50, seed=4))
    SearchPipeline.build(corpus, root / "idx", tiny_model_dir(), progress=False, bf16=False).close()
    return root / "idx"


QUERIES = ["tea coffee milk", "gene protein tumor"]


def _open(index, reranker):
    return SearchPipeline.load(index, tiny_model_dir(), reranker=reranker, bf16=False)


def test_alpha_zero_never_calls_the_reranker(index):
    stub = RecordingReranker(interpolation=0.0)  # a stored weight of 0, as training writes for a useless reranker
    with _open(index, stub) as pipe:
        recall = pipe.search(QUERIES, k=8, recall_k=30, rerank=False)
        hits = pipe.search(QUERIES, k=8, recall_k=30)
        assert stub.calls == 0 and stub.pairs == []
        for got, want in zip(hits, recall):
            assert [(h.id, h.score, h.rank) for h in got] == [(h.id, h.score, h.rank) for h in want]
            assert all(h.rerank_score is None and h.rank == h.first_stage_rank for h in got)
        pipe.search(QUERIES, k=8, recall_k=30, rerank_alpha=0.5, rerank_k=30)  # a weight above 0 does rerank
        assert stub.calls == 1 and len(stub.pairs) == 2 * 30


def test_rerank_alpha_zero_override_skips_a_reranker_with_a_weight(index):
    stub = RecordingReranker(interpolation=1.0)
    with _open(index, stub) as pipe:
        hits = pipe.search(QUERIES[0], k=5, recall_k=20, rerank_alpha=0.0)
        assert stub.calls == 0 and all(h.rerank_score is None for h in hits)


@pytest.mark.parametrize("alpha", [1.0, 0.4])
def test_only_the_first_stage_top_rerank_k_are_scored_and_the_rest_follow(index, alpha):
    stub = RecordingReranker(interpolation=alpha)
    rerank_k, k = 6, 15
    with _open(index, stub) as pipe:
        recall = pipe.search(QUERIES, k=30, recall_k=30, rerank=False)
        hits = pipe.search(QUERIES, k=k, recall_k=30, rerank_k=rerank_k)
    # exactly the top rerank_k of each query's first stage went to the cross-encoder
    assert [t for _, t in stub.pairs] == [document_text({"title": h.title, "text": h.text})
                                         for row in recall for h in row[:rerank_k]]
    for got, first in zip(hits, recall):
        head = first[:rerank_k]
        raw = np.array([stub.score(document_text({"title": h.title, "text": h.text})) for h in head])
        final = interpolate(raw, np.array([h.first_stage_score for h in head]), alpha)
        order = sorted(range(rerank_k), key=lambda j: (-final[j], j))
        assert [h.id for h in got[:rerank_k]] == [head[j].id for j in order]
        assert [h.rerank_score for h in got[:rerank_k]] == pytest.approx([raw[j] for j in order])
        # below the budget: first-stage order, no rerank score, one point apart under the last reranked hit
        tail = got[rerank_k:]
        assert [h.id for h in tail] == [h.id for h in first[rerank_k:k]]
        assert all(h.rerank_score is None for h in tail)
        floor = got[rerank_k - 1].score
        assert [h.score for h in tail] == pytest.approx([floor - i for i in range(1, k - rerank_k + 1)])
        assert [h.rank for h in got] == list(range(1, k + 1))
        scores = [h.score for h in got]
        assert all(a > b for a, b in zip(scores[rerank_k - 1:], scores[rerank_k:]))  # a TREC run keeps the order


def test_default_rerank_k_caps_at_recall_k(index):
    from twotower.retrieval.rerank import DEFAULT_RERANK_K

    stub = RecordingReranker(interpolation=1.0)
    with _open(index, stub) as pipe:
        pipe.search(QUERIES[0], k=5, recall_k=12)
        assert len(stub.pairs) == min(DEFAULT_RERANK_K, 12)
        stub.pairs.clear()
        pipe.search(QUERIES[0], k=5, recall_k=50)
        assert len(stub.pairs) == min(DEFAULT_RERANK_K, 50)


@pytest.mark.parametrize("bad", [0, 31, 2.5])
def test_rerank_k_out_of_range_is_refused(index, bad):
    with _open(index, RecordingReranker(1.0)) as pipe:
        with pytest.raises(ValueError, match="rerank_k must be an int between 1 and recall_k \\(30\\)"):
            pipe.search("tea", k=5, recall_k=30, rerank_k=bad)


def test_arguments_a_search_would_ignore_are_refused_as_the_cli_and_the_service_refuse_them(index):
    """rerank_k / rerank_alpha with no reranker to run, and aggregate on an index of whole documents, were
    ignored without a word in Python (the command line and the service refused them)."""
    with _open(index, None) as pipe:
        assert len(pipe.search("tea", k=5, recall_k=30)) == 5  # the defaults never count as given
        with pytest.raises(ValueError, match=r"^rerank_k set how the reranker reranks, but the pipeline has no "
                                             "reranker"):
            pipe.search("tea", k=5, recall_k=30, rerank_k=10)
        with pytest.raises(ValueError, match=r"^rerank_k and rerank_alpha set how"):
            pipe.search("tea", k=5, recall_k=30, rerank_k=10, rerank_alpha=0.5)
        with pytest.raises(ValueError, match=r"^aggregate='sum': the index stores documents whole"):
            pipe.search("tea", k=5, aggregate="sum")
        with pytest.raises(ValueError, match=r"^aggregate='max': the index stores documents whole"):
            pipe.search("tea", k=5, aggregate="max")  # refused as `--aggregate max` is (it was accepted here)
    stub = RecordingReranker(1.0)
    with _open(index, stub) as pipe:
        with pytest.raises(ValueError, match=r"^rerank_alpha set how the reranker reranks, but rerank=False turns"):
            pipe.search("tea", k=5, rerank=False, rerank_alpha=0.3)
        assert stub.calls == 0
        pipe.search("tea", k=5, recall_k=30, rerank_k=10, rerank_alpha=0.3)  # with a reranker to run: taken
        assert stub.calls == 1


def test_cli_rerank_k_and_the_skipped_reranker_note(index, tmp_path, capsys):
    import json
    import shutil

    from tests.cli.cli_run import run_cli
    from twotower.retrieval.interpolation import ALPHA_FILE

    spread_reranker_dir(str(tmp_path / "ce"))
    base = ["search", "--index", str(index), "-k", "8", "--recall-k", "20", "--reranker", str(tmp_path / "ce")]
    rc, out, _ = run_cli(capsys, *base, "--rerank-k", "3", "--json", "tea coffee milk")
    hits = json.loads(out)[0]["hits"]
    assert rc == 0 and [h["rerank_score"] is not None for h in hits] == [True] * 3 + [False] * 5
    rc, out, _ = run_cli(capsys, *base, "--rerank-k", "3", "tea coffee milk")
    assert rc == 0 and out.startswith("# dense recall of 20, top 3 reranked by the cross-encoder")
    # the weight the final score applies, and where it came from, which no column showed
    from twotower.retrieval.pipeline import SearchPipeline

    with SearchPipeline.load(str(index), reranker=str(tmp_path / "ce")) as pipe:
        stored, over = pipe.rerank_alpha(None), pipe.rerank_alpha_chosen_over(False)
    assert out.splitlines()[0].endswith(f", weight {stored:g} (chosen on dev over {over or 'an unrecorded first stage'})")
    rc, out, _ = run_cli(capsys, *base, "--rerank-k", "3", "--rerank-alpha", "0.25", "tea coffee milk")
    assert rc == 0 and out.splitlines()[0].endswith(", weight 0.25 (--rerank-alpha)")
    rc, _, err = run_cli(capsys, *base, "--rerank-k", "21", "tea")
    assert rc == 2 and "--rerank-k (21) must be between 1 and --recall-k (20)" in err
    shutil.copytree(tmp_path / "ce", tmp_path / "ce0")
    (tmp_path / "ce0" / ALPHA_FILE).write_text(json.dumps({"alpha": 0.0}))
    rc, out, _ = run_cli(capsys, *base[:-1], str(tmp_path / "ce0"), "tea coffee milk")
    assert rc == 0 and "interpolation weight is 0" in out and "not run" in out


def test_the_recall_depth_is_the_given_one_else_the_default_raised_to_k():
    """The one rule of the pipeline, the commands and the service (whose default is configurable): on a small
    index every depth >= k returns the same hits, so the pipeline's own test cannot tell the depth apart."""
    from twotower.retrieval.rerank import DEFAULT_RECALL_K, recall_depth

    assert recall_depth(None, 7) == DEFAULT_RECALL_K == 100
    assert recall_depth(None, 150) == 150
    assert recall_depth(120, 7) == 120
    assert recall_depth(None, 7, default=30) == 30 and recall_depth(None, 50, default=30) == 50
