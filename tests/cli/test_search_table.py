"""The text view of `twotower search`: every number on a reranked line is labeled."""

from __future__ import annotations

from twotower.cli.search_cmd import _table
from twotower.retrieval.hit import Hit


def _hit(rank: int, score: float, first_rank: int, first_score: float, rerank: float | None) -> Hit:
    return Hit(id=f"d{first_rank}", title="", text="some text", rank=rank, score=score,
               first_stage_score=first_score, first_stage_rank=first_rank, rerank_score=rerank)


def test_reranked_table_labels_final_first_stage_and_reranker_scores():
    hits = [_hit(1, 1.25, 3, 0.41, 7.5), _hit(2, 0.5, 1, 0.62, -2.0), _hit(3, -1.5, 2, 0.55, None)]
    lines = _table("tea", hits, reranked=True).splitlines()
    assert lines[1].split() == ["rank", "final", "first", "stage", "reranker", "id"]
    assert lines[2].split() == ["1", "1.250", "#3", "0.410", "7.500", "d3"]
    assert lines[4].split() == ["2", "0.500", "#1", "0.620", "-2.000", "d1"]
    assert lines[6].split() == ["3", "-1.500", "#2", "0.550", "-", "d2"]  # below the reranked depth


def test_recall_only_table_has_one_score_column():
    lines = _table("tea", [_hit(1, 0.62, 1, 0.62, None)], reranked=False).splitlines()
    assert lines[1].split() == ["rank", "score", "id"] and lines[2].split() == ["1", "0.620", "d1"]
