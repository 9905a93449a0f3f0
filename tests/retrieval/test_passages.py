"""Long documents split into passages: spans, storage, search aggregation, delete/replace, resume, refusals."""

from __future__ import annotations

import os
import random
import re

import numpy as np
import pytest

from tests.retrieval.pipeline_fixtures import WORDS, tiny_model_dir, toy_docs, write_corpus
from twotower.indexing import IndexStore
from twotower.retrieval import DualEncoder, SearchPipeline
from twotower.retrieval.build import PLAN_NAME, shard_path
from twotower.retrieval.candidates import Candidate
from twotower.retrieval.passages import (
    PassageSettings,
    PassageSplitter,
    aggregate,
    assemble_parent,
    check_settings,
    document_candidates,
    parent_of,
    passage_spans,
)


@pytest.fixture(scope="module")
def encoder():
    return DualEncoder.from_pretrained(tiny_model_dir(), bf16=False)  # max length 40: window at most 38


def long_text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + "."


def corpus_docs() -> list[dict]:
    docs = [{**d, "text": " ".join(d["text"].split()[:3])} for d in toy_docs(12)]  # short: one row each
    docs.append({"_id": "long1", "title": "a long one", "text": long_text(100, 1) + " zorbania " + long_text(100, 3)})
    docs.append({"_id": "long2", "text": long_text(150, 2), "metadata": {"lang": "en"}})
    return docs


# ---------------------------------------------------------------------- spans
@pytest.mark.parametrize("window,stride", [(8, 8), (8, 5), (16, 4), (10, 1), (38, 30)])
def test_spans_cover_the_text_and_overlap_as_configured(encoder, window, stride):
    text = "  " + long_text(120, seed=window) + "  trailing "
    tok = encoder.document_tower.tokenizer
    (offsets, words), = tok.token_spans([text])
    spans = passage_spans(offsets, words, text, window, stride)
    assert len(spans) > 1
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    token_sets = []
    for (s0, e0), (s1, _e1) in zip(spans, spans[1:]):
        assert s1 <= e0, "a gap between two passages"
        assert s0 < s1, "no progress"
    for s, e in spans:
        inside = [j for j, (a, b) in enumerate(offsets) if a >= s and b <= e]
        assert len(inside) <= window  # words are whole here (no word is longer than a window)
        token_sets.append(set(inside))
        assert offsets[inside[0]][0] == s or s == 0 or text[s:offsets[inside[0]][0]].strip() == ""
    pieces = max(words.count(w) for w in set(words))  # the most word pieces of one word
    for a, b in zip(token_sets, token_sets[1:]):  # consecutive windows share about window - stride tokens
        shared = len(a & b)
        assert shared <= window - stride
        # each of the two boundaries moves to a word start: by less than a word's pieces
        assert shared >= window - stride - 2 * (pieces - 1)
    assert set().union(*token_sets) == set(range(len(offsets)))  # every token is in some passage


def test_a_span_never_ends_between_a_letter_and_its_accent(encoder):
    """An uncased tokenizer drops decomposed accents ("e" + U+0301), so a token ended before its accent, and the
    passage boundary split "café" into "cafe" and an accent that began the next passage."""
    import unicodedata

    text = unicodedata.normalize("NFD", " ".join(["café crème brûlée"] * 40))
    (offsets, words), = encoder.document_tower.tokenizer.token_spans([text])
    spans = passage_spans(offsets, words, text, 8, 6)
    assert len(spans) > 3
    for start, end in spans:
        assert end == len(text) or not unicodedata.combining(text[end]), text[end - 4:end + 1]
        assert not unicodedata.combining(text[start])
    assert all(s1 <= e0 for (_, e0), (s1, _) in zip(spans, spans[1:]))


def test_short_text_is_one_span():
    assert passage_spans([(0, 3), (4, 7)], [0, 1], "abc defg", 4, 2) == [(0, 8)]


def test_rows_map_back_to_the_text_and_reassemble_it(encoder):
    splitter = PassageSplitter(encoder, PassageSettings(16, 12))
    doc = {"id": "x", "title": "a title", "text": long_text(100), "metadata": {"k": 1}}
    rows = splitter.rows([doc])
    assert len(rows) > 2 and all(parent_of(r["id"]) == "x" for r in rows)
    for n, r in enumerate(rows):
        assert r["id"] == f"x\x1f{n}" and r["parent"] == "x"
        assert r["text"] == doc["text"][r["start"]:r["end"]]
        assert r["title"] == "a title" and r["metadata"] == {"k": 1}
    whole = assemble_parent(list(reversed(rows)))
    assert whole["text"] == doc["text"] and whole["id"] == "x"
    assert whole["passages"] == [[r["start"], r["end"]] for r in rows]


def test_title_is_encoded_with_every_passage_and_never_truncated(encoder):
    splitter = PassageSplitter(encoder, PassageSettings(38, 30))  # the largest window the tiny model reads
    doc = {"id": "t", "title": "tea coffee cold hot drink water", "text": long_text(150)}
    from twotower.indexing import document_text

    lengths = encoder.document_tower.tokenizer.lengths([document_text(r) for r in splitter.rows([doc])],
                                                       max_length=1 << 30)
    assert lengths.max() <= encoder.document_max_length


def test_window_larger_than_the_model_is_refused_naming_the_flag(encoder, tmp_path):
    with pytest.raises(ValueError, match="--passage-window"):
        check_settings(encoder, 39, 10)  # 40 positions - [CLS] - [SEP] = 38
    with pytest.raises(ValueError, match="--passage-stride"):
        check_settings(encoder, 20, 21)
    with pytest.raises(ValueError, match=r"--passage-window \(passage_window\) must be a positive number of tokens, "
                                         "got True"):
        check_settings(encoder, True, 1)  # a bool is an int to Python: it built windows of 1 token
    with pytest.raises(ValueError, match="--passage-stride"):
        check_settings(encoder, 20, True)
    # numpy's integers are counts, as for k and the depths (they were refused); the settings are plain ints
    settings = check_settings(encoder, np.int64(20), np.int32(10))
    assert (settings.window, settings.stride) == (20, 10) and type(settings.window) is type(settings.stride) is int
    corpus = write_corpus(str(tmp_path / "c.jsonl"), corpus_docs())
    with pytest.raises(ValueError, match="--passage-window"):
        SearchPipeline.build(corpus, tmp_path / "idx", encoder, passages=True, passage_window=500, progress=False)
    assert not (tmp_path / "idx").exists() and not (tmp_path / "idx.build").exists()


# ---------------------------------------------------------------------- aggregation
def test_maxp_returns_each_document_once_with_its_best_passage():
    rows = [Candidate("a\x1f2", 0.9, 1), Candidate("b", 0.8, 2), Candidate("a\x1f0", 0.7, 3),
            Candidate("c\x1f1", 0.6, 4), Candidate("c\x1f0", 0.65, 5), Candidate("b\x1f9", 0.1, 6)]
    out = aggregate(rows, "max")
    assert [c.id for c in out] == ["a", "b", "c"]
    assert [c.passage for c in out] == ["a\x1f2", None, "c\x1f0"]
    assert [c.score for c in out] == [0.9, 0.8, 0.65] and [c.rank for c in out] == [1, 2, 3]
    summed = aggregate(rows, "sum")
    assert [c.id for c in summed] == ["a", "c", "b"] and summed[0].score == pytest.approx(1.6)
    first = aggregate(rows, "first")
    assert [(c.id, c.passage) for c in first] == [("b", None), ("a", "a\x1f0"), ("c", "c\x1f0")]
    assert len(aggregate(rows, "max", limit=2)) == 2


def test_document_candidates_fetch_more_rows_until_recall_k_documents():
    ranked = [Candidate(f"d{i // 10}\x1f{i % 10}", 1.0 - i / 1000, i + 1) for i in range(300)]  # 30 docs
    asked = []

    def first_stage(n):
        asked.append(n)
        return [ranked[:n]]

    out = document_candidates(first_stage, 12, len(ranked))
    assert [c.id for c in out[0]] == [f"d{i}" for i in range(12)]
    assert asked[0] == 24 and asked[-1] >= 120
    assert len(document_candidates(first_stage, 50, len(ranked))[0]) == 30  # fewer exist: all of them
    # a first stage that has no more rows to give (BM25: only rows sharing a word with the query) is not asked
    # again and again up to every row of the index
    asked.clear()
    out = document_candidates(lambda n: asked.append(n) or [ranked[:min(n, 35)]], 12, 100_000)
    assert [c.id for c in out[0]] == ["d0", "d1", "d2", "d3"] and asked == [24, 48]


# ---------------------------------------------------------------------- an index with passages
@pytest.fixture()
def built(tmp_path, encoder):
    corpus = write_corpus(str(tmp_path / "c.jsonl"), corpus_docs())
    pipe = SearchPipeline.build(corpus, tmp_path / "idx", encoder, passages=True, passage_window=16,
                                passage_stride=12, bm25=True, progress=False)
    pipe.close()
    return tmp_path / "idx"


def test_the_index_layer_does_not_check_the_pipelines_rows_again(tmp_path, encoder, monkeypatch):
    """A build checked every document in its reader, then again in IndexStore.add and in DocStore.add (1.28 s
    against 0.245 s a 50k-document pass); the index layer does not check the rows the pipeline read (and its
    passage rows) again."""
    import twotower.indexing.docstore as docstore

    real, calls = docstore.check_for_index, []

    def counted(*a, **k):
        calls.append(a[0].doc_id)
        return real(*a, **k)

    monkeypatch.setattr(docstore, "check_for_index", counted)  # the index layer's check (`as_document`)
    corpus = write_corpus(str(tmp_path / "c.jsonl"), corpus_docs())
    with SearchPipeline.build(corpus, tmp_path / "idx", encoder, passages=True, passage_window=16,
                              passage_stride=12, progress=False) as pipe:
        assert pipe.info()["passages"] > 0
    with SearchPipeline.load(tmp_path / "idx", encoder, readonly=False) as pipe:
        pipe.add([{"_id": "n1", "text": long_text(80, 5), "parent": "thread-7"}, {"_id": "n2", "text": "tea"}])
        assert pipe.get(["n1"])[0]["metadata"] == {"parent": "thread-7"}  # a user's parent: metadata
    assert calls == []


def test_add_does_not_parse_again_what_the_service_parsed(tmp_path, encoder, monkeypatch):
    """`POST /documents` parses each document (`parse_document`, to name the field at fault), and
    SearchPipeline.add parsed it all again; its output is taken as it is, but for the blank check."""
    import twotower.retrieval.corpus as corpus_module
    from twotower.common.errors import DataError
    from twotower.retrieval.corpus import parse_document

    corpus = write_corpus(str(tmp_path / "c.jsonl"), corpus_docs())
    SearchPipeline.build(corpus, tmp_path / "idx", encoder, progress=False).close()
    parsed = [parse_document({"_id": "n1", "text": "green tea"}, "documents[0]")]
    blank = [parse_document({"_id": "n2", "text": " "}, "documents[0]", keep_empty=True)]
    real, calls = corpus_module.check_for_index, []
    monkeypatch.setattr(corpus_module, "check_for_index", lambda *a, **k: calls.append(a[0].doc_id) or real(*a, **k))
    with SearchPipeline.load(tmp_path / "idx", encoder, readonly=False) as pipe:
        assert pipe.add(parsed) == 1 and calls == []
        with pytest.raises(DataError, match=r"^docs\[0\]: document 'n2' has empty 'text' and 'title'"):
            pipe.add(blank)  # on_empty="error": still refused
        assert pipe.get(["n1", "n2"])[1] is None


def test_build_stores_passages_and_gives_documents_back_whole(built, encoder):
    docs = {d["_id"]: d for d in corpus_docs()}
    with SearchPipeline.load(built, encoder) as pipe:
        info = pipe.info()
        assert info["documents"] == len(pipe) == len(docs)
        assert info["passages"] > 10 and info["vectors"] == info["documents"] - 2 + info["passages"]
        assert pipe.block["passages"] == {"window": 16, "stride": 12}
        got = pipe.get(["long1", "d0", "nope"])
        assert got[0]["text"] == docs["long1"]["text"] and got[0]["title"] == "a long one"
        assert "passages" not in got[1] and got[1]["text"] == docs["d0"]["text"] and got[2] is None


def test_bm25_recall_over_passages_gives_documents_with_their_best_passage(built, encoder):
    with SearchPipeline.load(built, encoder) as pipe:
        for how in ("max", "sum"):  # the only "zorbania" is in the middle of long1
            (hit,) = pipe.search("zorbania", k=3, bm25=True, aggregate=how)
            assert hit.id == "long1" and "zorbania" in hit.text[hit.passage["start"]:hit.passage["end"]]
        assert pipe.search("zorbania", k=3, bm25=True, aggregate="first") == []  # not in long1's first passage
        assert pipe.search("qqqxv zzzyx", k=3, bm25=True) == []  # no word in the index: no hits


@pytest.mark.parametrize("hybrid", [False, True])
def test_search_returns_documents_once_with_passage_offsets(built, encoder, hybrid):
    with SearchPipeline.load(built, encoder) as pipe:
        query = "zorbania tea"  # the only "zorbania" is in the middle of long1
        # (hybrid: BM25 weighted up, so that the random tiny dense model cannot outvote it)
        hits = pipe.search(query, k=14, recall_k=14, hybrid=hybrid, weights=[0.1, 1.0] if hybrid else None)
        ids = [h.id for h in hits]
        assert len(ids) == len(set(ids)) == 14 and "\x1f" not in "".join(ids)
        for h in hits:
            if h.id.startswith("long"):
                assert h.passage is not None
                assert 0 <= h.passage["start"] < h.passage["end"] <= len(h.text)
            else:
                assert h.passage is None
        if hybrid:  # BM25 finds the word in long1's middle passage, which is the hit's best passage
            hit = next(h for h in hits if h.id == "long1")
            assert hit.bm25_score is not None and "zorbania" in hit.text[hit.passage["start"]:hit.passage["end"]]
        assert [h.id for h in pipe.search_vectors(pipe.encoder.encode_queries([query]), k=14)[0]] == \
            [h.id for h in pipe.search(query, k=14, recall_k=14, rerank=False)]


def test_delete_and_replace_of_a_long_document_touch_all_its_passages(built, encoder):
    with SearchPipeline.load(built, encoder, readonly=False) as pipe:
        before = pipe.info()
        n_long1 = len(pipe.get(["long1"])[0]["passages"])
        assert pipe.delete(["long1", "missing"]) == ["missing"]
        assert pipe.get(["long1"]) == [None]
        assert not any(parent_of(i) == "long1" for i in pipe.store.vectors.ids())
        assert pipe.info()["passages"] == before["passages"] - n_long1

        # long2 replaced by a shorter long text: its stale passages go; then by a short one: one row
        new_text = long_text(60, 9)
        assert pipe.add([{"_id": "long2", "text": new_text}], on_duplicate="replace") == 1
        assert pipe.get(["long2"])[0]["text"] == new_text
        rows = [i for i in pipe.store.vectors.ids() if parent_of(i) == "long2"]
        assert len(rows) == len(pipe.get(["long2"])[0]["passages"]) < 20
        assert pipe.add([{"_id": "long2", "text": "tea is hot"}], on_duplicate="replace") == 1
        assert [i for i in pipe.store.vectors.ids() if parent_of(i) == "long2"] == ["long2"]
        assert pipe.get(["long2"])[0]["text"] == "tea is hot"
        assert pipe.info()["passages"] == 0
        with pytest.raises(ValueError, match="already"):
            pipe.add([{"_id": "d1", "text": long_text(100)}])  # a document id, even when stored split
        pipe.add([{"_id": "long3", "text": long_text(100, 5)}])  # add splits as the build did
        assert len(pipe.get(["long3"])[0]["passages"]) > 1
    with IndexStore.open(built) as store:  # what was committed is consistent (ids, digests)
        assert len(store) == store.docstore.count()


def test_a_passage_row_id_is_no_document_id(built, encoder):
    """`delete(["long1\x1f1"])` removed that one passage row and answered [] (nothing missing); `get(["long1"])`
    and every search finding long1 then failed. `contains` and `get` took the row for a document too."""
    row = "long1\x1f1"
    with SearchPipeline.load(built, encoder, readonly=False) as pipe:
        whole = pipe.get(["long1"])[0]
        assert pipe.contains([row, "long1"]) == [False, True]
        assert pipe.get([row, "long1"]) == [None, whole]
        assert pipe.delete([row]) == [row]  # not in the index: nothing deleted
        assert row in pipe.store.vectors.ids() and pipe.get(["long1"]) == [whole]
        assert len(pipe.search("zorbania", k=14, recall_k=14)) == 14
    with SearchPipeline.load(built, encoder) as pipe:  # what was committed: long1 whole
        assert pipe.get(["long1"]) == [whole]


def test_passage_rows_that_do_not_rebuild_their_document_are_named():
    rows = [{"id": f"x\x1f{n}", "parent": "x", "title": "", "metadata": {}, "start": s, "end": e,
             "text": "abcdefghijkl"[s:e]} for n, (s, e) in enumerate([(0, 6), (3, 9), (6, 12)])]
    assert assemble_parent(rows)["text"] == "abcdefghijkl"
    # a middle passage gone without a gap (the two beside it meet), all but the first, the first
    for kept, why in [([0, 2], r"passage 1 is missing \(the stored ones are numbered 0, 2\)"),
                      ([0], "only passage 0 is stored"), ([1, 2], "passage 0 is missing")]:
        with pytest.raises(ValueError, match=f"document 'x': {why}.*add it again"):
            assemble_parent([rows[n] for n in kept])
    with pytest.raises(ValueError, match=re.escape("passage 'x\\x1f1' starts at 7, after the previous passages "
                                                   "end (6)")):
        assemble_parent([rows[0], {**rows[1], "start": 7, "text": "hi"}])  # a gap between two passages


def test_resume_of_an_interrupted_passage_build_continues_exactly(tmp_path, encoder, monkeypatch):
    docs = corpus_docs() * 1
    docs += [{"_id": f"l{i}", "text": long_text(40 + 7 * i, i)} for i in range(20)]
    corpus = write_corpus(str(tmp_path / "c.jsonl"), docs)
    real = encoder.encode_documents
    calls = {"n": 0, "texts": 0}

    def crash_third(texts, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("simulated crash")
        calls["texts"] += len(texts)
        return real(texts, **kw)

    kw = dict(passages=True, passage_window=16, passage_stride=12, shard_size=8, progress=False)
    monkeypatch.setattr(encoder, "encode_documents", crash_third)
    with pytest.raises(KeyboardInterrupt):
        SearchPipeline.build(corpus, tmp_path / "idx", encoder, **kw)
    work = str(tmp_path / "idx.build")
    assert os.path.isfile(os.path.join(work, PLAN_NAME)) and os.path.isfile(shard_path(work, 1))
    done_rows = calls["texts"]
    calls.update(n=-100, texts=0)
    SearchPipeline.build(corpus, tmp_path / "idx", encoder, **kw).close()
    monkeypatch.undo()
    SearchPipeline.build(corpus, tmp_path / "fresh", encoder, **kw).close()
    with IndexStore.open(tmp_path / "idx", readonly=True) as a, IndexStore.open(tmp_path / "fresh",
                                                                                 readonly=True) as b:
        assert a.vectors.ids() == b.vectors.ids()
        assert calls["texts"] == len(b.vectors.ids()) - done_rows  # only the unfinished shards' passages
        np.testing.assert_allclose(a.vectors.reconstruct(a.vectors.ids()), b.vectors.reconstruct(b.vectors.ids()),
                                   atol=1e-6)


def test_build_without_passages_says_how_many_documents_are_truncated(tmp_path, encoder, caplog):
    corpus = write_corpus(str(tmp_path / "c.jsonl"), corpus_docs())
    with caplog.at_level("WARNING"):
        SearchPipeline.build(corpus, tmp_path / "idx", encoder, progress=False).close()
    assert sum("longer than the model" in r.getMessage() for r in caplog.records) == 1
    assert "2 of 14 documents" in caplog.text and "--passages" in caplog.text


def test_passages_a_long_title_leaves_cut_are_counted_in_a_warning_on_build_and_add(tmp_path, encoder, caplog):
    """A title leaving fewer than MIN_WINDOW tokens: the window stops shrinking at MIN_WINDOW, the encoder cuts
    title + passage at its maximum, and the passages' vectors hold little but the title. It was silent."""
    from twotower.indexing import document_text

    splitter = PassageSplitter(encoder, PassageSettings(38, 30))

    def cut(doc: dict) -> int:  # the reference: passages of `doc` whose title + text the encoder truncates
        rows = splitter.rows([doc])
        lengths = encoder.document_tower.tokenizer.lengths([document_text(r) for r in rows], max_length=1 << 30)
        return int((lengths > encoder.document_max_length).sum())

    long_title = " ".join(["tea"] * 30)  # 30 tokens of the 38 the tiny model reads: 8 left, below MIN_WINDOW
    doc, doc2 = ({"id": i, "title": long_title, "text": long_text(60, seed)} for i, seed in (("lt", 5), ("lt2", 6)))
    assert cut(doc) >= 10 and cut(doc2) >= 10  # nearly every passage: the last may be short enough
    corpus = write_corpus(str(tmp_path / "c.jsonl"), [*corpus_docs(), {"_id": "lt", "title": long_title,
                                                                        "text": doc["text"]}])
    with caplog.at_level("WARNING"):
        pipe = SearchPipeline.build(corpus, tmp_path / "idx", encoder, passages=True, passage_window=38,
                                    passage_stride=30, progress=False)
    said = [r.getMessage() for r in caplog.records if "with their document's title in front" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"{cut(doc)} passages are longer than the model's maximum"), said
    caplog.clear()
    with caplog.at_level("WARNING"):
        pipe.add([doc2, {"id": "ok", "title": "tea", "text": long_text(60)}])
    said = [r.getMessage() for r in caplog.records if "with their document's title in front" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"{cut(doc2)} passages are longer"), said
    pipe.close()


# ---------------------------------------------------------------------- the worked example: a needle
RAILWAY = [
    "The railway reached the northern valley in the spring after years of surveying.",
    "Engineers laid the track across three rivers and cut two tunnels through the granite ridge.",
    "Freight trains carried timber, coal and grain to the port every week.",
    "The company bought new locomotives when the line was extended to the coast.",
    "Passenger traffic grew quickly once the timetable was published in the newspapers.",
    "Signal boxes were built at every junction and staffed day and night.",
    "The viaduct over the gorge was the longest structure of its kind in the province.",
    "Maintenance crews replaced the wooden sleepers with concrete ones over a decade.",
]
NEEDLE = "The lighthouse keeper's cat was called Biscuit and slept on the lamp room stairs."


def test_a_needle_deep_in_a_long_document_is_found_with_passages_and_not_without(tmp_path, minilm_path):
    long_doc = {"_id": "railway", "title": "Life on the northern coast",
                "text": " ".join(RAILWAY * 6) + " " + NEEDLE}  # ~900 tokens; the needle is the last sentence
    others = [
        {"_id": "dogs", "text": "Sailors kept dogs for company on long voyages."},
        {"_id": "sleep", "text": "Cats sleep for up to sixteen hours a day."},
        {"_id": "lamp", "text": "Ships were guided at night by the lamp of a lighthouse."},
        {"_id": "bread", "text": "Biscuits were baked on the ship for the long voyage."},
    ]
    corpus = write_corpus(str(tmp_path / "c.jsonl"), [long_doc, *others])
    query = "What was the name of the lighthouse keeper's cat?"
    enc = DualEncoder.from_pretrained(minilm_path, bf16=False)
    ranks = {}
    for name, kw in (("truncated", {}), ("passages", {"passages": True, "passage_window": 32})):
        with SearchPipeline.build(corpus, tmp_path / name, enc, progress=False, **kw) as pipe:
            hits = pipe.search(query, k=5)
            ranks[name] = [h.id for h in hits].index("railway") + 1
            if name == "passages":
                hit = next(h for h in hits if h.id == "railway")
                assert NEEDLE in hit.text[hit.passage["start"]:hit.passage["end"]]
    assert ranks == {"truncated": 5, "passages": 1}
