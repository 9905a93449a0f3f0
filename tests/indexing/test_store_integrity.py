"""Opening verifies content, not just counts (issue 19, item 4); ``twotower index check`` verifies everything.

Each case damages a committed index the way a bad disk, a careless tool or an adversary
would — keeping every count the same — and checks that the damage is detected: by
``IndexStore.open`` (ids, cheaply; file checksums where cheap) and by ``twotower index check
DIR`` (exit status 2 and a message naming the damaged file), which run as a real subprocess.
"""

from __future__ import annotations

import json
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from twotower.indexing import IndexFormatError, IndexStore

DIM = 8
X = np.random.default_rng(0).normal(size=(60, DIM)).astype("float32")


def _build(d: Path, factory: str = "Flat") -> Path:
    with IndexStore.create(d, DIM, factory, "cosine", bm25=True) as store:
        store.add([{"id": f"s{i}", "text": f"seed word{i}"} for i in range(40)], X[:40])
    with IndexStore.open(d) as store:  # a second commit: more than one vector file / segment
        _ = store.bm25
        store.add([{"id": f"s{i}", "text": f"seed word{i}"} for i in range(40, 60)], X[40:60])
        store.delete(["s3"])
    return d


def _check(d: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "twotower", "index", "check", str(d)],
                          capture_output=True, text=True, timeout=120)


def _vector_file_with(d: Path, needle: bytes) -> Path:
    for p in sorted(d.glob("*.faiss")):
        if needle in p.read_bytes():
            return p
    raise AssertionError(f"no vector file in {d} holds {needle!r}")


def test_check_passes_on_a_sound_index(tmp_path):
    d = _build(tmp_path / "idx")
    r = _check(d)
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


def test_renamed_id_in_vector_trailer_is_detected(tmp_path, monkeypatch):
    d = _build(tmp_path / "idx")
    p = _vector_file_with(d, b'"s5"')
    data = p.read_bytes()
    p.write_bytes(data.replace(b'"s5"', b'"x5"'))  # same length: the trailer still parses, counts agree
    with pytest.raises(IndexFormatError, match="checksum mismatch"):
        IndexStore.open(d, readonly=True)  # a small file: hashed on open
    import twotower.indexing.store as store_module

    monkeypatch.setattr(store_module, "HASH_ON_OPEN_MAX", 0)  # as for a large file: only ids are checked
    with pytest.raises(IndexFormatError, match="ids in the file's id map differ"):
        IndexStore.open(d, readonly=True)
    r = _check(d)
    assert r.returncode == 2 and p.name in r.stderr, r.stderr
    assert "docs.sqlite" not in r.stderr, r.stderr  # the database is fine: only the segment is named


def test_replaced_sqlite_row_with_same_count_is_detected(tmp_path):
    d = _build(tmp_path / "idx")
    con = sqlite3.connect(d / "docs.sqlite")
    con.execute("DELETE FROM docs WHERE id = 's7'")
    con.execute("INSERT INTO docs (id, title, text, metadata) VALUES ('intruder', '', 'hello', '{}')")
    con.commit()
    con.close()
    with pytest.raises(IndexFormatError, match="docs.sqlite"):
        IndexStore.open(d, readonly=True)
    r = _check(d)
    assert r.returncode == 2 and "docs.sqlite" in r.stderr, r.stderr


def test_changed_document_text_is_detected_by_check(tmp_path):
    d = _build(tmp_path / "idx")
    con = sqlite3.connect(d / "docs.sqlite")
    con.execute("UPDATE docs SET text = 'rewritten' WHERE id = 's9'")
    con.commit()
    con.close()
    r = _check(d)
    assert r.returncode == 2 and "docs.sqlite" in r.stderr, r.stderr


@pytest.mark.parametrize("factory", ["Flat", "HNSW32"])
def test_flipped_float_bits_are_detected(tmp_path, factory):
    d = _build(tmp_path / "idx", factory)
    v = X[10] / np.linalg.norm(X[10])  # stored normalised (cosine)
    needle = v.astype("<f4").tobytes()
    p = _vector_file_with(d, needle)
    data = bytearray(p.read_bytes())
    at = bytes(data).index(needle)
    (f,) = struct.unpack_from("<f", data, at)
    struct.pack_into("<I", data, at, struct.unpack("<I", struct.pack("<f", f))[0] ^ 0x40000000)  # exponent bit
    p.write_bytes(bytes(data))
    with pytest.raises(IndexFormatError, match="checksum"):
        IndexStore.open(d, readonly=True)  # small files are hashed on open
    r = _check(d)
    assert r.returncode == 2 and p.name in r.stderr and "checksum" in r.stderr, r.stderr
    assert "docs.sqlite" not in r.stderr, r.stderr  # an unreadable segment's ids are not blamed on the database


def test_damaged_bm25_cache_is_reported(tmp_path):
    d = _build(tmp_path / "idx")
    (p,) = d.glob("bm25-*.npz")
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    r = _check(d)
    assert r.returncode == 2 and p.name in r.stderr, r.stderr


def test_check_reports_json(tmp_path):
    d = _build(tmp_path / "idx")
    r = subprocess.run([sys.executable, "-m", "twotower", "index", "check", str(d), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] is True and report["documents"] == 59 and report["problems"] == []


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_missing_or_truncated_segment_is_named(tmp_path, damage):
    d = _build(tmp_path / "idx")
    p = sorted(d.glob("seg-*.faiss"))[0]
    if damage == "delete":
        p.unlink()
    else:
        p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(IndexFormatError, match="missing" if damage == "delete" else "bytes"):
        IndexStore.open(d, readonly=True)  # no writer explains it: an error, after one retry at most
    with pytest.raises(IndexFormatError):
        IndexStore.open(d)
    r = _check(d)
    assert r.returncode == 2 and p.name in r.stderr, r.stderr


def test_check_of_a_directory_that_is_not_an_index(tmp_path):
    r = _check(tmp_path / "nothing-here")
    assert r.returncode == 2 and "not found" in r.stderr


def test_check_names_an_edited_manifest_not_the_segments(tmp_path):
    """``index check`` compared each segment with an edited manifest and blamed the segments ("holds dim=8 ...,
    manifest says dim=9"); opening the index named manifest.json. Both compare it with docs.sqlite first."""
    d = _build(tmp_path / "idx")
    manifest = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({**manifest, "dim": DIM + 1}))
    r = _check(d)
    assert r.returncode == 2, r.stderr
    assert f"{d / 'manifest.json'}: manifest says dim={DIM + 1}" in r.stderr, r.stderr
    assert f"records dim={DIM}" in r.stderr and ".faiss" not in r.stderr, r.stderr


def _set_vector_options(d: Path, value: str) -> None:
    con = sqlite3.connect(d / "docs.sqlite")
    con.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('vector_options', ?)", (value,))
    con.commit()
    con.close()


@pytest.mark.parametrize("value", ["{bad", "[1]"])
def test_a_damaged_vector_options_entry_is_named_in_docs_sqlite(tmp_path, value):
    """``index check`` of a damaged 'vector_options' entry: '{bad' was a JSONDecodeError naming no file, '[1]' a
    TypeError traceback; opening the index failed the same ways."""
    from twotower.indexing.check import check_index

    d = _build(tmp_path / "idx")
    _set_vector_options(d, value)
    said = f"{d / 'docs.sqlite'}: its 'vector_options' entry is damaged (not a JSON object: {value!r})"
    assert check_index(d).problems == [said]
    with pytest.raises(IndexFormatError) as e:
        IndexStore.open(d, readonly=True)
    assert str(e.value) == said


def test_check_compares_the_segments_with_docs_sqlite_where_the_manifest_disagrees(tmp_path):
    """Where manifest.json and docs.sqlite disagree, the segments' dim and metric were not checked at all; they
    are compared with what docs.sqlite records."""
    from twotower.indexing.check import check_index

    d = _build(tmp_path / "idx")
    options = json.loads(sqlite3.connect(d / "docs.sqlite").execute(
        "SELECT value FROM meta WHERE key = 'vector_options'").fetchone()[0])
    _set_vector_options(d, json.dumps({**options, "dim": DIM + 1}))
    problems = check_index(d).problems
    assert problems[0].startswith(f"{d / 'manifest.json'}: manifest says dim={DIM}"), problems
    segments = sorted(p.name for p in d.glob("seg-*.faiss"))
    assert len(segments) > 1 and problems[1:] == [
        f"{d / name}: holds dim={DIM} metric=cosine, docs.sqlite records dim={DIM + 1} metric=cosine"
        for name in segments]
