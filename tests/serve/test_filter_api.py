"""The ``filter`` of GET and POST /search: matching hits only; a bad filter is a 400 naming ``filter``."""

from __future__ import annotations

import pytest

from tests.retrieval.pipeline_fixtures import toy_docs, write_corpus
from tests.serve.serve_fixtures import client


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> str:
    from tests.retrieval.pipeline_fixtures import tiny_model_dir
    from twotower.retrieval import SearchPipeline

    root = tmp_path_factory.mktemp("serve-filter")
    docs = [{**d, "metadata": {"tenant": f"t{i % 3}", "year": 2000 + i}} for i, d in enumerate(toy_docs(30))]
    corpus = write_corpus(str(root / "corpus.jsonl"), docs)
    SearchPipeline.build(corpus, root / "idx", tiny_model_dir(), bm25=True, progress=False).close()
    return str(root / "idx")


def tenant_and_year(hit_id: str) -> tuple[str, int]:
    n = int(hit_id[1:])
    return f"t{n % 3}", 2000 + n


def test_get_and_post_filter(index):
    with client(index) as c:
        r = c.get("/search", params={"q": "tea", "k": 5, "filter": 'tenant == "t1" and year >= 2010'})
        assert r.status_code == 200, r.text
        hits = r.json()["hits"]
        assert len(hits) == 5 and all(tenant_and_year(h["id"])[0] == "t1" and tenant_and_year(h["id"])[1] >= 2010
                                      for h in hits)
        r = c.post("/search", json={"queries": ["tea", "gene"], "k": 4, "hybrid": True, "filter": "year < 2003"})
        assert r.status_code == 200, r.text
        for res in r.json()["results"]:
            assert sorted(h["id"] for h in res["hits"]) == ["d0", "d1", "d2"]  # 3 match: k is not padded
        unfiltered = c.get("/search", params={"q": "tea", "k": 5, "filter": ""}).json()["hits"]  # blank: none
        assert unfiltered == c.get("/search", params={"q": "tea", "k": 5}).json()["hits"]


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("text, words, column", [
    ("year >= 2010 )", "filter: unexpected ')' at column 14", 14),
    ("tenant = 't1'", "use '=='", 8),
    ("teanant == 't1'", "unknown field 'teanant' at column 1: teanant == 't1' (known fields: tenant, year)", 1),
])
def test_bad_filter_is_a_400_naming_the_field(index, method, text, words, column):
    with client(index) as c:
        if method == "GET":
            r = c.get("/search", params={"q": "tea", "filter": text})
        else:
            r = c.post("/search", json={"queries": ["tea"], "filter": text})
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["field"] == "filter" and words in body["message"] and body["details"] == {"column": column}
        assert c.get("/search", params={"q": "tea"}).status_code == 200  # the server is fine afterwards
