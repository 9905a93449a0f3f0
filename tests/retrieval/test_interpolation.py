"""Rerank / first-stage score interpolation: the formula, storage, and the pipeline using it."""

from __future__ import annotations

import doctest
import json
import os
import shutil

import numpy as np
import pytest
import torch

import twotower.retrieval.interpolation
from twotower.retrieval.interpolation import (
    ALPHA_FILE,
    interpolate,
    interpolate_run,
    read_alpha,
    read_first_stage_alphas,
    write_alpha,
)


def test_interpolate_matches_the_formula_by_hand():
    r, f = np.array([3.0, 1.0, 2.0]), np.array([0.1, 0.3, 0.2])
    zr = (r - 2.0) / np.sqrt(2.0 / 3.0)  # mean 2, population std sqrt(2/3)
    zf = (f - 0.2) / np.sqrt(0.02 / 3.0)
    np.testing.assert_allclose(interpolate(r, f, 0.3), 0.3 * zr + 0.7 * zf, atol=1e-12)
    np.testing.assert_array_equal(interpolate(r, f, 1.0), r)  # pure reranking keeps the raw scores
    assert list(np.argsort(-interpolate(r, f, 0.0))) == [1, 2, 0]  # alpha 0 = first-stage order
    # a constant list carries no information: its z-scores are 0, so only the other list decides
    np.testing.assert_allclose(interpolate(np.array([5.0, 5.0]), np.array([1.0, 2.0]), 0.5), [-0.5, 0.5])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        interpolate(r, f, 1.5)


def test_interpolate_run_rescores_each_query():
    rerank = {"q1": {"a": 3.0, "b": 1.0}, "q2": {}}
    first = {"q1": {"a": 0.0, "b": 2.0, "c": 9.0}, "q2": {}}
    mixed = interpolate_run(rerank, first, 0.25)  # z(rerank) = (1, -1), z(first) over a, b = (-1, 1)
    assert mixed == {"q1": {"a": pytest.approx(-0.5), "b": pytest.approx(0.5)}, "q2": {}}


def test_docstring_examples():
    result = doctest.testmod(twotower.retrieval.interpolation)
    assert result.attempted > 0 and result.failed == 0


def test_read_alpha(tmp_path):
    assert read_alpha(str(tmp_path)) is None
    (tmp_path / ALPHA_FILE).write_text(json.dumps({"alpha": 0.4}))
    assert read_alpha(str(tmp_path)) == 0.4
    (tmp_path / ALPHA_FILE).write_text(json.dumps({"alpha": 2}))
    with pytest.raises(ValueError, match=ALPHA_FILE):
        read_alpha(str(tmp_path))
    (tmp_path / ALPHA_FILE).write_text("not json")
    with pytest.raises(ValueError, match=ALPHA_FILE):
        read_alpha(str(tmp_path))


def test_write_alpha_round_trips_with_details(tmp_path):
    write_alpha(str(tmp_path), 0.3, chosen_on="dev")
    assert read_alpha(str(tmp_path)) == 0.3
    assert json.loads((tmp_path / ALPHA_FILE).read_text())["chosen_on"] == "dev"
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        write_alpha(str(tmp_path), -0.1)
    assert read_alpha(str(tmp_path)) == 0.3  # the refused write left the stored value alone


def test_weights_per_first_stage_round_trip(tmp_path):
    assert read_first_stage_alphas(str(tmp_path)) == {}
    write_alpha(str(tmp_path), 0.6, {"dense": 0.6, "hybrid": 0.2}, chosen_on="dev")
    assert read_alpha(str(tmp_path)) == 0.6
    assert read_first_stage_alphas(str(tmp_path)) == {"dense": 0.6, "hybrid": 0.2}
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        write_alpha(str(tmp_path), 0.5, {"hybrid": 1.5})
    assert read_first_stage_alphas(str(tmp_path))["hybrid"] == 0.2  # the refused write changed nothing
    (tmp_path / ALPHA_FILE).write_text(json.dumps({"alpha": 0.5, "by_first_stage": {"hybrid": "high"}}))
    with pytest.raises(ValueError, match=f"{ALPHA_FILE}: by_first_stage must map"):
        read_first_stage_alphas(str(tmp_path))


def test_pipeline_applies_the_stored_alpha(tmp_path):
    from twotower.indexing import document_text
    from twotower.retrieval import SearchPipeline
    from twotower.retrieval.cross_encoder import CrossEncoder

    from .pipeline_fixtures import assert_ranked_by_scores, sentences, tiny_model_dir, write_corpus

    docs = [{"_id": f"d{i}", "title": "", "text": t} for i, t in enumerate(sentences(30, seed=5))]
    ce = CrossEncoder.from_encoder(tiny_model_dir(), bf16=False, device="cpu")
    with torch.no_grad():
        torch.manual_seed(3)
        ce.classifier.weight.normal_(0, 1.0)
    plain = str(tmp_path / "ce")
    ce.save_pretrained(plain)
    assert not os.path.exists(os.path.join(plain, ALPHA_FILE))
    mixed = str(tmp_path / "ce-mixed")
    shutil.copytree(plain, mixed)
    (tmp_path / "ce-mixed" / ALPHA_FILE).write_text(json.dumps({"alpha": 0.0}))
    loaded = CrossEncoder.from_pretrained(mixed, bf16=False, device="cpu")
    assert loaded.interpolation == 0.0
    loaded.save_pretrained(str(tmp_path / "ce-copy"))  # the weight travels with the checkpoint
    assert read_alpha(str(tmp_path / "ce-copy")) == 0.0

    corpus = write_corpus(str(tmp_path / "c.jsonl"), docs)
    query = "coffee cup hot milk sugar"
    SearchPipeline.build(corpus, tmp_path / "idx", tiny_model_dir(), progress=False).close()
    with SearchPipeline.load(tmp_path / "idx", tiny_model_dir(), reranker=mixed, bf16=False) as pipe:
        assert pipe.rerank_alpha_chosen_over() is None  # a weight stored without its first stage
        recall = pipe.search(query, k=10, recall_k=10, rerank=False)
        assert pipe.rerank_alpha() == 0.0
        kept = pipe.search(query, k=10, recall_k=10)  # stored alpha 0: the first-stage hits, reranker not run
        assert [h.id for h in kept] == [h.id for h in recall]
        assert all(h.rerank_score is None for h in kept)
        scores = ce.predict([(query, document_text({"title": h.title, "text": h.text})) for h in recall])
        pure = pipe.search(query, k=10, recall_k=10, rerank_alpha=1.0)  # an explicit override wins
        assert_ranked_by_scores(pure, [h.id for h in recall], scores)
        assert all(h.score == h.rerank_score for h in pure)
        half = pipe.search(query, k=10, recall_k=10, rerank_alpha=0.5)
        raw = {h.id: h.rerank_score for h in pure}  # the pipeline's own cross-encoder scores
        want = interpolate(np.array([raw[h.id] for h in recall]), np.array([h.score for h in recall]), 0.5)
        assert [h.id for h in half] == [recall[i].id for i in np.argsort(-want, kind="stable")]
        assert [h.score for h in half] == pytest.approx(sorted(want.tolist(), reverse=True))
        with pytest.raises(ValueError, match="rerank_alpha"):
            pipe.search(query, rerank_alpha=-0.1)

    # A weight chosen over the hybrid first stage: hybrid searches use it, dense ones the general weight.
    staged = str(tmp_path / "ce-staged")
    shutil.copytree(plain, staged)
    write_alpha(staged, 0.0, {"hybrid": 1.0})
    SearchPipeline.build(corpus, tmp_path / "idx-bm25", tiny_model_dir(), bm25=True, progress=False).close()
    with SearchPipeline.load(tmp_path / "idx-bm25", tiny_model_dir(), reranker=staged, bf16=False) as pipe:
        assert pipe.rerank_alpha() == 0.0 and pipe.rerank_alpha(hybrid=True) == 1.0
        # hybrid searches apply a weight chosen over the hybrid; dense ones the general weight, chosen elsewhere
        assert pipe.rerank_alpha_chosen_over(hybrid=True) == "hybrid" and pipe.rerank_alpha_chosen_over() == "hybrid"
        assert pipe.rerank_alpha(0.3, hybrid=True) == 0.3  # an explicit override still wins
        assert all(h.rerank_score is None for h in pipe.search(query, k=5, recall_k=10))
        hybrid = pipe.search(query, k=5, recall_k=10, hybrid=True)
        assert all(h.rerank_score is not None and h.score == h.rerank_score for h in hybrid)


def test_first_stage_names_and_switches_are_inverse():
    from twotower.retrieval.interpolation import FIRST_STAGES, first_stage_name, first_stage_switches

    assert [first_stage_name(**first_stage_switches(stage)) for stage in FIRST_STAGES] == list(FIRST_STAGES)
    assert first_stage_switches("dense") == {"hybrid": False, "bm25": False}
    with pytest.raises(ValueError, match="first stage 'bm-25'"):
        first_stage_switches("bm-25")
    with pytest.raises(ValueError, match="give one, not both"):
        first_stage_name(hybrid=True, bm25=True)
