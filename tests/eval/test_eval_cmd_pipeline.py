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
    out = capsys.readouterr()
    means = json.loads(out.out)
    assert list(means) == ["dense", "hybrid", "hybrid+rerank"]
    # every relevant document is in the index: the one warning is of recall@100, beyond -k 10
    note = ("recall@100 cut deeper than the deepest list of the runs (10 documents): it counts only those; -k 100 "
            "scores them in full")
    assert out.err == f"twotower eval: warning: {note}\n", out.err

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
    encoder = json.loads((tmp_path / "idx" / "manifest.json").read_text())["extra"]["pipeline"]["encoder"]
    assert report["settings"]["encoder fingerprint"] == encoder["fingerprint"]  # what the index was built with
    assert report["settings"]["index documents"] == len(docs) and report["settings"]["index generation"] >= 1
    # a reranker without a stored weight: pure reranking of the top 20, recorded with the report
    assert {k: report["settings"][k] for k in ("rerank_k", "rerank_alpha", "rerank_alpha_chosen_over")} == {
        "rerank_k": 20, "rerank_alpha": 1.0, "rerank_alpha_chosen_over": None}

    # --rerank-k / --rerank-alpha reach the reranked system: weight 0 over the top 5 is the hybrid's ranking;
    # a weight chosen over BM25 (a reranker trained without --teacher) is applied and named on stderr
    from twotower.retrieval.interpolation import write_alpha

    write_alpha(str(tmp_path / "ce"), 0.3, {"bm25": 0.3})
    base = argv[: argv.index("--out")] + ["--out", str(tmp_path / "rep2"), "--no-progress", "--json"]
    assert main([*base, "--rerank-k", "5", "--rerank-alpha", "0"]) == 0
    out = capsys.readouterr()
    assert "chosen over" not in out.err
    runs = {name: read_trec_run(tmp_path / "rep2" / "runs" / f"{name}.trec") for name in ("hybrid", "hybrid+rerank")}
    assert all(list(runs["hybrid+rerank"][q]) == list(runs["hybrid"][q]) for q in queries)
    settings = json.loads((tmp_path / "rep2" / "metrics.json").read_text())["settings"]
    assert (settings["rerank_k"], settings["rerank_alpha"], settings["rerank_alpha_chosen_over"]) == (5, 0.0,
                                                                                                      "--rerank-alpha")
    assert main(base) == 0
    assert "weight 0.3 was chosen over BM25's ranking" in capsys.readouterr().err
    settings = json.loads((tmp_path / "rep2" / "metrics.json").read_text())["settings"]
    assert (settings["rerank_alpha"], settings["rerank_alpha_chosen_over"]) == (0.3, "bm25")

    # --bm25 adds a BM25 system, and without --hybrid the reranked system reranks BM25's candidates with the
    # weight chosen over BM25 (no note: the stages agree)
    write_alpha(str(tmp_path / "ce"), 0.5, {"dense": 0.5, "bm25": 0.3})  # the general weight is dense's 0.5
    bm25_argv = [a for a in base if a != "--hybrid"]
    bm25_argv[bm25_argv.index(str(tmp_path / "rep2"))] = str(tmp_path / "rep3")
    assert main([*bm25_argv, "--bm25"]) == 0
    out = capsys.readouterr()
    assert list(json.loads(out.out)) == ["dense", "bm25", "bm25+rerank"] and "chosen over" not in out.err
    with pipeline.SearchPipeline.load(tmp_path / "idx", model, reranker=str(tmp_path / "ce")) as pipe:  # as eval loads
        lexical = pipe.search(list(queries.values()), k=10, recall_k=100, rerank=False, bm25=True)
        reranked = pipe.search(list(queries.values()), k=10, recall_k=100, bm25=True)
    runs = {name: read_trec_run(tmp_path / "rep3" / "runs" / f"{name}.trec") for name in ("bm25", "bm25+rerank")}
    for qid, plain, ranked in zip(queries, lexical, reranked):
        assert list(runs["bm25"][qid]) == [h.id for h in plain]
        assert runs["bm25+rerank"][qid] == pytest.approx({h.id: h.score for h in ranked}, abs=1e-5)
        assert any(h.rerank_score is not None for h in ranked)
    settings = json.loads((tmp_path / "rep3" / "metrics.json").read_text())["settings"]
    assert (settings["rerank_alpha"], settings["rerank_alpha_chosen_over"]) == (0.3, "bm25")


@pytest.mark.parametrize("flags, message", [
    (["--rerank-k", "5"], "--rerank-k sets how the reranked system reranks: add --reranker DIR"),
    (["--rerank-alpha", "0.5"], "--rerank-alpha sets how the reranked system reranks: add --reranker DIR"),
    (["--reranker", "default", "--rerank-k", "500"], "--rerank-k (500) must be between 1 and --recall-k (100)"),
    (["--reranker", "default", "--rerank-alpha", "1.5"], "--rerank-alpha must be between 0 and 1, got 1.5"),
])
def test_rerank_flags_are_checked_before_anything_loads(tmp_path, capsys, flags, message):
    argv = ["eval", "--index", str(tmp_path / "no-index"), "--dataset", str(tmp_path / "no-beir"), "--out",
            str(tmp_path / "rep"), *flags]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_relevant_documents_missing_from_the_index_are_named(tmp_path, capsys):
    """An index of another corpus (or part of this one): its queries cannot reach their relevant documents, and
    the scores came out low without a word."""
    docs = fixtures.toy_docs(12)
    root = tmp_path / "beir"
    root.mkdir()
    fixtures.write_corpus(str(root / "corpus.jsonl"), docs)
    write_beir_queries({"q1": "tea", "q2": "gene", "q3": "drug"}, root / "queries.jsonl")
    write_beir_qrels({"q1": {"d1": 1, "d11": 0}, "q2": {"d10": 1, "d2": 1}, "q3": {"d3": 1}}, root / "qrels" / "test.tsv")
    pipeline.SearchPipeline.build(docs[:10], tmp_path / "idx", fixtures.tiny_model_dir(), progress=False).close()
    assert main(["eval", "--index", str(tmp_path / "idx"), "--dataset", str(root), "--out", str(tmp_path / "rep"),
                 "--no-progress", "--json"]) == 0
    err = capsys.readouterr().err
    assert (f"warning: 1 of the 4 relevant documents of --split test are not in --index {tmp_path / 'idx'} (d10); "
            "1 query cannot reach them") in err  # d11 is judged 0: not relevant
