"""The classic-collection reranker benchmark: CV folds (disjoint, covering, fixed by the seed) and title pairs."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from classic_rerank_cv import assign_folds, judged_queries, merge_reranked, titled_view  # noqa: E402

IDS = [str(i) for i in range(1, 31)]  # Medline's 30 judged queries


def test_folds_are_disjoint_and_cover_every_query():
    folds = assign_folds(IDS, 5, seed=0)
    assert len(folds) == 5
    flat = [q for f in folds for q in f]
    assert sorted(flat) == sorted(IDS) and len(flat) == len(set(flat))
    assert {len(f) for f in folds} == {6}


def test_uneven_counts_differ_by_at_most_one():
    sizes = [len(f) for f in assign_folds([str(i) for i in range(76)], 5, seed=3)]  # CISI's 76
    assert sum(sizes) == 76 and max(sizes) - min(sizes) <= 1


def test_same_seed_same_folds_whatever_the_input_order():
    assert assign_folds(IDS, 5, seed=7) == assign_folds(list(reversed(IDS)), 5, seed=7)


def test_another_seed_deals_differently():
    assert assign_folds(IDS, 5, seed=0) != assign_folds(IDS, 5, seed=1)


def test_fold_count_is_checked():
    with pytest.raises(ValueError, match="--folds"):
        assign_folds(IDS[:3], 5, seed=0)


def test_only_queries_with_a_relevant_document_are_judged():
    assert judged_queries({"a": {"d1": 1}, "b": {"d2": 0}, "c": {"d3": 0, "d4": 2}}) == ["a", "c"]


def test_reranked_head_comes_first_then_the_first_stage_order():
    first = {"a": 5.0, "b": 4.0, "c": 3.0, "d": 2.0}
    merged = merge_reranked(first, {"b": 0.1, "a": 0.9 - 1.0})  # the reranker puts b above a
    assert sorted(merged, key=merged.get, reverse=True) == ["b", "a", "c", "d"]


def test_weight_zero_reproduces_the_first_stage_order_ties_included():
    # Fused scores tie often (RRF); the merged run must break them as trec_eval breaks the first stage's.
    import numpy as np

    from twotower.eval.metrics import rank_documents
    from twotower.retrieval.interpolation import interpolate

    first = {"d1": 0.5, "d2": 0.5, "d3": 0.4, "d10": 0.4, "d4": 0.3, "d5": 0.2}
    top = rank_documents(first)[:4]  # the reranked head
    mixed = interpolate(np.array([9.0, -1.0, 3.0, 0.5]), np.array([first[d] for d in top]), 0.0)
    merged = merge_reranked(first, dict(zip(top, mixed.tolist())))
    assert rank_documents(merged) == rank_documents(first) == ["d2", "d1", "d3", "d10", "d4", "d5"]


def test_titled_view_cuts_a_text_that_repeats_its_title():
    # Cranfield: the text opens with the title and a " ." before the abstract.
    view = titled_view("1", "experimental investigation of a wing .",
                       "experimental investigation of a wing . an experimental study of a wing was made")
    assert view == {"_id": "1", "title": "experimental investigation of a wing .",
                    "text": "an experimental study of a wing was made"}


def test_titled_view_takes_the_first_sentence_as_the_missing_title():
    # Medline: no title field; the title is the first sentence, sometimes after a number.
    view = titled_view("7", "", "surfactant in fetal lamb tracheal fluid . lambs delivered by cesarean section")
    assert view == {"_id": "7", "title": "surfactant in fetal lamb tracheal fluid",
                    "text": "lambs delivered by cesarean section"}
    view = titled_view("8", "", "28029 enzymic synthesis of steroid sulfates. ii. presence of kinase")
    assert view["title"] == "enzymic synthesis of steroid sulfates"


def test_titled_view_keeps_a_distinct_title_and_drops_short_or_empty_ones():
    view = titled_view("3", "Dewey Decimal Classification editions", "The present study is a history.")
    assert view == {"_id": "3", "title": "Dewey Decimal Classification editions", "text": "The present study is a history."}
    assert titled_view("4", "", "one sentence only")["title"] == ""  # no sentence break: no title, no pair
    assert titled_view("5", "Two words", "a text")["title"] == ""
    assert titled_view("6", "", "") is None
