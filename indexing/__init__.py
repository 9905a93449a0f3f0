"""twotower.indexing: vectors and documents at rest.

* ``VectorIndex`` — FAISS index with string ids (Flat / HNSW / IVF / PQ, cosine / ip / l2),
  tombstones for graph indexes, atomic single-file save, memory-mapped load.
* ``DocStore`` — SQLite document store (id, title, text, JSON metadata).
* ``BM25`` — lexical search (bm25s, Lucene variant, Snowball stemming) with lazy rebuild.
* ``IndexStore`` — a directory tying the three together with crash-safe commits; its vectors are
  append-only segments (``Segments``, ``MergePolicy``) checked against checksums on open.
* ``check_index`` — verify every file of an index directory (``twotower index check``).
* ``auto_factory`` — the index type chosen for a corpus size.
"""

from twotower.indexing.bm25 import BM25, document_text
from twotower.indexing.check import CheckReport, check_index
from twotower.indexing.docstore import DocStore, Document, as_document
from twotower.indexing.errors import IndexDiskFullError, IndexFormatError
from twotower.indexing.factory import auto_factory, index_kind
from twotower.indexing.manifest import Manifest
from twotower.indexing.search_result import MISSING_ID, SearchResult
from twotower.indexing.segments import MergePolicy, Segments
from twotower.indexing.store import IndexLockedError, IndexNotWritableError, IndexStore, Snapshot
from twotower.indexing.vector_index import FactoryError, VectorIndex, check_factory

__all__ = [
    "BM25",
    "CheckReport",
    "DocStore",
    "Document",
    "FactoryError",
    "IndexDiskFullError",
    "IndexFormatError",
    "IndexLockedError",
    "IndexNotWritableError",
    "IndexStore",
    "MISSING_ID",
    "Manifest",
    "MergePolicy",
    "SearchResult",
    "Segments",
    "Snapshot",
    "VectorIndex",
    "as_document",
    "auto_factory",
    "check_factory",
    "check_index",
    "document_text",
    "index_kind",
]
