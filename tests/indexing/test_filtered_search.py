"""Filtered search: the document store resolves a filter to ids, the vectors return k of them.

References: ``Filter.matches`` for which documents pass, numpy brute force over the passing
vectors for which of them are the top k (``tests.indexing.helpers.brute_force``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import twotower.indexing.vector_index as vector_index
from tests.indexing.helpers import brute_force, clustered
from twotower.indexing import BM25, DocStore, IndexStore, VectorIndex
from twotower.indexing.docstore import FIELD_COUNTS_AT_KEY, FIELD_COUNTS_KEY, FIELDS_KEY
from twotower.indexing.filters import FilterError, parse_filter


def meta(n: int) -> dict:
    return {"lang": ["en", "fr", "de", "es"][n % 4], "year": 2000 + n % 25, "src": {"name": f"s{n % 7}"},
            "rare": n == 1234}


def docs(ids: list[str]) -> list[dict]:
    return [{"id": i, "text": f"text {i}", "metadata": meta(int(i[1:]))} for i in ids]


@pytest.fixture()
def force_selector(monkeypatch):
    """Send every filtered search through the FAISS id selector (never the small-set exact scan)."""
    monkeypatch.setattr(vector_index, "EXACT_SCAN_MAX", 0)
    monkeypatch.setattr(vector_index, "EXACT_SCAN_FRACTION", 0.0)
    monkeypatch.setattr(vector_index, "FLAT_EXACT_FRACTION", 0.0)


# ---------------------------------------------------------------------------- the document store
def test_docstore_records_fields_in_the_add_transaction(tmp_path):
    path = tmp_path / "d.sqlite"
    with DocStore(path) as ds:
        assert ds.metadata_fields() == set()
        ds.add([{"id": "a", "text": "x", "metadata": {"lang": "en", "src": {"name": "p", "rank": 2}}},
                {"id": "b", "text": "y"}])
        ds.begin()
        ds.add([{"id": "c", "text": "z", "metadata": {"tenant": 7}}])
        assert "tenant" in ds.metadata_fields()
        ds.rollback()  # the rolled-back document's field is gone with it
        assert ds.metadata_fields() == {"lang", "src.name", "src.rank"}
        ds.add([{"id": "a", "text": "x", "metadata": {"year": 1}}], on_duplicate="replace")
    with DocStore(path, readonly=True) as ds:
        assert ds.metadata_fields() == {"year"}  # the replaced metadata's fields went with it


def test_a_field_whose_documents_are_all_deleted_or_replaced_is_no_longer_known(tmp_path):
    """Fields were only ever added: after deleting every document with `zz`, `zz == 1` was accepted (and found
    nothing) while a rebuild of the same documents refused it. The counts follow deletes and replaces."""
    path = tmp_path / "d.sqlite"
    with DocStore(path) as ds:
        ds.add([{"id": "a", "text": "x", "metadata": {"zz": 1, "src": {"n": 1}}},
                {"id": "b", "text": "y", "metadata": {"zz": 2, "lang": "en"}},
                {"id": "c", "text": "z", "metadata": {"lang": "fr"}}])
        ds.delete(["a"])
        assert ds.metadata_fields() == {"zz", "lang"}
        ds.add([{"id": "b", "text": "y", "metadata": {"lang": "en"}}], on_duplicate="replace")
        assert ds.metadata_fields() == {"lang"}
        ds.begin()
        ds.delete(["b", "c"])
        assert ds.metadata_fields() == set()
        ds.rollback()
    with DocStore(path, readonly=True) as ds:
        assert ds.metadata_fields() == {"lang"}
        with pytest.raises(FilterError, match="unknown field 'zz'.*known fields: lang"):
            ds.matching_ids(parse_filter("zz == 1"))


def test_a_store_without_field_counts_keeps_its_list_until_a_write_counts_them(tmp_path):
    """An index written before the counts opens as before (its list of fields ever added, no scan on open);
    its next write scans once and counts from then on."""
    path = tmp_path / "d.sqlite"
    with DocStore(path) as ds:
        ds.add(docs(["d1", "d2"]) + [{"id": "z", "text": "t", "metadata": {"zz": 1}}])
        ds.delete(["z"])
        ds._conn.execute("DELETE FROM meta WHERE key = ?", (FIELD_COUNTS_KEY,))  # as an older version left it
        ds.set_meta(FIELDS_KEY, json.dumps(["lang", "rare", "src.name", "year", "zz"]))
    with DocStore(path, readonly=True) as ds:
        assert ds.metadata_fields() == {"lang", "year", "src.name", "rare", "zz"}
    with DocStore(path) as ds:
        ds.delete(["d1"])
        assert ds.metadata_fields() == {"lang", "year", "src.name", "rare"}
        assert json.loads(ds.get_meta(FIELD_COUNTS_KEY)) == {"lang": 1, "rare": 1, "src.name": 1, "year": 1}


def test_counts_an_older_writer_left_stale_are_made_again_not_drifted(tmp_path):
    """An older twotower adds a document of a field already listed without counting it; a later delete by this
    version took the count to 0 and the field away, though the older writer's document still had it
    ("unknown field 'a'"). Counts are made at a documents digest, which every version changes at every write."""
    path = tmp_path / "d.sqlite"
    with DocStore(path) as ds:
        ds.add([{"id": "x", "text": "t", "metadata": {"a": 1}}])
        counts, at = ds.get_meta(FIELD_COUNTS_KEY), ds.get_meta(FIELD_COUNTS_AT_KEY)
        ds.add([{"id": "y", "text": "t", "metadata": {"a": 2}}])
        ds.set_meta(FIELD_COUNTS_KEY, counts)  # as an older version leaves them: only its rows and digests change
        ds.set_meta(FIELD_COUNTS_AT_KEY, at)
        assert ds.metadata_fields() == {"a"}  # stale counts are not trusted: scanned
        ds.delete(["x"])
        assert ds.metadata_fields() == {"a"} and json.loads(ds.get_meta(FIELD_COUNTS_KEY)) == {"a": 1}
        assert [d for d in ds.matching_ids(parse_filter("a == 2"))] == ["y"]


def test_docstore_without_the_fields_key_scans_once(tmp_path):
    path = tmp_path / "d.sqlite"
    with DocStore(path) as ds:
        ds.add(docs(["d1", "d2"]))
        ds._conn.execute("DELETE FROM meta WHERE key = ?", (FIELDS_KEY,))  # as written by an older version
    with DocStore(path, readonly=True) as ds:
        assert ds.metadata_fields() == {"lang", "year", "src.name", "rare"}
    with DocStore(path) as ds:
        ds.add([{"id": "x", "text": "t", "metadata": {"new": 1}}])
        assert ds.get_meta(FIELDS_KEY) is not None
        assert ds.metadata_fields() == {"lang", "year", "src.name", "rare", "new"}


def test_matching_ids_agrees_with_matches_and_refuses_unknown_fields(tmp_path):
    ids = [f"d{i}" for i in range(300)]
    with DocStore(tmp_path / "d.sqlite") as ds:
        ds.add(docs(ids))
        for text in ['lang == "en"', 'year >= 2010 and not (src.name in ["s1", "s2"])', "rare == true",
                     'lang != "en" or year < 2003']:
            flt = parse_filter(text)
            assert ds.matching_ids(flt) == [i for i in ids if flt.matches(meta(int(i[1:])))], text
        with pytest.raises(FilterError) as info:
            ds.matching_ids(parse_filter('lang == "en" and sorce.name == "s1"'))
        assert info.value.column == 18 and "unknown field 'sorce.name'" in str(info.value)
        assert "known fields: lang, rare, src.name, year" in str(info.value)


# ---------------------------------------------------------------------------- one vector index
@pytest.mark.parametrize("mode", ["exact", "selector"])
@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_flat_filtered_search_equals_brute_force(request, mode, metric):
    if mode == "selector":
        request.getfixturevalue("force_selector")
    x = clustered(3000, 16, seed=1)
    ids = [f"d{i}" for i in range(3000)]
    idx = VectorIndex(16, "Flat", metric)
    idx.add(ids, x)
    q = clustered(8, 16, seed=2)
    for keep in (ids[::2], ids[5:20], ids[:3]):  # 50 %, 15 documents, fewer than k
        pos = [int(i[1:]) for i in keep]
        truth, scores = brute_force(x[pos], keep, q, 10, metric)
        res = idx.search(q, 10, allowed=set(keep))
        want = min(10, len(keep))
        assert [row[:want] for row in res.ids] == [row[:want] for row in truth]
        assert res.scores[:, :want] == pytest.approx(scores[:, :want], rel=1e-4, abs=1e-4)
        assert all(row[want:] == [""] * (10 - want) for row in res.ids)


@pytest.mark.parametrize("path", ["exact", "selector"])
def test_hnsw_one_matching_document_in_5k_is_found(request, path):
    """No silent shortfall: the selector may find nothing in a 5k graph; the exact fallback does."""
    if path == "selector":
        request.getfixturevalue("force_selector")
    x = clustered(5000, 16, seed=3)
    ids = [f"d{i}" for i in range(5000)]
    idx = VectorIndex(16, "HNSW16", "cosine", ef_search=16)
    idx.add(ids, x)
    q = clustered(20, 16, seed=4)
    res = idx.search(q, 10, allowed={"d1234"})
    assert all(row == ["d1234"] + [""] * 9 for row in res.ids)
    few = {f"d{i}" for i in range(0, 5000, 500)}  # exactly 10 matching documents: 10 hits each
    res = idx.search(q, 10, allowed=few)
    assert all(sorted(row) == sorted(few) for row in res.ids)


def test_hnsw_selector_shortfall_falls_back_to_the_exact_scan(force_selector, monkeypatch):
    x = clustered(5000, 16, seed=3)
    ids = [f"d{i}" for i in range(5000)]
    idx = VectorIndex(16, "HNSW16", "cosine", ef_search=10)
    idx.add(ids, x)
    q = clustered(30, 16, seed=5)
    allowed = [f"d{i}" for i in range(0, 5000, 250)]  # 20 scattered documents
    calls = []
    exact = idx.exact_search
    monkeypatch.setattr(idx, "exact_search", lambda qq, k, labels: calls.append(len(qq)) or exact(qq, k, labels))
    res = idx.search(q, 10, allowed=set(allowed))
    assert all(len([i for i in row if i]) == 10 and set(row) <= set(allowed) for row in res.ids)
    truth, _ = brute_force(x[[int(i[1:]) for i in allowed]], allowed, q, 10, "cosine")
    for row, t, in zip(res.ids, truth):
        assert len(set(row) & set(t)) >= 5  # approximate rows are still good; exact rows are exact
    assert calls, "expected at least one query where the HNSW selector returned fewer than k"


def test_ivf_selector_shortfall_is_filled(force_selector):
    x = clustered(4000, 16, seed=6)
    ids = [f"d{i}" for i in range(4000)]
    idx = VectorIndex(16, "IVF64,Flat", "l2", nprobe=1)
    idx.train(x)
    idx.add(ids, x)
    allowed = set(ids[::400])  # 10 documents, most in lists one probe never visits
    res = idx.search(clustered(10, 16, seed=7), 10, allowed=allowed)
    assert all(sorted(row) == sorted(allowed) for row in res.ids)


def test_allowed_ignores_unknown_and_deleted_ids():
    x = clustered(100, 8, seed=8)
    ids = [f"d{i}" for i in range(100)]
    idx = VectorIndex(8, "HNSW16", "cosine")
    idx.add(ids, x)
    idx.remove(["d3"])  # a graph tombstone
    res = idx.search(x[3:4], 3, allowed={"d3", "d4", "nope"})
    assert res.ids == [["d4", "", ""]]
    assert idx.search(x[:1], 2, allowed=set()).ids == [["", ""]]


# ---------------------------------------------------------------------------- the store: segments, BM25
@pytest.mark.parametrize("factory", ["Flat", "HNSW16"])
def test_store_filter_over_segments_and_staged_rows(tmp_path, factory):
    n = 1500
    x = clustered(n, 16, seed=9)
    ids = [f"d{i}" for i in range(n)]
    st = IndexStore.create(tmp_path / "idx", 16, factory, "cosine")
    for lo, hi in ((0, 500), (500, 1000)):
        st.add(docs(ids[lo:hi]), x[lo:hi])
        st.commit()
    st.add(docs(ids[1000:]), x[1000:])  # staged: searched by the writer too
    st.delete(["d8", "d1001"])
    q = clustered(6, 16, seed=10)
    live = [i for i in ids if i not in ("d8", "d1001")]
    for text in ['lang == "en"', 'year >= 2020 and src.name != "s3"', "rare == true", 'lang == "xx"']:
        flt = parse_filter(text)
        keep = [i for i in live if flt.matches(meta(int(i[1:])))]
        res = st.search(q, 10, filter=text)
        if not keep:
            assert all(row == [""] * 10 for row in res.ids)
            continue
        truth, _ = brute_force(x[[int(i[1:]) for i in keep]], keep, q, 10, "cosine")
        want = min(10, len(keep))
        assert all(len([i for i in row if i]) == want and set(row) - {""} <= set(keep) for row in res.ids), text
        if factory == "Flat":
            assert [row[:want] for row in res.ids] == [row[:want] for row in truth], text
    with pytest.raises(FilterError, match="unknown field 'lnag'"):
        st.search(q, 10, filter='lnag == "en"')
    st.close()


def test_reader_caches_allowed_ids_per_filter(tmp_path):
    x = clustered(200, 8, seed=11)
    ids = [f"d{i}" for i in range(200)]
    with IndexStore.create(tmp_path / "idx", 8, "Flat", "cosine") as st:
        st.add(docs(ids), x)
        st.commit()
    reader = IndexStore.open(tmp_path / "idx", readonly=True)
    with reader.snapshot() as snap:
        flt = parse_filter('lang == "fr"')
        first = snap.allowed_ids(flt)
        assert snap.allowed_ids(parse_filter('lang=="fr"')) is first  # same tree: one SQL scan
        assert first == {i for i in ids if meta(int(i[1:]))["lang"] == "fr"}
    reader.close()


def test_writer_resolves_a_filter_once_until_its_rows_change(tmp_path):
    x = clustered(60, 8, seed=12)
    ids = [f"d{i}" for i in range(60)]
    flt = parse_filter('lang == "fr"')
    french = {i for i in ids if meta(int(i[1:]))["lang"] == "fr"}
    with IndexStore.create(tmp_path / "idx", 8, "Flat", "cosine") as st:
        st.add(docs(ids[:40]), x[:40])
        st.commit()
        with st.snapshot() as snap:
            first = snap.allowed_ids(flt)
            assert snap.allowed_ids(flt) is first and first == {i for i in french if int(i[1:]) < 40}
        st.add(docs(ids[40:]), x[40:])  # staged rows: resolved again
        with st.snapshot() as snap:
            assert snap.allowed_ids(flt) == french
        st.delete(["d1"])
        with st.snapshot() as snap:
            assert snap.allowed_ids(flt) == french - {"d1"}
        st.rollback()  # back to the commit of the first 40
        with st.snapshot() as snap:
            assert snap.allowed_ids(flt) == {i for i in french if int(i[1:]) < 40}
        assert set(st.search(x[:1], 60, filter=flt).ids[0]) - {""} == {i for i in french if int(i[1:]) < 40}


def test_bm25_filter_returns_k_allowed_hits_in_masked_order():
    bm = BM25()
    texts = ["tea tea tea"] * 30 + ["tea and cake"] * 10 + ["coffee only"] * 10
    ids = [f"d{i}" for i in range(50)]
    bm.add(ids, texts)
    allowed = {f"d{i}" for i in range(25, 50)}  # the best 25 tea documents are filtered out
    res = bm.search(["tea"], 10, allowed=allowed)
    assert len([i for i in res.ids[0] if i]) == 10 and set(res.ids[0]) <= allowed
    full = bm.search(["tea"], 50)
    ranked = [i for i in full.ids[0] if i in allowed][:10]  # the unfiltered ranking restricted to allowed
    assert res.ids[0] == ranked
    few = bm.search(["cake"], 10, allowed=allowed)  # 10 allowed documents mention cake, no others score
    assert sorted(i for i in few.ids[0] if i) == sorted(f"d{i}" for i in range(30, 40))
    assert bm.search(["tea"], 5, allowed=["d45"]).ids == [["", "", "", "", ""]]  # coffee: score 0


def test_store_bm25_honours_the_filter(tmp_path):
    x = clustered(60, 8, seed=12)
    ids = [f"d{i}" for i in range(60)]
    with IndexStore.create(tmp_path / "idx", 8, "Flat", "cosine", bm25=True) as st:
        st.add(docs(ids), x)
        st.commit()
        res = st.search_bm25(["text"], 10, filter='lang == "de"')
        assert all(i and meta(int(i[1:]))["lang"] == "de" for i in res.ids[0])
        with pytest.raises(FilterError, match="known fields"):
            st.search_bm25(["text"], 10, filter="tenant == 1")


def test_exact_search_matches_numpy_in_chunks(monkeypatch):
    monkeypatch.setattr(vector_index, "EXACT_SCAN_CHUNK", 7)  # several chunks and a ragged last one
    x = clustered(100, 8, seed=13)
    ids = [f"d{i}" for i in range(100)]
    idx = VectorIndex(8, "Flat", "ip")
    idx.add(ids, x)
    q = clustered(4, 8, seed=14)
    keep = ids[3:60]
    res = idx.search(q, 5, allowed=set(keep))
    truth, scores = brute_force(x[3:60], keep, q, 5, "ip")
    assert res.ids == truth and res.scores == pytest.approx(scores, rel=1e-5, abs=1e-5)
    assert np.isneginf(idx.search(q, 5, allowed={"d1"}).scores[:, 1:]).all()
