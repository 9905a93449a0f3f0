"""SearchPipeline.search(filter=...): dense, BM25, hybrid and reranked search see only matching documents."""

from __future__ import annotations

import pytest

from tests.retrieval.pipeline_fixtures import tiny_model_dir, toy_docs, write_corpus
from tests.retrieval.test_pipeline import reranker_dir  # noqa: F401  (a random-weight CrossEncoder)
from twotower.indexing.filters import FilterError, parse_filter
from twotower.retrieval import DualEncoder, SearchPipeline, reciprocal_rank_fusion

N_DOCS = 60


def with_metadata(docs: list[dict]) -> list[dict]:
    """Half the documents carry metadata in BEIR's ``metadata`` object, half as extra top-level fields."""
    out = []
    for i, d in enumerate(docs):
        fields = {"lang": ["en", "fr", "de"][i % 3], "year": 2000 + i % 10, "pick": i in (7, 21, 40)}
        out.append({**d, "metadata": fields} if i % 2 else {**d, **fields})
    return out


@pytest.fixture(scope="module")
def docs():
    return with_metadata(toy_docs(N_DOCS))


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory, docs):
    root = tmp_path_factory.mktemp("pipe-filter")
    corpus = write_corpus(str(root / "corpus.jsonl"), docs)
    encoder = DualEncoder.from_pretrained(tiny_model_dir(), bf16=False)
    SearchPipeline.build(corpus, root / "idx", encoder, metric="cosine", bm25=True, progress=False).close()
    return str(root / "idx")


@pytest.fixture(scope="module")
def pipe(index_dir):
    with SearchPipeline.load(index_dir, tiny_model_dir(), use_default_reranker=False) as p:
        yield p


def matching(docs, text):
    flt = parse_filter(text)
    return {d["_id"] for d in docs if flt.matches(d.get("metadata") or {k: d[k] for k in ("lang", "year", "pick")})}


@pytest.mark.parametrize("text", ['lang == "fr"', "year >= 2005 and lang != 'de'", "pick == true"])
def test_dense_filter_is_the_unfiltered_ranking_restricted(pipe, docs, text):
    allowed = matching(docs, text)
    query = "green tea leaf drink"
    full = [h.id for h in pipe.search(query, k=N_DOCS, recall_k=N_DOCS, rerank=False)]
    hits = pipe.search(query, k=5, recall_k=20, rerank=False, filter=text)
    assert [h.id for h in hits] == [i for i in full if i in allowed][:5]
    assert len(hits) == min(5, len(allowed))


def test_hybrid_fuses_filtered_dense_and_filtered_bm25(pipe, docs):
    text = 'lang == "en" or year == 2003'
    allowed = matching(docs, text)
    query = "coffee cup hot water"
    hits = pipe.search(query, k=8, recall_k=20, hybrid=True, rerank=False, filter=text)
    assert hits and {h.id for h in hits} <= allowed
    dense = pipe.store.search(pipe.encoder.encode_queries([query]), 20, filter=text)
    lex = pipe.store.search_bm25([query], 20, filter=text)
    fused = reciprocal_rank_fusion([[i for i in dense.ids[0] if i], [i for i in lex.ids[0] if i]], k=60, limit=8)
    assert [h.id for h in hits] == [i for i, _ in fused]


def test_bm25_filter_is_the_unfiltered_bm25_ranking_restricted(pipe, docs):
    text = 'lang == "en" or year == 2003'
    allowed = matching(docs, text)
    query = "coffee cup hot water"
    full = [i for i in pipe.store.search_bm25([query], N_DOCS).ids[0] if i]  # BM25's own unfiltered ranking
    hits = pipe.search(query, k=5, recall_k=20, rerank=False, bm25=True, filter=text)
    assert len(hits) == 5 and [h.id for h in hits] == [i for i in full if i in allowed][:5]
    assert [h.id for h in hits] != [h.id for h in pipe.search(query, k=5, recall_k=20, rerank=False, filter=text)]


def test_reranked_search_sees_only_matching_documents(index_dir, docs, reranker_dir):  # noqa: F811
    with SearchPipeline.load(index_dir, tiny_model_dir(), reranker=reranker_dir) as p:
        for query in ("tea", "gene protein cancer"):
            hits = p.search(query, k=3, recall_k=10, filter=parse_filter("pick == true"))
            assert {h.id for h in hits} == matching(docs, "pick == true")
            assert all(h.rerank_score is not None for h in hits)


def test_filter_errors(pipe):
    with pytest.raises(FilterError, match=r"unknown field 'langauge' at column 1: .*known fields: lang, pick, year"):
        pipe.search("tea", filter='langauge == "en"')
    with pytest.raises(FilterError, match="filter: unexpected end of filter|expected a value"):
        pipe.search("tea", filter="year >=")
    assert pipe.search("tea", k=3, rerank=False, filter='lang == "xx"') == []


def test_search_vectors_takes_the_same_filter(pipe, docs):
    text = 'lang == "de" and year < 2006'
    allowed = matching(docs, text)
    qvec = pipe.encoder.encode_queries(["green tea leaf drink"])  # (1, D)
    full = [h.id for h in pipe.search_vectors(qvec, k=N_DOCS)[0]]
    for fetch in (True, False):
        (hits,) = pipe.search_vectors(qvec, k=5, filter=text, fetch_documents=fetch)
        assert [h.id for h in hits] == [i for i in full if i in allowed][:5]
    with pytest.raises(FilterError):
        pipe.search_vectors(qvec, k=5, filter="lang ==")
