"""``check_index``: verify every committed file of an index directory (``twotower index check DIR``).

Opening an index checks what is cheap (ids against the commit record, sizes, SHA-256 of small
segment files). ``check_index`` checks everything, reading every byte once, and reports every
problem it finds rather than stopping at the first:

* ``manifest.json`` parses and describes the vectors;
* ``docs.sqlite`` passes SQLite's ``PRAGMA integrity_check``, and the digests of its ids and of
  its rows equal the ones recorded at the last write (a row replaced, renamed or edited outside
  twotower changes them); every document split into passages can be rebuilt from them (one
  removed alone by an earlier version's delete could not);
* each segment file named by the commit record exists, has the recorded size and SHA-256, and
  its id map holds the recorded ids; each tombstone names an id its segment holds;
* the ids of the vectors (segments minus tombstones) are exactly the ids of the documents;
* for a Milvus-backed index: the collection is the one the manifest names (dimension, metric,
  encoder, index id), its key table names exactly the documents, and the collection holds the
  vector of every live document (rows of an interrupted commit are noted, not a problem; a Milvus
  Lite file another process holds is reported as ``busy``: unchecked, not damaged);
* the BM25 cache of the generation, when present, has the SHA-256 recorded when it was saved
  and loads (a damaged cache is harmless to delete: it is rebuilt).
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twotower.indexing.bm25 import BM25
from twotower.indexing.docstore import DocStore
from twotower.indexing.errors import IndexFormatError
from twotower.indexing.integrity import combine, file_sha256, set_digest
from twotower.indexing.manifest import MANIFEST_NAME, Manifest
from twotower.indexing.passage_rows import in_passage_order, passages_problem
from twotower.indexing.segments import CHECK_HINT, SegmentVanished, load_segment


@dataclass
class CheckReport:
    """What ``check_index`` found; ``problems`` are one line each, naming the file."""

    directory: str
    ok: bool = True
    generation: int | None = None
    documents: int | None = None  # a document split into passages counts once
    passages: int = 0  # rows that are passages of split documents
    segments: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # harmless findings (repaired by the next writable open)
    # Why the vectors could not be checked now (a Milvus Lite file another process holds): contention, not damage.
    busy: str | None = None

    def problem(self, path: str | os.PathLike, message: str) -> None:
        self.ok = False
        self.problems.append(f"{os.fspath(path)}: {message}")

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def check_index(directory: str | os.PathLike) -> CheckReport:
    """Verify the last commit of `directory` completely (see the module docstring); never raises for damage."""
    from twotower.indexing.store import (
        DOCS_NAME,
        bm25_name,
        recorded_vector_options,
        vector_options,
        vectors_name,
    )

    d = Path(directory)
    report = CheckReport(str(d))
    if not d.exists():
        report.problem(d, "index directory not found")
        return report
    if not d.is_dir():
        report.problem(d, "a file, not an index directory")
        return report
    try:
        manifest = Manifest.read(d / MANIFEST_NAME)
    except IndexFormatError as e:
        report.problem(e.path, str(e).removeprefix(e.path + ": "))
        return report
    db = d / DOCS_NAME
    try:
        docs = DocStore(db, readonly=True)
    except (IndexFormatError, FileNotFoundError) as e:
        report.problem(db, str(e).removeprefix(str(db) + ": "))
        return report
    try:
        docs.begin(write=False)
        _check_docs(docs, report)
        _check_passages(docs, report)
        gen = docs.get_meta("generation")
        report.generation = int(gen) if gen and gen.isdigit() else None
        if report.generation is None:
            report.problem(db, f"missing or invalid 'generation' ({gen!r})")
            return report
        # first: a segment's dim or metric compared with an edited manifest blamed the segment; where the
        # manifest disagrees, the segments are checked against what docs.sqlite records (they were skipped)
        shape: tuple[int, str, str] | None = None
        try:
            recorded = recorded_vector_options(docs)
            vector_options(docs, manifest, d / MANIFEST_NAME)
            shape = (manifest.dim, manifest.metric, "manifest says")
        except IndexFormatError as e:
            report.problem(e.path, str(e).removeprefix(f"{e.path}: "))
            if e.path == os.fspath(d / MANIFEST_NAME):  # docs.sqlite's entry is readable: the segments' measure
                shape = (recorded.get("dim", manifest.dim), recorded.get("metric", manifest.metric),
                         f"{DOCS_NAME} records")
        if manifest.backend == "milvus":
            _check_milvus(d, docs, manifest, report.generation, report)
            _check_bm25(d / bm25_name(report.generation), docs, manifest, report)
            return report
        rows = docs.segment_rows() if docs.get_meta("vector_layout") else None
        if rows is None:  # the one-file layout of earlier versions: no checksums were recorded
            name = vectors_name(report.generation)
            rows = [{"name": name, "sha256": "", "ids_digest": "", "bytes": None, "stored": None}]
        tombs = docs.tombstone_ids()
        vector_ids, unreadable = 0, False
        for rec in rows:
            digest = _check_segment(d, rec, tombs.pop(rec["name"], []), shape, report)
            unreadable |= digest is None
            vector_ids = combine(vector_ids, digest or 0)
        report.segments = len(rows)
        for name in tombs:
            report.problem(db, f"tombstones name segment {name}, which is not committed")
        # an unreadable segment is its own problem line; its ids cannot be compared, and blaming docs.sqlite for
        # them named a file that is fine
        if not unreadable and vector_ids != docs.ids_digest_now():
            report.problem(db, "the ids of the documents differ from the ids of the vectors")
        _check_bm25(d / bm25_name(report.generation), docs, manifest, report)
    finally:
        docs.close()
    return report


def _check_docs(docs: DocStore, report: CheckReport) -> None:
    try:
        status = docs._conn.execute("PRAGMA integrity_check").fetchone()[0]
    except sqlite3.DatabaseError as e:
        report.problem(docs.path, f"SQLite cannot check the database: {e}")
        return
    if status != "ok":
        report.problem(docs.path, f"SQLite integrity check failed: {status}")
    report.documents, report.passages = docs.count_documents()
    recorded_ids, recorded_rows = docs.recorded_digests()
    ids_now, rows_now = docs.compute_digests()
    report.bytes_checked += docs.path.stat().st_size
    if recorded_ids is None:
        return  # written before digests were recorded
    if ids_now != recorded_ids:
        report.problem(docs.path, "the document ids are not the ones committed (a row was replaced or renamed "
                                  "outside twotower)")
    elif rows_now != recorded_rows:
        report.problem(docs.path, "a document's title, text or metadata is not the one committed (changed "
                                  "outside twotower)")


def _check_passages(docs: DocStore, report: CheckReport) -> None:
    """Every document split into passages can be rebuilt from them (`passage_rows.passages_problem`).

    Why: earlier versions let a delete remove one passage row alone; the digests were updated with it, so
    nothing else here notices, and every search or get of that document failed.
    """
    broken: list[tuple[str, str]] = []
    for parent, rows in docs.iter_passage_groups():
        problem = passages_problem(in_passage_order(rows))
        if problem:
            broken.append((parent, problem))
    if broken:
        parent, problem = broken[0]
        more = f" (and {len(broken) - 1} more: {', '.join(repr(p) for p, _ in broken[1:4])}" \
               f"{', ...' if len(broken) > 4 else ''})" if len(broken) > 1 else ""
        report.problem(docs.path, f"document {parent!r} cannot be rebuilt from its passages: {problem}{more}; "
                                  "delete each such document (twotower index delete ID) and add it again")


def _check_segment(d: Path, rec: dict[str, Any], hidden: list[str], shape: tuple[int, str, str] | None,
                   report: CheckReport) -> int | None:
    """Check one segment file against its record; returns the digest of its live ids (None if unreadable).

    `shape` is the (dim, metric) the segment must have and who says so: the manifest's, or docs.sqlite's when
    the manifest disagrees with it (that is reported once, against manifest.json, not against every segment);
    None when docs.sqlite's record is damaged."""
    path = d / rec["name"]
    if path.is_file():
        report.bytes_checked += path.stat().st_size
    try:  # the checks of every open (size, checksum, id map, count), with the checksum always computed
        index = load_segment(d, rec, mmap=True, hash_max=None).index
    except SegmentVanished:
        report.problem(path, "vector segment of the committed generation is missing")
        return None
    except IndexFormatError as e:
        report.problem(path, str(e).removeprefix(f"{path}: ").removesuffix(CHECK_HINT))
        return None
    if shape is not None and (index.dim, index.metric) != shape[:2]:
        report.problem(path, f"holds dim={index.dim} metric={index.metric}, {shape[2]} dim={shape[0]} "
                             f"metric={shape[1]}")
    missing = index.hide(hidden)
    if missing:
        report.problem(d / "docs.sqlite", f"tombstones of {rec['name']} name ids it does not hold, e.g. {missing[:3]}")
    return set_digest(index.ids())


def _check_milvus(d: Path, docs: DocStore, manifest: Manifest, generation: int, report: CheckReport) -> None:
    """A Milvus-backed index, its client held for the check only: a Milvus Lite file is unlocked after it
    (`check_index` in a long-lived process left it locked for every other process)."""
    from twotower.indexing import milvus as mv

    uri = (manifest.milvus or {}).get("uri")
    if uri:
        mv.hold(uri)
    try:
        _check_collection(d, docs, manifest, generation, report)
    finally:
        if uri:
            mv.release(uri)


def _check_collection(d: Path, docs: DocStore, manifest: Manifest, generation: int, report: CheckReport) -> None:
    """The key table names exactly the documents, and the collection holds every key."""
    from twotower.indexing import milvus as mv

    db = d / "docs.sqlite"
    try:
        client = mv.open_collection(manifest.milvus or {}, manifest.dim, manifest.metric, d / MANIFEST_NAME)
    except mv.MilvusBusyError as e:
        report.busy = str(e)
        return
    except (IndexFormatError, mv.MilvusUnavailableError) as e:
        report.problem(getattr(e, "path", d / MANIFEST_NAME), str(e).removeprefix(str(getattr(e, "path", "")) + ": "))
        return
    vectors = mv.MilvusVectors(client, manifest.milvus or {}, manifest.dim, manifest.metric, manifest.factory, {},
                               docs, generation)
    if vectors.digest_now() != docs.ids_digest_now():
        report.problem(db, "the ids of the documents differ from the ids of the vectors (table vector_keys)")
    missing = vectors.missing_keys(limit=5)
    if missing:
        report.problem(f"Milvus collection {vectors.collection!r} at {vectors.record['uri']}",
                       f"lacks the vectors of {missing[0]} live document(s), e.g. {missing[1]} (deleted outside "
                       "twotower?); rebuild the index, or delete and re-add those documents")
    orphans = mv.row_count(client, vectors.collection, f"gen > {generation}")
    if orphans:
        report.notes.append(f"{orphans} vectors of an interrupted commit are in the collection; the next "
                            "writable open deletes them (searches never see them)")


def _check_bm25(path: Path, docs: DocStore, manifest: Manifest, report: CheckReport) -> None:
    if not path.exists():
        if manifest.bm25 is not None:  # a derived cache: harmless, but every process then pays a rebuild
            report.notes.append(f"{path.name}: the BM25 cache of generation {report.generation} is missing; each "
                                "process rebuilds it from the documents at its first BM25 search, and the next "
                                "`index add` or `index delete` saves it again")
        return
    report.bytes_checked += path.stat().st_size
    recorded = docs.get_meta("bm25_sha256") or ""
    gen, _, sha = recorded.partition(":")
    if gen == str(report.generation) and sha and file_sha256(path) != sha:
        report.problem(path, "checksum mismatch: the BM25 cache is damaged (delete it; it is rebuilt from the "
                             "documents)")
        return
    try:
        BM25.load(path)
    except Exception as e:  # noqa: BLE001 - any failure to load is the finding
        report.problem(path, f"the BM25 cache does not load ({type(e).__name__}: {e}); delete it, it is rebuilt")
