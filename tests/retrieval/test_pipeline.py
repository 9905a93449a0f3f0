"""SearchPipeline: search against a brute-force reference, BM25 recall, hybrid fusion, rerank, add/delete, save/load."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.retrieval.pipeline_fixtures import assert_ranked_by_scores, tiny_model_dir, toy_docs, write_corpus
from twotower.indexing import IndexStore, document_text
from twotower.retrieval import DualEncoder, Hit, SearchPipeline, reciprocal_rank_fusion, score_fusion

N_DOCS = 60


@pytest.fixture(scope="module")
def docs():
    return toy_docs(N_DOCS)


@pytest.fixture(scope="module")
def encoder():
    return DualEncoder.from_pretrained(tiny_model_dir(), bf16=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory, docs, encoder):
    root = tmp_path_factory.mktemp("pipe")
    corpus = write_corpus(str(root / "corpus.jsonl"), docs)
    pipe = SearchPipeline.build(corpus, root / "idx", encoder, metric="cosine", bm25=True, shard_size=16,
                                progress=False)
    yield pipe
    pipe.close()


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    """A real (random-weight) CrossEncoder with a head large enough that its scores vary."""
    from twotower.retrieval.cross_encoder import CrossEncoder

    ce = CrossEncoder.from_encoder(tiny_model_dir(), bf16=False, device="cpu")
    with torch.no_grad():
        torch.manual_seed(3)
        ce.classifier.weight.normal_(0, 1.0)
    path = str(tmp_path_factory.mktemp("rerank") / "ce")
    ce.save_pretrained(path)
    return path


def _reference_topk(encoder, docs, query, k):
    """Brute-force cosine search in numpy: the reference the pipeline must reproduce."""
    d = encoder.encode_documents([document_text({"title": x["title"], "text": x["text"]}) for x in docs])
    q = encoder.encode_queries([query])[0]
    d = d / np.linalg.norm(d, axis=1, keepdims=True)
    q = q / np.linalg.norm(q)
    s = d @ q  # (N,)
    order = sorted(range(len(docs)), key=lambda i: (-s[i], docs[i]["_id"]))[:k]
    return [docs[i]["_id"] for i in order], s[order]


def test_dense_search_matches_brute_force(built, encoder, docs):
    for query in ["tea coffee cold", "gene protein expression", "patient drug dose trial risk"]:
        hits = built.search(query, k=7)
        ids, scores = _reference_topk(encoder, docs, query, 7)
        assert [h.id for h in hits] == ids
        np.testing.assert_allclose([h.score for h in hits], scores, rtol=1e-5, atol=1e-5)
        assert [h.rank for h in hits] == list(range(1, 8))
        assert all(h.first_stage_rank == h.rank and h.rerank_score is None for h in hits)


def test_hits_carry_the_documents(built, docs):
    by_id = {d["_id"]: d for d in docs}
    target = next(d for d in docs if len(d["text"].split()) < 12)  # short: not truncated as a query
    hit = built.search(document_text(target), k=1)[0]  # a document's own text is its nearest neighbour
    assert isinstance(hit, Hit)
    assert hit.id == target["_id"] and hit.score == pytest.approx(1.0, abs=1e-5)
    assert (hit.title, hit.text) == (by_id[hit.id]["title"], by_id[hit.id]["text"])
    assert set(hit.to_dict()) >= {"id", "title", "text", "score", "rank", "first_stage_score", "rerank_score"}


def test_batch_equals_single(built):
    queries = ["tea", "cell gene virus", "brain heart lung"]
    batch = built.search(queries, k=5)
    assert len(batch) == 3
    for q, hits in zip(queries, batch):
        single = built.search(q, k=5)
        assert [h.id for h in hits] == [h.id for h in single]
        np.testing.assert_allclose([h.score for h in hits], [h.score for h in single], atol=1e-5)


def test_k_larger_than_corpus_returns_everything(built):
    hits = built.search("tea", k=100, recall_k=100)
    assert len(hits) == N_DOCS and len({h.id for h in hits}) == N_DOCS


def test_hybrid_rrf_fuses_dense_and_bm25(built):
    query = "green tea leaf drink"
    hits = built.search(query, k=10, recall_k=30, hybrid=True)
    qv = built.encoder.encode_queries([query])
    dense = built.store.search(qv, 30)
    lex = built.store.search_bm25([query], 30)
    d_ids = [i for i in dense.ids[0] if i]
    b_ids = [i for i in lex.ids[0] if i]
    expected = reciprocal_rank_fusion([d_ids, b_ids], k=60, limit=10)
    assert [h.id for h in hits] == [i for i, _ in expected]
    np.testing.assert_allclose([h.first_stage_score for h in hits], [s for _, s in expected])
    d_score = dict(zip(d_ids, dense.scores[0]))
    b_score = dict(zip(b_ids, lex.scores[0]))
    for h in hits:
        assert h.dense_score == pytest.approx(d_score.get(h.id)) if h.id in d_score else h.dense_score is None
        assert h.bm25_score == pytest.approx(b_score.get(h.id)) if h.id in b_score else h.bm25_score is None
    # minmax score fusion with weights goes through score_fusion
    hits = built.search(query, k=5, recall_k=30, hybrid=True, fusion="minmax", weights=[0.8, 0.2])
    expected = score_fusion([dict(zip(d_ids, dense.scores[0].tolist())), dict(zip(b_ids, lex.scores[0].tolist()))],
                            weights=[0.8, 0.2], limit=5)
    assert [h.id for h in hits] == [i for i, _ in expected]


def test_hybrid_needs_bm25(tmp_path, encoder, docs):
    with SearchPipeline.build(write_corpus(str(tmp_path / "c.jsonl"), docs[:10]), tmp_path / "idx", encoder,
                              progress=False) as pipe:
        with pytest.raises(ValueError, match="without BM25"):
            pipe.search("tea", hybrid=True)
        with pytest.raises(ValueError, match="without BM25"):
            pipe.search("tea", bm25=True)


def test_bm25_recall_is_bm25s_ranking_without_the_query_encoder(built, monkeypatch):
    """bm25=True: the first stage is the index's BM25 list, scores and ranks, and no query vector is computed."""
    query = "green tea leaf drink"
    lex = built.store.search_bm25([query], 30)
    ids = [i for i in lex.ids[0] if i]

    def no_encoding(*args, **kwargs):
        raise AssertionError("BM25 recall ran the query encoder")

    monkeypatch.setattr(built.encoder, "encode_queries", no_encoding)
    hits = built.search(query, k=10, recall_k=30, bm25=True)
    assert [h.id for h in hits] == ids[:10]
    np.testing.assert_allclose([h.first_stage_score for h in hits], lex.scores[0][:10], rtol=1e-6)
    assert [h.first_stage_rank for h in hits] == list(range(1, 11)) and [h.rank for h in hits] == list(range(1, 11))
    assert built.search([query, "gene cell"], k=3, bm25=True)[0] == built.search(query, k=3, bm25=True)  # batched
    with pytest.raises(ValueError, match="bm25=True recalls by BM25 alone and hybrid=True fuses BM25 with dense"):
        built.search(query, hybrid=True, bm25=True)


def test_bm25_recall_reranks_with_the_weight_chosen_over_bm25(built, reranker_dir, encoder, tmp_path):
    """A reranker that stored a weight for "bm25" (`twotower train reranker` without --teacher) applies it to
    BM25 recall, and reorders BM25's candidates by its scores."""
    import shutil

    from twotower.retrieval.cross_encoder import CrossEncoder
    from twotower.retrieval.interpolation import write_alpha

    staged = str(tmp_path / "ce")
    shutil.copytree(reranker_dir, staged)
    write_alpha(staged, 0.0, {"dense": 0.0, "bm25": 1.0})
    query = "coffee cup hot milk sugar"
    with SearchPipeline.load(built.directory, encoder, reranker=staged, bf16=False) as pipe:
        assert (pipe.rerank_alpha(bm25=True), pipe.rerank_alpha()) == (1.0, 0.0)
        assert pipe.rerank_alpha_chosen_over(bm25=True) == "bm25" and pipe.rerank_alpha_chosen_over() == "dense"
        recall = pipe.search(query, k=20, recall_k=20, rerank=False, bm25=True)
        hits = pipe.search(query, k=5, recall_k=20, bm25=True)
        scores = CrossEncoder.from_pretrained(staged, bf16=False, device="cpu").predict(
            [(query, document_text({"title": h.title, "text": h.text})) for h in recall])
        assert_ranked_by_scores(hits, [h.id for h in recall], scores)
        first = {h.id: h for h in recall}
        assert all((h.first_stage_rank, h.first_stage_score) == (first[h.id].rank, first[h.id].score) for h in hits)
        assert all(h.rerank_score is None for h in pipe.search(query, k=5, recall_k=20))  # dense: weight 0
        # a query no document shares a word with: BM25 recalls nothing, and nothing is reranked
        assert pipe.search(["qqqxv zzzyx", query], k=5, bm25=True)[0] == []
    # A reranker without a "bm25" weight applies its general one, and names the stage that was chosen over.
    write_alpha(staged, 0.7, {"dense": 0.7, "hybrid": 0.2})
    with SearchPipeline.load(built.directory, encoder, reranker=staged, bf16=False) as pipe:
        assert pipe.rerank_alpha(bm25=True) == 0.7 and pipe.rerank_alpha_chosen_over(bm25=True) == "dense"
        assert pipe.rerank_alpha(hybrid=True) == 0.2 and pipe.rerank_alpha_chosen_over(hybrid=True) == "hybrid"


def test_rerank_orders_candidates_by_cross_encoder(built, reranker_dir, encoder):
    from twotower.retrieval.cross_encoder import CrossEncoder

    pipe = SearchPipeline.load(built.directory, encoder, reranker=reranker_dir, bf16=False)
    try:
        query = "coffee cup hot milk sugar"
        recall = pipe.search(query, k=20, recall_k=20, rerank=False)
        hits = pipe.search(query, k=5, recall_k=20)
        ce = CrossEncoder.from_pretrained(reranker_dir, bf16=False, device="cpu")
        scores = ce.predict([(query, document_text({"title": h.title, "text": h.text})) for h in recall])
        assert_ranked_by_scores(hits, [h.id for h in recall], scores)
        first = {h.id: h for h in recall}
        for h in hits:
            assert h.score == h.rerank_score
            assert (h.first_stage_rank, h.first_stage_score) == (first[h.id].rank, pytest.approx(first[h.id].score))
        # rerank=False gives the recall order back
        assert [h.id for h in pipe.search(query, k=5, recall_k=20, rerank=False)] == [h.id for h in recall[:5]]
    finally:
        pipe.close()


def test_windowed_reranker_reads_whole_documents_with_their_titles(built, reranker_dir, encoder, tmp_path):
    """A reranker with windows gets each candidate as (title, text) and scores it by its best window."""
    from twotower.retrieval.cross_encoder import CrossEncoder, RerankWindows

    ce = CrossEncoder.from_pretrained(reranker_dir, bf16=False, device="cpu")
    ce.windows = RerankWindows(5, 3)
    path = str(tmp_path / "windowed")
    ce.save_pretrained(path)
    with SearchPipeline.load(built.directory, encoder, reranker=path, bf16=False) as pipe:
        query = "coffee cup hot milk sugar"
        recall = pipe.search(query, k=20, recall_k=20, rerank=False)
        hits = pipe.search(query, k=20, recall_k=20, rerank_alpha=1.0)
    scores = ce.predict([(query, (h.title or "", h.text)) for h in recall])
    assert any(len(ce.document_windows([(h.title or "", h.text)])[0]) > 1 for h in recall), "needs long documents"
    assert sorted(h.id for h in hits) == sorted(h.id for h in recall)
    assert_ranked_by_scores(hits, [h.id for h in recall], scores)


def test_fallback_reranker_only_when_neither_the_caller_nor_the_index_names_one(built, reranker_dir, tmp_path, docs,
                                                                                 encoder):
    """`fallback_reranker` (what `search --rerank` passes) never overrides a reranker given or recorded."""
    mine, fallback = object(), object()
    with SearchPipeline.load(built.directory, encoder, fallback_reranker=fallback) as pipe:
        assert pipe.reranker is fallback  # the index records none
    with SearchPipeline.load(built.directory, encoder, reranker=mine, fallback_reranker=fallback) as pipe:
        assert pipe.reranker is mine
    corpus = write_corpus(str(tmp_path / "c.jsonl"), docs[:10])
    SearchPipeline.build(corpus, tmp_path / "own", encoder, reranker=reranker_dir, progress=False).close()
    with SearchPipeline.load(tmp_path / "own", encoder, fallback_reranker=fallback, bf16=False) as pipe:
        assert pipe.reranker is not fallback and pipe.reranker is not None  # the index's own
    with SearchPipeline.load(tmp_path / "own", encoder, use_default_reranker=False, fallback_reranker=fallback) as pipe:
        assert pipe.reranker is fallback  # the index's own was declined; the caller's fallback stands


def test_search_vectors_equals_search(built):
    queries = ["tea cold", "virus mouse"]
    qv = built.encoder.encode_queries(queries)
    a = built.search_vectors(qv, k=4)
    b = built.search(queries, k=4)
    assert [[h.id for h in x] for x in a] == [[h.id for h in x] for x in b]


def test_fetch_documents_false_gives_the_same_ranking_without_text(built):
    full = built.search(["tea cold", "gene"], k=5)
    bare = built.search(["tea cold", "gene"], k=5, fetch_documents=False)
    for a, b in zip(full, bare):
        assert [(h.id, h.score, h.rank) for h in a] == [(h.id, h.score, h.rank) for h in b]
        assert all(h.title is None and h.text is None for h in b)
        assert all(isinstance(h.text, str) for h in a)


def test_bad_queries(built):
    with pytest.raises(ValueError, match="query is empty"):
        built.search("   ")
    with pytest.raises(ValueError, match="query 1 is empty"):
        built.search(["tea", ""])
    # not text: the tokenizer raised a TypeError on a lone surrogate, and invisible queries got arbitrary hits
    with pytest.raises(ValueError, match=r"query 1 holds a lone surrogate '\\udc80' at character 4"):
        built.search(["tea", "tea \udc80"])
    for invisible in ("\x00", "\u200b", " \u2060\ufeff "):
        with pytest.raises(ValueError, match="^query holds only control or invisible characters$"):
            built.search(invisible)
    assert built.search("tea\u200bcup", k=1)  # an invisible character among words is fine
    for bad, name in ((5, "int"), (b"tea", "bytes"), (None, "NoneType")):  # "'int' object is not iterable"
        with pytest.raises(TypeError, match=f"queries must be a str or a list of str, got {name}$"):
            built.search(bad)
    with pytest.raises(TypeError, match="query 1 is int, not str"):
        built.search(("tea", 7))
    with pytest.raises(ValueError, match="recall_k"):
        built.search("tea", k=10, recall_k=5)
    with pytest.raises(ValueError, match="k must be"):
        built.search("tea", k=0)
    with pytest.raises(ValueError, match="fusion"):
        built.search("tea", hybrid=True, fusion="max")
    assert built.search([]) == []


def test_long_query_is_truncated_with_a_warning(built):
    long_query = " ".join(["tea coffee"] * 50)  # > 40 positions of the tiny model
    with pytest.warns(UserWarning, match=r"1 query longer than the query encoder's maximum of 40 tokens"):
        hits = built.search(long_query, k=3)
    assert len(hits) == 3
    truncated = built.encoder.query_tower.tokenizer.decode(
        built.encoder.query_tower.tokenize([long_query]).input_ids[0].tolist())
    assert [h.id for h in hits] == [h.id for h in built.search(truncated, k=3)]


def test_add_and_delete(tmp_path, encoder, docs):
    corpus = write_corpus(str(tmp_path / "c.jsonl"), docs[:20])
    with SearchPipeline.build(corpus, tmp_path / "idx", encoder, metric="cosine", progress=False) as pipe:
        new = {"_id": "new1", "title": "", "text": "black black black tea tea"}
        assert pipe.add([new]) == 1
        assert len(pipe) == 21
        assert pipe.search(new["text"], k=1)[0].id == "new1"
        with pytest.raises(ValueError, match="duplicate document id 'new1'"):
            pipe.add([{"_id": "new1", "text": "other"}])
        assert len(pipe) == 21
        assert pipe.add([{"_id": "new1", "text": "other"}], on_duplicate="skip") == 0
        assert pipe.store.get(["new1"])[0]["text"] == new["text"]
        assert pipe.add([{"_id": "new1", "text": "gene cell protein gene"}], on_duplicate="replace") == 1
        assert pipe.store.get(["new1"])[0]["text"] == "gene cell protein gene"
        assert pipe.search("gene cell protein gene", k=1)[0].id == "new1"
        assert len(pipe) == 21
        missing = pipe.delete(["new1", "d0", "nope"])
        assert missing == ["nope"]
        assert len(pipe) == 19
        ids = {h.id for h in pipe.search("tea", k=19)}
        assert "new1" not in ids and "d0" not in ids
    # the changes were committed: a fresh reader sees them
    with SearchPipeline.load(tmp_path / "idx", encoder) as again:
        assert len(again) == 19
        with pytest.raises(ValueError, match="read-only"):
            again.add([{"_id": "x", "text": "tea"}])


def test_integer_ids_are_the_ids_add_stored(tmp_path, encoder, docs):
    with SearchPipeline.build(docs[:5], tmp_path / "idx", encoder, progress=False) as pipe:
        pipe.add([{"_id": 77, "text": "seven seven"}])
        assert pipe.get([77])[0]["id"] == "77"  # was None
        assert pipe.delete([77, 78]) == ["78"] and pipe.get(["77"]) == [None]  # 77 was "not in the index"
        for bad, words in (([None], "id 0 is NoneType"), ([True], "id 0 is bool"), ("d1", "wrap a single id")):
            with pytest.raises(TypeError, match=words):
                pipe.delete(bad)
            with pytest.raises(TypeError, match=words):
                pipe.get(bad)
        assert len(pipe) == 5


def test_add_from_file_with_duplicates(tmp_path, encoder, docs, caplog):
    corpus = write_corpus(str(tmp_path / "c.jsonl"), docs[:10])
    more = write_corpus(str(tmp_path / "more.jsonl"), [docs[3], {"_id": "z", "text": "milk"}])
    with SearchPipeline.build(corpus, tmp_path / "idx", encoder, progress=False) as pipe:
        with pytest.raises(ValueError, match=r"more.jsonl:1: duplicate document id 'd3' \(already in the index\)"):
            pipe.add(more)
        assert len(pipe) == 10
        assert pipe.add(more, on_duplicate="skip") == 1
        assert len(pipe) == 11
        # in memory, two copies of one new id: the last is kept
        assert pipe.add([{"_id": "r", "text": "one"}, {"_id": "r", "text": "two"}], on_duplicate="replace") == 1
        assert pipe.get(["r"])[0]["text"] == "two"
    # what was not indexed is counted (the lines were dropped without a word)
    assert [r.getMessage() for r in caplog.records if "duplicate" in r.getMessage()] == [
        "1 duplicate document not indexed: kept the first copy, or the one already in the index (on duplicate: "
        "skip)",
        "1 duplicate document not indexed: kept the last copy (on duplicate: replace)"]


def test_add_with_empty_documents(tmp_path, encoder, docs, caplog):
    corpus = write_corpus(str(tmp_path / "c.jsonl"), docs[:5])
    new = [{"_id": "e1", "text": " "}, {"_id": "n1", "text": "green tea"}, {"_id": "e2", "title": "", "text": ""}]
    more = write_corpus(str(tmp_path / "more.jsonl"), new)
    with SearchPipeline.build(corpus, tmp_path / "idx", encoder, progress=False) as pipe:
        with pytest.raises(ValueError, match=r"more.jsonl:1: document 'e1' has empty 'text' and 'title'; use "
                                             r"--on-empty skip to leave such documents out"):
            pipe.add(more)
        with pytest.raises(ValueError, match=r"docs\[0\]: document 'e1' has empty 'text' and 'title'"):
            pipe.add(new)
        assert len(pipe) == 5
        assert pipe.add(more, on_empty="skip") == 1
        assert pipe.add(new, on_empty="skip", on_duplicate="replace") == 1  # in memory too
        assert len(pipe) == 6 and pipe.get(["e1", "e2"]) == [None, None]
        assert pipe.add([{"_id": f"x{i}", "text": ""} for i in range(1200)], on_empty="skip") == 0
    assert [r.getMessage() for r in caplog.records if "empty" in r.getMessage()] == [
        "2 empty documents (blank 'text' and 'title') not indexed: 'e1', 'e2' (on empty: skip)"] * 2 + [
        "1,200 empty documents (blank 'text' and 'title') not indexed: 'x0', 'x1', 'x2', 'x3', 'x4', ... "
        "(on empty: skip)"]


def test_save_copy_and_load(built, tmp_path, encoder):
    target = built.save(tmp_path / "copy")
    assert target == str(tmp_path / "copy")
    with SearchPipeline.load(target, encoder) as copy:
        a = [h.id for h in copy.search("tea milk", k=5)]
        assert a == [h.id for h in built.search("tea milk", k=5)]
        assert len(copy) == len(built)
        assert [h.id for h in copy.search("tea milk", k=5, hybrid=True)] == \
            [h.id for h in built.search("tea milk", k=5, hybrid=True)]
    with pytest.raises(FileExistsError):
        built.save(tmp_path / "copy")
    # an index inside the index (it was written, and `index check` passed)
    with pytest.raises(ValueError, match="inside the index .*; copy it to a directory outside it"):
        built.save(os.path.join(built.directory, "inner"))
    assert not os.path.exists(os.path.join(built.directory, "inner"))


def test_load_uses_the_recorded_model(built):
    # no model given: from the manifest (fp32 like `built`: bf16 "auto" would differ on a bf16 CPU near ties)
    with SearchPipeline.load(built.directory, bf16=False) as pipe:
        assert pipe.encoder.fingerprint() == built.encoder.fingerprint()
        assert [h.id for h in pipe.search("tea", k=3)] == [h.id for h in built.search("tea", k=3)]


def test_build_from_documents_and_ivf(tmp_path, encoder):
    docs = toy_docs(300, seed=5)
    with SearchPipeline.build(docs, tmp_path / "ivf", encoder, factory="IVF4,Flat", metric="cosine",
                              progress=False) as pipe:
        assert pipe.info()["factory"] == "IVF4,Flat" and len(pipe) == 300
        target = next(d for d in docs[100:] if len(d["text"].split()) < 12)
        assert pipe.search(document_text(target), k=1)[0].id == target["_id"]
    assert not list(tmp_path.glob(".corpus-*"))  # the temporary corpus file is gone


def test_bad_in_memory_documents_are_named_by_position(tmp_path, encoder):
    with pytest.raises(ValueError, match=r"docs\[1\]: missing string field 'text'"):
        SearchPipeline.build([{"_id": "a", "text": "tea"}, {"_id": "b"}], tmp_path / "idx", encoder, progress=False)
    with pytest.raises(ValueError, match="no documents given"):
        SearchPipeline.build([], tmp_path / "idx", encoder, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_build_refuses_existing_directory(tmp_path, encoder, docs):
    """Each case in Python's words: it said "add documents with `twotower index add`" to a Python caller, for a
    plain file and someone's own directory too."""
    corpus = write_corpus(str(tmp_path / "c.jsonl"), docs[:3])
    out = tmp_path / "idx"
    out.mkdir()
    (out / "something").write_text("x")
    with pytest.raises(FileExistsError, match="a directory that is not empty; give a new or empty directory for the index"):
        SearchPipeline.build(corpus, out, encoder, progress=False)
    with pytest.raises(FileExistsError, match="a file; give the name of a new directory for the index"):
        SearchPipeline.build(corpus, out / "something", encoder, progress=False)
    SearchPipeline.build(corpus, tmp_path / "index", encoder, progress=False).close()
    with pytest.raises(FileExistsError, match=r"already an index; add the documents to it with SearchPipeline\.load"
                                              r"\(.*readonly=False\)\.add\(docs\), or remove it first$"):
        SearchPipeline.build(corpus, tmp_path / "index", encoder, progress=False)
    IndexStore.create(tmp_path / "unborn", encoder.dim, "Flat").close()  # generation 0, as a failed with block
    with pytest.raises(FileExistsError, match=r"unborn: an empty index, at generation 0 \(nothing was ever "
                                              r"committed to it.*\); remove the directory, or give a new one$"):
        SearchPipeline.build(corpus, tmp_path / "unborn", encoder, progress=False)


def test_a_k_past_the_index_recalls_no_deeper_than_the_index(built, monkeypatch):
    """k=3_000_000 on a small index took 7.7 s: recall_k = max(100, k) went down to every layer."""
    from twotower.indexing import Snapshot

    asked = []
    search = Snapshot.search
    monkeypatch.setattr(Snapshot, "search", lambda self, q, k=10, **kw: (asked.append(k), search(self, q, k, **kw))[1])
    hits = built.search("tea", k=3_000_000, hybrid=True)
    assert len(hits) == N_DOCS and asked and max(asked) <= N_DOCS
    assert [h.id for h in hits[:5]] == [h.id for h in built.search("tea", k=5, hybrid=True)]


def test_k_is_any_integer_but_not_a_bool(built):
    """k=np.int64(2) was refused where IndexStore.search takes it, and k=True was searched as k=1."""
    assert len(built.search("tea", k=np.int64(2), recall_k=np.int64(5))) == 2
    vec = built.encoder.encode_queries(["tea"])
    assert len(built.search_vectors(vec, k=np.int64(2))[0]) == 2
    for call in (lambda: built.search("tea", k=True), lambda: built.search_vectors(vec, k=True)):
        with pytest.raises(ValueError, match="k must be a positive int, got True"):
            call()
    with pytest.raises(ValueError, match="recall_k"):
        built.search("tea", k=1, recall_k=True)


def test_search_vectors_with_one_vector_returns_one_list(built):
    """As search("text") returns one list of hits; a (D,) vector gave a list of one list."""
    vec = built.encoder.encode_queries("tea")  # (D,)
    one = built.search_vectors(vec, k=3)
    assert len(one) == 3 and all(isinstance(h, Hit) for h in one)
    assert [h.id for h in one] == [h.id for h in built.search_vectors(vec[None, :], k=3)[0]]
    assert [h.id for h in built.search_vectors(vec, k=3, fetch_documents=False)] == [h.id for h in one]


def test_refresh_moves_a_reader_to_the_newest_commit(tmp_path, encoder, docs):
    """A loaded pipeline never saw another process's add or delete; only the internal store.refresh() did."""
    with SearchPipeline.build(docs[:5], tmp_path / "idx", encoder, progress=False) as writer:
        reader = SearchPipeline.load(tmp_path / "idx", encoder)
        assert reader.refresh() is False
        writer.delete([docs[0]["_id"]])
        assert reader.contains([docs[0]["_id"]]) == [True]  # still the commit it opened
        assert reader.refresh() is True
        assert reader.contains([docs[0]["_id"]]) == [False] and len(reader) == 4
        assert docs[0]["_id"] not in [h.id for h in reader.search("tea", k=5)]
        reader.close()
        with pytest.raises(ValueError, match="refresh"):
            writer.refresh()


def test_a_large_k_alone_raises_the_recall_depth(built):
    """search(q, k=1000) without recall_k was refused ("recall_k (100) must be >= k (1000)"): not given,
    recall_k is max(100, k). A recall_k the caller gave below k is still refused; k <= 100 is unchanged."""
    hits = built.search("tea", k=150)
    assert len(hits) == N_DOCS and [h.id for h in hits[:100]] == [h.id for h in built.search("tea", k=100)]
    assert [(h.id, h.score) for h in built.search("tea", k=7)] == \
        [(h.id, h.score) for h in built.search("tea", k=7, recall_k=100)]
    with pytest.raises(ValueError, match=r"recall_k \(50\) must be an int >= k \(150\); leave it out to recall "
                                         r"max\(100, k\)"):
        built.search("tea", k=150, recall_k=50)


def test_fusion_settings_without_hybrid_are_refused(built):
    """weights, fusion and rrf_k were ignored without a word with hybrid=False, where rerank_k without a
    reranker is refused; rrf_k is refused with a score fusion too. Not given (None) is not refused."""
    for kw in ({"fusion": "rrf"}, {"rrf_k": 30}, {"weights": [0.5, 0.5]}):
        with pytest.raises(ValueError, match=f"^{next(iter(kw))} set how hybrid search fuses dense and BM25 recall, "
                                             "but hybrid=False: pass hybrid=True, or leave them out$"):
            built.search("tea", **kw)
    with pytest.raises(ValueError, match="^fusion and weights set how"):
        built.search("tea", fusion="minmax", weights=[1, 1])
    with pytest.raises(ValueError, match="rrf_k is the constant of reciprocal-rank fusion .* fusion='zscore'"):
        built.search("tea", hybrid=True, fusion="zscore", rrf_k=10)
    default = built.search("green tea", k=5, hybrid=True)
    assert [h.id for h in built.search("green tea", k=5, hybrid=True, fusion="rrf", rrf_k=60)] == \
        [h.id for h in default]


def test_build_and_load_name_the_directory_argument(encoder, docs):
    """SearchPipeline.build(docs, None) failed in os.path ("expected str, bytes or os.PathLike object, not
    NoneType"), naming no argument."""
    with pytest.raises(TypeError, match="^directory must be a path \\(str or os.PathLike\\), got NoneType$"):
        SearchPipeline.build(docs[:3], None, encoder, progress=False)
    with pytest.raises(TypeError, match="^directory must be a path \\(str or os.PathLike\\), got int$"):
        SearchPipeline.load(3, encoder)


def test_documents_as_tuples_and_one_mapping_refused(tmp_path, encoder):
    """(id, text) and (id, text, metadata) tuples are documents (txtai's Embeddings.index form) in build and add;
    add({...}) said "docs[0]: expected a JSON object, got str" (it iterated the keys), where build refused a
    mapping clearly: both refuse it the same way now."""
    with SearchPipeline.build([("t1", "green tea leaf"), ("t2", "black coffee cup", {"lang": "en"})],
                              tmp_path / "idx", encoder, progress=False) as pipe:
        assert pipe.get(["t1", "t2"]) == [
            {"id": "t1", "title": "", "text": "green tea leaf", "metadata": {}},
            {"id": "t2", "title": "", "text": "black coffee cup", "metadata": {"lang": "en"}}]
        assert pipe.add([(7, "milk sugar"), ("t4", "hot milk", None)]) == 2
        assert pipe.get([7, "t4"])[0]["text"] == "milk sugar" and len(pipe) == 4
        for one in ({"_id": "t5", "text": "tea"}, ("t5", "tea")):
            with pytest.raises(TypeError, match=r"^docs must be a path or an iterable of documents \(mappings, or "
                                                r"\(id, text\[, metadata\]\) tuples\), got (dict|tuple); wrap a "
                                                r"single document in a list$"):
                pipe.add(one)
        with pytest.raises(TypeError, match="^corpus must be a path or an iterable of documents .* wrap a single"):
            SearchPipeline.build(("t1", "tea"), tmp_path / "other", encoder, progress=False)
        with pytest.raises(ValueError, match=r"^docs\[1\]: a document tuple is \(id, text\) or \(id, text, "
                                             r"metadata\), got 4 items$"):
            pipe.add([("t6", "tea"), ("t7", "tea", {}, "x")])
        with pytest.raises(ValueError, match=r"^docs\[0\]: expected a document: a mapping with _id and text, or an "
                                             r"\(id, text\[, metadata\]\) tuple; got str$"):
            pipe.add(["green tea"])
        assert len(pipe) == 4


def test_hits_carry_the_metadata_read_with_the_document(tmp_path, encoder):
    """Hit.metadata: the document's metadata, read in the same lookup as its title and text (None without
    fetch_documents)."""
    docs = [{"_id": "m1", "text": "green tea leaf", "metadata": {"lang": "en", "year": 2020}},
            {"_id": "m2", "text": "black coffee cup"}]
    with SearchPipeline.build(docs, tmp_path / "idx", encoder, progress=False) as pipe:
        hits = {h.id: h for h in pipe.search("green tea leaf", k=2)}
        assert hits["m1"].metadata == {"lang": "en", "year": 2020} and hits["m2"].metadata == {}
        assert hits["m1"].to_dict()["metadata"] == {"lang": "en", "year": 2020}
        assert all(h.metadata is None for h in pipe.search("green tea leaf", k=2, fetch_documents=False))


def test_repr_says_whether_a_reranker_is_loaded(built, reranker_dir, encoder):
    assert repr(built).endswith("reranker=None)")
    with SearchPipeline.load(built.directory, encoder, reranker=reranker_dir, bf16=False) as pipe:
        assert "reranker=CrossEncoder(layers=" in repr(pipe) and "\n" not in repr(pipe)
