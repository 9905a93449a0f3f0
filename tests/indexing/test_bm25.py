"""BM25: ranking behaviour, parity with the Lucene BM25 formula, updates, persistence, SciFact."""

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import Stemmer

from twotower.indexing import BM25, IndexFormatError, document_text

CORPUS = {
    "cats": "Cats are sleeping on the warm sofa",
    "dogs": "Dogs bark loudly at the postman",
    "runner": "She runs every morning; running keeps her fit",
    "empty": "",
    "fish": "Fish swim in the river",
}


@pytest.fixture
def tiny():
    bm = BM25()
    bm.add(list(CORPUS), list(CORPUS.values()))
    return bm


def test_query_term_ranks_its_document_first(tiny):
    res = tiny.search(["postman", "river fish", "sofa"], k=3)
    assert [row[0] for row in res.ids] == ["dogs", "fish", "cats"]
    assert res.scores.shape == (3, 3) and res.scores.dtype == np.float32
    # only documents sharing a term are returned; the rest is padding
    assert res.ids[0][1:] == ["", ""] and np.isneginf(res.scores[0, 1:]).all()


def test_stemming_and_lowercase(tiny):
    assert tiny.search(["RAN running Runner"], k=1).ids[0][0] == "runner"  # running/runs -> run
    assert tiny.search(["barking"], k=1).ids == [["dogs"]]
    assert tiny.search(["sleep"], k=1).ids == [["cats"]]


def test_stopwords_and_unknown_words_match_nothing(tiny):
    res = tiny.search(["the and of", "zebra quantum", ""], k=2)
    assert res.ids == [["", ""]] * 3
    assert np.isneginf(res.scores).all()


def test_scores_equal_the_lucene_formula():
    """Words chosen to pass through the tokenizer unchanged, so the reference needs no tokenizer."""
    words = ["kiwi", "banana", "melon", "grape", "lemon", "mango", "peach", "plum"]
    stem = Stemmer.Stemmer("english")
    assert all(stem.stemWord(w) == w for w in words)
    rng = np.random.default_rng(0)
    docs = [list(rng.choice(words, size=rng.integers(1, 12))) for _ in range(40)]
    ids = [f"d{i:02d}" for i in range(40)]
    k1, b = 1.2, 0.75
    bm = BM25(k1=k1, b=b)
    bm.add(ids, [" ".join(d) for d in docs])
    n, avgdl = len(docs), np.mean([len(d) for d in docs])
    query = ["kiwi", "mango", "mango"]  # a repeated query term counts twice, as in bm25s/Lucene

    def ref(doc):
        total = 0.0
        for t in query:
            df = sum(t in d for d in docs)
            idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
            tf = doc.count(t)
            total += idf * tf / (tf + k1 * (1 - b + b * len(doc) / avgdl))
        return total

    want = sorted(((ref(d), i) for d, i in zip(docs, ids) if ref(d) > 0), reverse=True)[:10]
    res = bm.search([" ".join(query)], k=10)
    assert res.ids[0] == [i for _, i in want]
    np.testing.assert_allclose(res.scores[0], [s for s, _ in want], rtol=1e-5)


def test_a_document_with_no_word_has_length_zero_in_avgdl():
    """bm25s's tokenizer gives a document of stopwords or punctuation the one token "", which counted 1 in avgdl;
    the Lucene formula (and the reference here) counts its words: 0."""
    k1, b = 0.9, 0.4
    docs = {"a": "kiwi kiwi banana", "b": "banana melon", "c": "the and of", "d": "...!", "e": "kiwi"}
    bm = BM25(k1=k1, b=b)
    bm.add(list(docs), list(docs.values()))
    words = {i: [w for w in t.split() if w.isalpha() and w not in ("the", "and", "of")] for i, t in docs.items()}
    n, avgdl = len(words), np.mean([len(w) for w in words.values()])

    def ref(doc, term="kiwi"):
        df = sum(term in w for w in words.values())
        tf = doc.count(term)
        return math.log(1 + (n - df + 0.5) / (df + 0.5)) * tf / (tf + k1 * (1 - b + b * len(doc) / avgdl))

    np.testing.assert_allclose(bm.score("kiwi", list(docs)), [ref(w) for w in words.values()], rtol=1e-5)


@pytest.mark.parametrize("form", ["NFC", "NFD"])
def test_a_word_matches_in_either_unicode_form(form, tmp_path):
    """"Montréal" typed decomposed (e + U+0301) was split at the accent ("montre", "al"), so a query in one form
    missed a document in the other."""
    import unicodedata

    other = "NFD" if form == "NFC" else "NFC"
    bm = BM25()
    bm.add(["doc", "noise"], [unicodedata.normalize(form, "Festival de Montréal"), "Toronto festival"])
    for q in (unicodedata.normalize(form, "Montréal"), unicodedata.normalize(other, "Montréal")):
        assert bm.search([q], k=2).ids == [["doc", ""]], ascii(q)
    bm.save(tmp_path / "bm25.npz")
    back = BM25.load(tmp_path / "bm25.npz")
    assert back.normalization == "NFC"
    assert back.search([unicodedata.normalize(other, "Montréal")], k=2).ids == [["doc", ""]]


def test_a_file_from_before_normalization_searches_as_it_was_built(tmp_path):
    """Its stored tokens are of the text as given: its queries are tokenized the same way, not normalized."""
    import unicodedata

    nfd = unicodedata.normalize("NFD", "Montréal")
    old = BM25(normalization=None)
    old.add(["doc"], [nfd])
    old.save(tmp_path / "bm25.npz")
    with np.load(tmp_path / "bm25.npz") as z:
        arrays = dict(z)
    params = json.loads(arrays["params"].tobytes())
    del params["normalization"]
    arrays["params"] = np.frombuffer(json.dumps(params).encode(), dtype=np.uint8)
    np.savez(tmp_path / "old.npz", **arrays)
    back = BM25.load(tmp_path / "old.npz")
    assert back.normalization is None
    assert back.search([nfd], k=1).ids == [["doc"]]


def test_ties_break_by_document_id():
    bm = BM25()
    bm.add(["b", "c", "a"], ["same words here", "other text", "same words here"])
    assert bm.search(["words"], k=3).ids == [["b", "a", ""]]  # trec_eval: equal scores, id descending


def test_incremental_changes_equal_a_fresh_index(tiny):
    tiny.delete(["cats", "fish"])
    tiny.add(["new"], ["A cat chased the fish into the river"])
    fresh = BM25()
    kept = {k: v for k, v in CORPUS.items() if k not in ("cats", "fish")}
    fresh.add([*kept, "new"], [*kept.values(), "A cat chased the fish into the river"])
    queries = ["cat river", "running dogs", "sofa"]
    a, b = tiny.search(queries, 4), fresh.search(queries, 4)
    assert a.ids == b.ids
    np.testing.assert_allclose(a.scores, b.scores, rtol=1e-6)
    assert len(tiny) == 4 and "cats" not in tiny and "new" in tiny


def test_score_of_named_documents_equals_the_search_scores(tiny):
    tiny.delete(["fish"])  # positions move on the rebuild; scores must follow the ids
    tiny.add(["fish2"], ["Fish and cats swim in the river"])
    res = tiny.search(["cat river"], k=5)
    hits = [(d, s) for d, s in zip(res.ids[0], res.scores[0]) if d]
    got = tiny.score("cat river", [d for d, _ in reversed(hits)] + ["dogs"])  # any order, and a doc with no match
    np.testing.assert_allclose(got, [s for _, s in reversed(hits)] + [0.0], rtol=1e-6)
    assert got.dtype == np.float32 and len(hits) == 2
    np.testing.assert_array_equal(tiny.score("the and", ["cats", "dogs"]), [0.0, 0.0])  # stopwords only
    with pytest.raises(KeyError, match="fish"):
        tiny.score("cat", ["cats", "fish"])  # deleted


def test_add_and_delete_errors(tiny):
    with pytest.raises(ValueError, match=r"already indexed or repeated.*dogs"):
        tiny.add(["dogs"], ["again"])
    with pytest.raises(ValueError, match="2 ids but 1 texts"):
        tiny.add(["x", "y"], ["one"])
    with pytest.raises(ValueError, match="list of query strings"):
        tiny.search("a string", 3)
    assert tiny.delete(["nope", "dogs"]) == ["nope"]


def test_save_load_round_trip(tmp_path, tiny):
    tiny.delete(["fish"])
    path = tmp_path / "bm25.npz"
    tiny.save(path)
    back = BM25.load(path)
    assert (back.k1, back.b, back.method) == (0.9, 0.4, "lucene")
    queries = ["postman", "cat sofa", "running"]
    a, b = tiny.search(queries, 3), back.search(queries, 3)
    assert a.ids == b.ids
    np.testing.assert_array_equal(a.scores, b.scores)
    back.add(["fish2"], ["Fishes swimming"])  # vocabulary continues after load
    assert back.search(["fish"], 1).ids == [["fish2"]]
    assert [p.name for p in tmp_path.iterdir()] == ["bm25.npz"]


def test_load_errors(tmp_path):
    (tmp_path / "x.npz").write_bytes(b"garbage")
    with pytest.raises(IndexFormatError, match="x.npz"):
        BM25.load(tmp_path / "x.npz")
    with pytest.raises(FileNotFoundError):
        BM25.load(tmp_path / "none.npz")


def test_document_text_joins_title_and_text():
    assert document_text({"title": "Title", "text": "body"}) == "Title body"
    assert document_text({"text": "body"}) == "body"
    bm = BM25.from_documents([{"_id": "1", "title": "Zebra", "text": "stripes"}])
    assert bm.search(["zebra"], 1).ids == [["1"]]  # the title is indexed


SCIFACT = Path(__file__).resolve().parents[3] / "shared" / "data" / "beir-scifact"


@pytest.mark.skipif(not (SCIFACT / "corpus.jsonl").exists(), reason="BEIR SciFact not available")
def test_scifact_ndcg_at_10():
    pytrec_eval = pytest.importorskip("pytrec_eval")
    start = time.perf_counter()
    docs = [json.loads(line) for line in open(SCIFACT / "corpus.jsonl", encoding="utf-8")]
    queries = {
        q["_id"]: q["text"] for q in map(json.loads, open(SCIFACT / "queries.jsonl", encoding="utf-8"))
    }
    qrels: dict[str, dict[str, int]] = {}
    for line in list(open(SCIFACT / "qrels" / "test.tsv", encoding="utf-8"))[1:]:
        qid, did, rel = line.split("\t")
        qrels.setdefault(qid, {})[did] = int(rel)
    bm = BM25.from_documents(docs)
    qids = sorted(qrels)
    res = bm.search([queries[q] for q in qids], k=100)
    run = {q: {d: float(s) for d, s in zip(ids, sc) if d} for q, ids, sc in zip(qids, res.ids, res.scores)}
    per_query = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10"}).evaluate(run)
    ndcg = np.mean([v["ndcg_cut_10"] for v in per_query.values()])
    assert len(per_query) == 300
    assert ndcg >= 0.655, ndcg
    assert time.perf_counter() - start < 20
