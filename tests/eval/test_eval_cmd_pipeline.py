"""`twotower eval --index` end to end with the real SearchPipeline on a tiny random model."""

from __future__ import annotations

import json

import pytest

from tests.retrieval import pipeline_fixtures as fixtures
from twotower.cli import main
from twotower.eval import evaluate, read_trec_run, write_beir_qrels, write_beir_queries
from twotower.retrieval import pipeline


def test_index_mode_with_the_real_pipeline(tmp_path, capsys):
    import torch

    from twotower.retrieval.cross_encoder import CrossEncoder

    docs = fixtures.toy_docs(40)
    root = tmp_path / "beir"
    root.mkdir()
    fixtures.write_corpus(str(root / "corpus.jsonl"), docs)
    queries = {f"q{i}": " ".join(docs[i * 3]["text"].split()[:6]) for i in range(8)}
    write_beir_queries(queries, root / "queries.jsonl")
    write_beir_qrels(
        {f"q{i}": {docs[i * 3]["_id"]: 1, docs[i * 3 + 1]["_id"]: 0} for i in range(8)},
        root / "qrels" / "test.tsv",
    )
    model = fixtures.tiny_model_dir()
    with pipeline.SearchPipeline.build(
        str(root / "corpus.jsonl"), tmp_path / "idx", model, metric="cosine", bm25=True, progress=False
    ) as pipe:
        direct = pipe.search(list(queries.values()), k=10, recall_k=100, rerank=False)
    ce = CrossEncoder.from_encoder(model, bf16=False, device="cpu")
    with torch.no_grad():
        torch.manual_seed(3)
        ce.classifier.weight.normal_(0, 1.0)
    ce.save_pretrained(str(tmp_path / "ce"))

    argv = [
        "eval",
        "--index",
        str(tmp_path / "idx"),
        "--dataset",
        str(root),
        "--reranker",
        str(tmp_path / "ce"),
        "--hybrid",
        "-k",
        "10",
        "--out",
        str(tmp_path / "rep"),
        "--no-progress",
        "--json",
    ]
    assert main(argv) == 0
    means = json.loads(capsys.readouterr().out)
    assert list(means) == ["dense", "hybrid", "hybrid+rerank"]

    dense = read_trec_run(tmp_path / "rep" / "runs" / "dense.trec")
    assert set(dense) == set(queries)
    for qid, hits in zip(queries, direct):
        assert list(dense[qid]) == [h.id for h in hits]  # same documents, same order as a direct search
        assert [dense[qid][h.id] for h in hits] == pytest.approx([h.score for h in hits], abs=1e-6)
    qrels = {f"q{i}": {docs[i * 3]["_id"]: 1, docs[i * 3 + 1]["_id"]: 0} for i in range(8)}
    assert means["dense"] == pytest.approx(evaluate(dense, qrels, list(means["dense"])).means)
    report = json.loads((tmp_path / "rep" / "metrics.json").read_text())
    assert set(report["significance"]) == {"hybrid", "hybrid+rerank"}
    assert (tmp_path / "rep" / "recall_at_k.png").stat().st_size > 0
