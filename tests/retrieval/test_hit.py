"""`Hit` records and the collector pause used while building many of them."""

import gc

import pytest

from twotower.retrieval.hit import Hit, gc_paused


def test_gc_paused_restores_the_collector_even_on_error():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_gc_paused_keeps_a_disabled_collector_disabled():
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_hit_to_dict_is_json_ready():
    h = Hit("d1", "T", "text", 1, 2.5, 0.7, 3, rerank_score=2.5)
    assert h.to_dict() == {"id": "d1", "title": "T", "text": "text", "rank": 1, "score": 2.5,
                           "first_stage_score": 0.7, "first_stage_rank": 3, "rerank_score": 2.5,
                           "dense_score": None, "bm25_score": None,
                           "label": None, "label_score": None, "passage": None, "metadata": None}
