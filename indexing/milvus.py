"""Vectors in a Milvus collection, committed with the documents of an ``IndexStore``.

``MilvusVectors`` is the second implementation of ``twotower.indexing.vectors.VectorBackend``
(the first is FAISS ``Segments``). The index directory keeps what it always keeps — manifest,
``docs.sqlite`` (documents, BM25 cache, the commit record) — and the vectors live in a Milvus
collection reached through ``pymilvus.MilvusClient``: a Milvus Lite file (``./name.db``, from
the ``milvus-lite`` package, runs inside the process) or a server / cluster (``http://host:19530``).

Why the consistency protocol looks like this. Milvus and SQLite cannot commit in one
transaction, and Milvus has no snapshot a reader could pin. So the SQLite commit stays the one
commit point, and Milvus rows are made harmless on both sides of it:

* **Rows are never overwritten.** A row's primary key is a *version key*
  ``<generation>:<id>`` (with ``gen`` and ``doc_id`` also stored as fields, and the document's
  ``metadata`` as a JSON field for filters). Adding a document in the commit that makes
  generation ``g+1`` inserts ``g+1:<id>``; replacing it inserts a new row beside the old one.
* **The documents say which rows are live.** ``docs.sqlite`` holds ``vector_keys(id,
  generation)`` — each live id's current key — changed in the same transaction as the documents,
  so it commits with them at the SQLite commit point. Superseded and deleted keys go to
  ``vector_garbage(key, generation, retired)`` in the same transaction.
* **Commit** (``prepare_commit``, before the commit point): rows of an earlier interrupted
  attempt (``gen > g``) are deleted, then the staged vectors are upserted as ``g+1:<id>``.
  Staged vectors wait in memory, but at most ``FLUSH_ROWS`` of them: a bigger batch (a bulk
  build) is written to Milvus as it is staged, under the same ``g+1`` keys — invisible to
  readers, deleted if the commit never happens — so the writer's memory does not grow with it. Then the store commits SQLite. After it (``apply``), garbage keys
  retired more than ``RETAIN_SECONDS`` ago are deleted from Milvus and from the garbage table.
* **Search** asks Milvus for rows with ``gen <= g`` (the reader's generation) and keeps a hit
  only if its key is the id's current key *in the reader's own SQLite snapshot*; it over-fetches
  by the rows it knows to be stale and asks again, deeper, while hits were dropped and Milvus
  had more — so a search returns k live hits when k exist (up to Milvus's ``limit`` cap of
  16384). A search running during a commit therefore answers from the commit before it (the new
  rows have ``gen = g+1``; the old ones stay for ``RETAIN_SECONDS``) and, after ``refresh()``,
  from the commit after it.
* **A process killed between the Milvus write and the SQLite commit point** leaves rows with
  ``gen > g`` that no document names: readers never see them (``gen <= g``), and the next writable
  open deletes them (``repair``). Killed after the commit point, the garbage table still lists the
  superseded keys, and they are deleted later. ``repair`` then counts: Milvus must hold every
  current key; if it does not (rows deleted outside twotower, a server that lost data), opening
  for writing raises ``IndexFormatError`` naming the collection and ``twotower index check``
  lists the missing ids.

The collection records what it holds as properties (``twotower.dim``, ``twotower.metric``,
``twotower.fingerprint`` — the encoder fingerprint the caller passes —, ``twotower.index_id``,
the manifest's random id, and ``twotower.owner``, the index directory), given in the request that
creates it, so that no crash leaves a collection of ours without them: creating an index refuses
a collection of another dimension, another encoder or another index; opening one refuses a
collection that is not the one its manifest names.

Milvus Lite (3.x) locks its ``.db`` for one process: a writer and readers of a Milvus Lite index
must share a process (the HTTP service does). A Milvus server has no such limit.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from twotower.common.errors import flags_need
from twotower.indexing.docstore import DocStore
from twotower.indexing.errors import IndexFormatError
from twotower.indexing.integrity import combine, hex64, set_digest
from twotower.indexing.search_result import MISSING_ID, MISSING_SCORE, SearchResult, check_k
from twotower.indexing.segments import CommitPlan
from twotower.indexing.vector_index import VectorIndex

logger = logging.getLogger(__name__)


class _UnimplementedCallNoise(logging.Filter):
    """Drop gRPC's report of a call to a method the in-process Milvus Lite server does not implement.

    Why: pymilvus asks the server for `AllocTimestamp`, gets "not implemented" and carries on, and gRPC logged
    that with a 10-line traceback on every Milvus Lite build, which succeeded. Other gRPC errors still show.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Exception calling application: Method not implemented")


logging.getLogger("grpc._server").addFilter(_UnimplementedCallNoise())


class _LiteStartFailures(logging.Filter):
    """Keep Milvus Lite's report of a server that did not start (its exception, by path) for `connect` to say in
    one line, instead of letting it print.

    Why: Milvus Lite logs ~20 lines of traceback (``DataDirLockedError`` while another process, e.g.
    ``twotower serve``, holds the file) before twotower's own one-line message, on every command.
    """

    def __init__(self) -> None:
        super().__init__()
        self.failures: dict[str, BaseException] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not (str(record.msg).startswith("Failed to start MilvusLite server") and record.exc_info and record.args):
            return True
        self.failures[str(record.args[0])] = record.exc_info[1]  # type: ignore[index]
        return False

    def pop(self, uri: str) -> BaseException | None:
        """The failure recorded for the Milvus Lite file `uri`, forgotten once asked for."""
        return self.failures.pop(os.path.abspath(uri), None) if is_local(uri) else None


_LITE_FAILURES = _LiteStartFailures()
logging.getLogger("milvus_lite.server_manager").addFilter(_LITE_FAILURES)

LAYOUT = "milvus-1"  # meta 'vector_layout' of a Milvus-backed store
INDEX_TYPES = ("FLAT", "IVF_FLAT", "HNSW")  # Milvus index types accepted as the "factory"
DEFAULT_INDEX_TYPE = "FLAT"  # exact search, comparable with FAISS Flat
METRICS = {"cosine": "COSINE", "ip": "IP", "l2": "L2"}
MAX_LIMIT = 16384  # Milvus's bound on topk (offset + limit) for one search
ID_MAX_LENGTH = 65535  # VARCHAR bound of Milvus; the key adds "<generation>:"
INSERT_BATCH = 2000  # rows per upsert request (bounded message size)
FLUSH_ROWS = 20_000  # staged vectors held in memory before they are written to Milvus (as gen g+1)
RETAIN_SECONDS = 10.0  # superseded rows stay this long for readers still on an older commit
PROP = "twotower."
FLAG = "--milvus-uri"

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS vector_keys (id TEXT PRIMARY KEY NOT NULL, generation INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS vector_garbage (key TEXT PRIMARY KEY NOT NULL, generation INTEGER NOT NULL, "
    "retired REAL)",
)
_SCHEME_RE = re.compile(r"^[a-z][a-z0-9+.-]*://", re.I)
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,254}$")


class MilvusUnavailableError(ValueError, ConnectionError):
    """Milvus cannot be reached at the URI given (the message names the URI and ``--milvus-uri``).

    A ``ValueError`` too: it is the user's input (the URI) that is wrong, and the CLI prints it as one line.
    """


class MilvusBusyError(MilvusUnavailableError):
    """The Milvus Lite file is held by another process (Milvus Lite opens a file in one process at a time).

    Its own type because it is contention, not damage: ``twotower index check`` reports it as busy.
    """


# ---------------------------------------------------------------------- where the collection is
def resolve_uri(uri: str, flag: str = FLAG) -> str:
    """A server URI as given; a Milvus Lite file (``./name.db``) as an absolute path (relative to the cwd)."""
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"{flag}: give a Milvus Lite file (./name.db) or a server address (http://host:19530)")
    uri = uri.strip()
    if _SCHEME_RE.match(uri) or uri.startswith("unix:"):
        return uri
    if not uri.endswith(".db"):
        raise ValueError(f"{flag} {uri}: a local Milvus Lite file must end in .db (e.g. ./vectors.db); "
                         "a server address starts with http:// or https://")
    path = os.path.abspath(os.path.expanduser(uri))
    if not os.path.isdir(os.path.dirname(path)):
        raise ValueError(f"{flag} {uri}: directory {os.path.dirname(path)} does not exist")
    problem = _lite_path_problem(path)
    if problem:
        raise ValueError(f"{flag} {uri}: {problem}; give a new name (e.g. ./vectors.db) or an existing Milvus Lite "
                         "store")
    return path


# What Milvus Lite (3.x) keeps in the directory at its ``.db`` path; one of these marks a store of its own.
_LITE_ENTRIES = frozenset({"LOCK", "collections", "databases", ".database-staging"})


def _lite_path_problem(path: str) -> str | None:
    """Why ``path`` cannot be a Milvus Lite store, or None.

    Milvus Lite keeps its data in a directory at the ``.db`` path and adopts whatever is there: it fails on an
    ordinary file with a traceback and a misleading lock message, and writes its store into a directory of
    the user's own files. Both are refused before anything connects.
    """
    if os.path.isdir(path):
        entries = set(os.listdir(path))
        if entries and not entries & _LITE_ENTRIES:
            return f"{path} is a directory of other files, not a Milvus Lite store"
        return None
    if os.path.lexists(path):
        return f"{path} is an ordinary file, not a Milvus Lite store (Milvus Lite keeps a directory there)"
    return None


def is_local(uri: str) -> bool:
    return not (_SCHEME_RE.match(uri) or uri.startswith("unix:"))


def default_collection(directory: str | os.PathLike) -> str:
    """``twotower_<directory name>``, made a valid Milvus collection name."""
    base = re.sub(r"[^A-Za-z0-9_]", "_", Path(os.path.abspath(directory)).name) or "index"
    return f"twotower_{base}"[:255]


def check_collection_name(name: str, flag: str = "--collection") -> str:
    """`name` if Milvus accepts it as a collection name, else a ValueError naming `flag`.

    An empty name is refused like any other invalid one: it used to mean the default collection (a
    build with ``--collection ""`` went to ``twotower_<OUT name>``), which the user had not asked for.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"{flag} {name!r}: a Milvus collection name is letters, digits and underscores, "
                         "starting with a letter or underscore (at most 255 characters)")
    return name


@dataclass(frozen=True)
class MilvusSpec:
    """Where an index's vectors live: the URI (resolved) and the collection, plus what the collection must match."""

    uri: str
    collection: str
    fingerprint: str = ""  # the encoder fingerprint (the pipeline's); "" = not checked
    owner: str = ""  # the index directory the collection belongs to (absolute); "" = the directory created
    index_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def record(self) -> dict[str, str]:
        """The manifest's ``milvus`` object."""
        return {"uri": self.uri, "collection": self.collection, "fingerprint": self.fingerprint,
                "index_id": self.index_id}


def milvus_flags_without_milvus(uri: str | None, collection: str | None) -> str | None:
    """What is wrong with giving Milvus's flags to a FAISS build ("" counts as given: it would be ignored), naming
    only the flags given (one given alone was reported as "--milvus-uri and --collection"), or None."""
    return flags_need({"--milvus-uri": uri, "--collection": collection}, "--backend milvus")


def milvus_spec(backend: str, uri: str | None, collection: str | None,
                directory: str | os.PathLike) -> MilvusSpec | None:
    """The Milvus target of a new index from the build options (None for FAISS); connects once to fail early.

    Errors name the flags: ``--backend``, ``--milvus-uri``, ``--collection``.
    """
    if backend not in ("faiss", "milvus"):
        raise ValueError(f"--backend {backend!r}: choose 'faiss' or 'milvus'")
    if backend == "faiss":
        if problem := milvus_flags_without_milvus(uri, collection):
            raise ValueError(problem)
        return None
    if collection is not None:  # before connecting: a bad name is the user's to fix, not the server's
        check_collection_name(collection)
    if not uri:
        raise ValueError("--backend milvus needs --milvus-uri (a Milvus Lite file such as ./vectors.db, or "
                         "http://host:19530)")
    resolved = resolve_uri(uri)
    name = collection if collection is not None else default_collection(directory)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun only rank 0 writes to Milvus (Lite: one process)
        connect(resolved)
    return MilvusSpec(resolved, name, owner=os.path.abspath(directory))


_REJECTED: set[tuple[str, str]] = set()  # (uri, filter expression) this process's Milvus refused (resolved from the documents)


class _Rejected(Exception):
    pass


_clients: dict[str, Any] = {}
_holders: dict[str, int] = {}  # open stores using each URI's client (`hold`, `release`)
_clients_lock = threading.Lock()


def connect(uri: str, flag: str = FLAG) -> Any:
    """One ``MilvusClient`` per URI per process (Milvus Lite runs one server per file per process)."""
    with _clients_lock:
        client = _clients.get(uri)
        if client is not None:
            return client
        try:
            from pymilvus import MilvusClient
        except ImportError:
            raise MilvusUnavailableError(
                f"{flag} {uri}: the Milvus backend needs pymilvus and milvus-lite; pip install 'twotower[milvus]'"
            ) from None
        try:
            client = MilvusClient(uri=uri, timeout=10)
            client.list_collections()
        except Exception as e:  # noqa: BLE001 - pymilvus raises MilvusException and others; one message for all
            cause = _LITE_FAILURES.pop(uri)
            if type(cause).__name__ == "DataDirLockedError":
                raise MilvusBusyError(f"cannot open Milvus at {uri} ({flag}): the Milvus Lite file is in use by another "
                                      "process (one process at a time: stop the other, e.g. `twotower serve`, or "
                                      "use a Milvus server)") from None
            why = getattr(e, "message", None) or str(e)
            if cause is not None:
                why += f" ({type(cause).__name__}: {cause})"
                if getattr(cause, "errno", None) in (errno.EROFS, errno.EACCES):
                    why += "; Milvus Lite writes its file even to search it, so it cannot be read from read-only storage"
            elif "lock" in str(e).lower() or "Open local milvus failed" in str(e):
                why += " (a Milvus Lite file is used by one process at a time: is another one using it?)"
            raise MilvusUnavailableError(f"cannot reach Milvus at {uri} ({flag}): {why}") from None
        _clients[uri] = client
        return client


def hold(uri: str) -> None:
    """Count one more user (an open store) of the client of `uri`; `release` gives it back.

    Why: the process's stores share one client per URI (the service's reader and writer do), and a
    Milvus Lite client keeps its file locked while it is open; the last user to let go must close it,
    or no other process can open the index until this one exits.
    """
    with _clients_lock:
        _holders[uri] = _holders.get(uri, 0) + 1


def release(uri: str) -> None:
    """One user of `uri` fewer: the last one closes the client, and for a Milvus Lite file stops the
    in-process server that holds the file's lock (the next `connect` starts it again)."""
    with _clients_lock:
        users = _holders.pop(uri, 0) - 1
        if users > 0:
            _holders[uri] = users
            return
        client = _clients.pop(uri, None)
    if client is not None:
        _close_client(uri, client)


def _close_client(uri: str, client: Any) -> None:
    """Close a client and, for a Milvus Lite file, its server: closing the client alone leaves the server
    (and the file's lock) running until the process exits."""
    try:
        client.close()
    except Exception as e:  # noqa: BLE001 - a broken connection is closed enough; the lock matters more
        logger.debug("closing the Milvus client of %s: %s", uri, e)
    if not is_local(uri):
        return
    try:
        from milvus_lite.server_manager import server_manager_instance
    except ImportError:
        return
    server_manager_instance.release_server(uri)


def describe(client: Any, name: str) -> dict[str, str] | None:
    """The twotower properties of collection `name` ({} when it has none), or None when it does not exist."""
    if not client.has_collection(name):
        return None
    props = client.describe_collection(name).get("properties") or {}
    return {k[len(PROP):]: str(v) for k, v in props.items() if k.startswith(PROP)}


def row_count(client: Any, name: str, expr: str = "") -> int:
    res = client.query(name, filter=expr, output_fields=["count(*)"], consistency_level="Strong")
    return int(res[0]["count(*)"]) if res else 0


def check_target(spec: MilvusSpec, dim: int, metric: str, *, create: bool = False,
                 index_type: str = DEFAULT_INDEX_TYPE) -> Any:
    """Connect and check that `spec` can take a new index of this dimension and encoder; returns the client.

    Refused: a collection with another dimension, metric or encoder fingerprint, one not made by
    twotower, or one of another index, empty or not (`_owned_elsewhere`). A collection left by a failed
    build of the same directory (its owner has no manifest) is dropped. With ``create`` the collection is
    (re)made.
    """
    client = connect(spec.uri)
    name, where = spec.collection, f"Milvus collection {spec.collection!r} at {spec.uri}"
    props = describe(client, name)
    if props is not None:
        if not props:
            raise ValueError(f"{where} exists and was not created by twotower; choose another --collection")
        if props.get("dim") != str(dim):
            raise ValueError(f"{where} holds vectors of dimension {props.get('dim')}, this encoder makes {dim}; "
                             "choose another --collection (or drop that one)")
        if spec.fingerprint and props.get("fingerprint") and props["fingerprint"] != spec.fingerprint:
            raise ValueError(f"{where} holds vectors of another encoder (fingerprint {props['fingerprint']}, this "
                             f"one is {spec.fingerprint}); choose another --collection (or drop that one)")
        if props.get("metric") != metric:
            raise ValueError(f"{where} uses metric {props.get('metric')}, this index {metric}; choose another "
                             "--collection")
        client.load_collection(name)  # a collection of an earlier process starts released
        if problem := _owned_elsewhere(spec, props.get("owner", ""), row_count(client, name)):
            raise ValueError(f"{where} {problem}; choose another --collection, or drop that one")
        if create:
            client.drop_collection(name)
    if create:
        _create_collection(client, spec, dim, metric, index_type)
    return client


def _owned_elsewhere(spec: MilvusSpec, prev: str, rows: int) -> str | None:
    """Why the collection recorded as belonging to directory `prev` is not free for `spec`, or None to take it over.

    Taken over: only the leftover of a failed build of the same directory (`prev` is `spec.owner`, and holds
    no index; the collection is empty, or the build's ``<out>.build`` is there). Not by its row count alone:
    an index whose documents were all deleted has an empty collection, and dropping it broke that index for
    good. Nor because `prev` is gone: an index opens by its collection's index id, not its path, so a moved
    index still owns its collection, also against a new build at its old path.
    """
    manifest = bool(prev) and os.path.exists(os.path.join(prev, "manifest.json"))
    unfinished = f"{prev.rstrip(os.sep)}.build"
    # a failed build of this directory: killed before its first vector, or in an `index build` whose work
    # directory is still there; vectors with neither are a moved index's (`mv X Y`, then a build at X)
    if prev == spec.owner and not manifest and (not rows or os.path.isdir(unfinished)):
        return None
    held = f"already holds {rows} vectors of" if rows else "is empty but belongs to"
    if prev and not manifest and os.path.exists(unfinished):
        return f"{held} the unfinished build of {prev} (rerun that build, or remove {unfinished})"
    moved = "" if manifest or not prev else " (no index there now: if it was moved, it still uses this collection)"
    return f"{held} the index {prev or '(unknown)'}{moved}"


def _create_collection(client: Any, spec: MilvusSpec, dim: int, metric: str, index_type: str) -> None:
    from pymilvus import DataType, MilvusClient

    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("pk", DataType.VARCHAR, is_primary=True, max_length=ID_MAX_LENGTH)
    schema.add_field("doc_id", DataType.VARCHAR, max_length=ID_MAX_LENGTH)
    schema.add_field("gen", DataType.INT64)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=dim)
    schema.add_field("metadata", DataType.JSON)
    params = client.prepare_index_params()
    params.add_index(field_name="vector", index_type=index_type, metric_type=METRICS[metric],
                     params=_build_params(index_type))
    props = _properties(spec, dim, metric)
    client.create_collection(spec.collection, schema=schema, index_params=params, consistency_level="Strong",
                             properties=props)
    if describe(client, spec.collection) != {k[len(PROP):]: v for k, v in props.items()}:
        client.alter_collection_properties(spec.collection, properties=props)  # a server that ignored them


def _properties(spec: MilvusSpec, dim: int, metric: str) -> dict[str, str]:
    """What the collection records about itself, given with ``create_collection`` in the same request.

    Why in that request: set afterwards (``alter_collection_properties``), a build killed between the two
    calls left an empty collection with no properties, which every rerun refused as not twotower's.
    """
    return {PROP + "format": "1", PROP + "dim": str(dim), PROP + "metric": metric,
            PROP + "fingerprint": spec.fingerprint, PROP + "index_id": spec.index_id, PROP + "owner": spec.owner}


def _build_params(index_type: str) -> dict[str, Any]:
    return {"HNSW": {"M": 32, "efConstruction": 40}, "IVF_FLAT": {"nlist": 1024}}.get(index_type, {})


def check_index_type(index_type: str | None) -> str:
    t = (index_type or DEFAULT_INDEX_TYPE).upper()
    if t not in INDEX_TYPES:
        raise ValueError(f"--factory {index_type!r}: a Milvus index type is one of {', '.join(INDEX_TYPES)}")
    return t


def open_collection(record: Mapping[str, Any], dim: int, metric: str, where: str | os.PathLike) -> Any:
    """Connect to the collection a manifest names and check it is that index's; returns the client."""
    uri, name = record["uri"], record["collection"]
    if is_local(uri) and not os.path.exists(uri):  # MilvusClient would create an empty one there
        raise IndexFormatError(where, f"field 'milvus.uri': the Milvus Lite file {uri} is missing; an index records "
                                      "its Milvus Lite file's absolute path and nothing repoints it: move the file "
                                      "back to that path, or rebuild the index")
    try:
        client = connect(uri, flag=f"{os.fspath(where)}: field 'milvus.uri'")
    except MilvusUnavailableError as e:
        raise type(e)(f"{e}; the index {os.path.dirname(os.fspath(where))} keeps its vectors there") from None
    props = describe(client, name)
    label = f"Milvus collection {name!r} at {uri}"
    if props is None:
        raise IndexFormatError(where, f"{label} does not exist (dropped?); rebuild the index")
    if props.get("index_id") != record.get("index_id") or props.get("dim") != str(dim) \
            or props.get("metric") != metric:
        raise IndexFormatError(where, f"{label} is not this index's (it records index {props.get('index_id')}, "
                                      f"dim {props.get('dim')}, metric {props.get('metric')}; the manifest says "
                                      f"{record.get('index_id')}, dim {dim}, metric {metric})")
    if record.get("fingerprint") and props.get("fingerprint") != record["fingerprint"]:
        raise IndexFormatError(where, f"{label} holds vectors of encoder {props.get('fingerprint')}, the manifest "
                                      f"says {record['fingerprint']}")
    client.load_collection(name)
    return client


def ensure_tables(docs: DocStore) -> None:
    for sql in _SCHEMA:
        docs.write(sql)


# ---------------------------------------------------------------------- the backend
class MilvusVectors:
    """A Milvus collection as an ``IndexStore``'s vectors, at one committed generation (see the module docstring).

    ``docs`` is the connection of the snapshot (a reader's is pinned to its commit; the writer's holds
    the staged transaction, which is where staged keys live until the commit point).
    """

    native_filters = True
    max_k = MAX_LIMIT
    segments: tuple = ()  # no local vector files

    def __init__(self, client: Any, record: Mapping[str, Any], dim: int, metric: str, index_type: str,
                 options: Mapping[str, Any], docs: DocStore, generation: int, *, writer: bool = False) -> None:
        self.client, self.record = client, dict(record)
        self.collection = record["collection"]
        self.dim, self.metric, self.factory = dim, metric, index_type
        self.options = dict(options)
        self.docs, self.generation, self.writer = docs, generation, writer
        self._pending: VectorIndex | None = None  # staged vectors (in memory until prepare_commit)
        self._meta: dict[str, dict[str, Any]] = {}  # staged metadata by id
        self._stale_staged = 0  # committed rows hidden by staged replaces / deletes
        self._flushed = False  # staged vectors were written to Milvus (as gen g+1) before the commit

    # ------------------------------------------------------------------ configuration
    is_trained = True

    @property
    def kind(self) -> str:
        """The kind of index its search options tune, as FAISS's are named (`twotower.indexing.factory.index_kind`)."""
        return {"HNSW": "hnsw", "IVF_FLAT": "ivf"}.get(self.factory, "flat")

    def train_sample_size(self, n: int) -> int:
        return 0

    def train(self, vectors: np.ndarray) -> None:
        """Nothing to train: Milvus builds its index itself."""

    def __getattr__(self, name: str) -> Any:  # ef_search, nprobe, ... as stored
        if name in ("ef_search", "ef_construction", "nprobe", "train_sample", "seed", "auto_rebuild_fraction"):
            return self.__dict__["options"].get(name)
        raise AttributeError(name)

    # ------------------------------------------------------------------ membership
    def _keys(self, ids: Sequence[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in range(0, len(ids), 500):
            chunk = list(ids[s:s + 500])
            marks = ",".join("?" * len(chunk))
            out.update(self.docs.query(f"SELECT id, generation FROM vector_keys WHERE id IN ({marks})", chunk))
        return out

    def _garbage(self, keys: Sequence[str]) -> set[str]:
        """Those of the version `keys` listed in the garbage table (rows in Milvus to be deleted)."""
        out: set[str] = set()
        for s in range(0, len(keys), 500):
            chunk = list(keys[s:s + 500])
            marks = ",".join("?" * len(chunk))
            out.update(r[0] for r in self.docs.query(f"SELECT key FROM vector_garbage WHERE key IN ({marks})", chunk))
        return out

    def __len__(self) -> int:
        return int(self.docs.query("SELECT COUNT(*) FROM vector_keys")[0][0])

    def __contains__(self, doc_id: object) -> bool:
        return isinstance(doc_id, str) and bool(self._keys([doc_id]))

    def contains_many(self, ids: Iterable[str]) -> list[bool]:
        ids = list(ids)
        keys = self._keys(ids)
        return [i in keys for i in ids]

    def ids(self) -> list[str]:
        return [r[0] for r in self.docs.query("SELECT id FROM vector_keys ORDER BY rowid")]

    @property
    def tombstone_count(self) -> int:
        """Superseded or deleted rows still in the collection (deleted after ``RETAIN_SECONDS``)."""
        return int(self.docs.query("SELECT COUNT(*) FROM vector_garbage")[0][0])

    @property
    def stored_count(self) -> int:
        return len(self) + self.tombstone_count

    @property
    def has_changes(self) -> bool:
        return self._pending is not None and self._pending.stored_count > 0 or self._stale_staged > 0 \
            or self._flushed

    # ------------------------------------------------------------------ staging
    def _digest_update(self, add: Sequence[str] = (), drop: Sequence[str] = ()) -> None:
        now = int(self.docs.get_meta("milvus_ids_digest") or "0", 16)
        self.docs.set_meta("milvus_ids_digest", hex64(combine(now, set_digest(add), minus=[set_digest(drop)])))

    def add(self, ids: Sequence[str], vectors: np.ndarray, *, on_duplicate: str = "error",
            metadata: Sequence[Mapping[str, Any]] | None = None) -> int:
        """Stage vectors (N, D) under ids (with each one's metadata, for filters); duplicates follow ``on_duplicate``."""
        if on_duplicate not in ("error", "skip", "replace"):
            raise ValueError(f"on_duplicate must be 'error', 'skip' or 'replace', got {on_duplicate!r}")
        ids = list(ids)
        vectors = np.asarray(vectors)
        metadata = list(metadata) if metadata is not None else [{} for _ in ids]
        long = [i for i in ids if len(i.encode("utf-8")) > ID_MAX_LENGTH - 24]
        if long:
            raise ValueError(f"add: id {long[0][:40]!r}... is longer than the Milvus backend allows "
                             f"({ID_MAX_LENGTH - 24} bytes)")
        keys = self._keys(ids)
        if keys and on_duplicate == "error":
            present = [i for i in ids if i in keys]
            raise ValueError(f"add: {len(present)} id(s) already in the index, e.g. {present[:5]}; "
                             "pass on_duplicate='skip' or 'replace'")
        if keys and on_duplicate == "skip":
            keep = [j for j, i in enumerate(ids) if i not in keys]
            ids, vectors, metadata = [ids[j] for j in keep], vectors[keep], [metadata[j] for j in keep]
        if not ids:
            return 0
        new = self.generation + 1
        if self._pending is None:
            self._pending = VectorIndex(self.dim, "Flat", self.metric)  # type: ignore[arg-type]
        pending = self._pending
        # a staged id already written to Milvus (a flushed batch) is rewritten there, under the same key; so is one
        # whose flushed row a delete of this transaction retired (its key is in the garbage): staged in memory
        # instead, the flushed row stayed beside it (the writer's searches found the id twice) and a second delete
        # dropped only the staged copy, leaving a row in Milvus that no table names
        flushed = self._garbage([f"{new}:{i}" for i in ids if i not in keys])
        direct = [j for j, i in enumerate(ids)
                  if (keys.get(i) == new or f"{new}:{i}" in flushed) and i not in pending]
        if direct:
            self._upsert([ids[j] for j in direct], vectors[direct], [metadata[j] for j in direct], new)
        rest = sorted(set(range(len(ids))) - set(direct))
        if rest:
            pending.add([ids[j] for j in rest], vectors[rest],
                        on_duplicate="replace" if on_duplicate == "replace" else "error")
        n = len(ids)
        kept = set(ids)
        retired = [(f"{g}:{i}", new) for i, g in keys.items() if g <= self.generation and i in kept]
        with self.docs.transaction():
            self.docs.write("INSERT INTO vector_keys (id, generation) VALUES (?, ?) ON CONFLICT(id) DO UPDATE "
                            "SET generation=excluded.generation", [(i, new) for i in ids])
            self.docs.write("INSERT OR IGNORE INTO vector_garbage (key, generation, retired) VALUES (?, ?, NULL)",
                            retired)
            # the rows written now are live again under keys a delete of this transaction may have retired (a
            # staged row already flushed, deleted, then added again): deleting them after the commit lost them
            self.docs.write("DELETE FROM vector_garbage WHERE key = ?", [(f"{new}:{i}",) for i in ids])
            self._digest_update(add=[i for i in ids if i not in keys])
        self._stale_staged += len(retired)
        for j in rest:
            self._meta[ids[j]] = dict(metadata[j])
        if len(pending) >= FLUSH_ROWS:
            self._flush()
        return n

    def _upsert(self, ids: Sequence[str], vectors: np.ndarray, metadata: Sequence[Mapping[str, Any]],
                gen: int) -> None:
        if not self._flushed:  # rows of an earlier, failed attempt at this generation go first
            self.client.delete(self.collection, filter=f"gen > {self.generation}")
            self._flushed = True
        for s in range(0, len(ids), INSERT_BATCH):
            self.client.upsert(self.collection, [
                {"pk": f"{gen}:{i}", "doc_id": i, "gen": gen, "vector": v.tolist(), "metadata": m}
                for i, v, m in zip(ids[s:s + INSERT_BATCH], vectors[s:s + INSERT_BATCH],
                                   metadata[s:s + INSERT_BATCH])])

    def _flush(self) -> None:
        """Write the staged vectors to Milvus under the next generation's keys: invisible to readers until the
        commit point (``gen > g``), deleted if the commit never happens. Bounds the writer's memory."""
        p = self._pending
        if p is None or not len(p):
            return
        ids = p.ids()
        for s in range(0, len(ids), INSERT_BATCH):
            chunk = ids[s:s + INSERT_BATCH]
            self._upsert(chunk, p.reconstruct(chunk), [self._meta.pop(i, {}) for i in chunk], self.generation + 1)
        self._pending = None

    def remove(self, ids: Iterable[str]) -> list[str]:
        """Stage deletions; returns the ids that were not present (in input order)."""
        ids = list(dict.fromkeys(ids))
        keys = self._keys(ids)
        missing = [i for i in ids if i not in keys]
        staged = [i for i in ids if self._pending is not None and i in self._pending]
        if staged:
            self._pending.remove(staged)
        new = self.generation + 1
        # committed rows, and staged rows already flushed to Milvus, are deleted from it after the commit
        retired = [(f"{g}:{i}", new) for i, g in keys.items() if g <= self.generation or i not in staged]
        with self.docs.transaction():
            self.docs.write("DELETE FROM vector_keys WHERE id = ?", [(i,) for i in keys])
            self.docs.write("INSERT OR IGNORE INTO vector_garbage (key, generation, retired) VALUES (?, ?, NULL)",
                            retired)
            self._digest_update(drop=list(keys))
        self._stale_staged += len(retired)
        for i in staged:
            self._meta.pop(i, None)
        return missing

    # ------------------------------------------------------------------ reading
    def reconstruct(self, ids: Sequence[str]) -> np.ndarray:
        """Stored vectors (N, D) of ``ids`` (as Milvus holds them); KeyError if absent."""
        keys = self._keys(list(ids))
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        for j, i in enumerate(ids):
            if i not in keys:
                raise KeyError(f"reconstruct: id {i!r} is not in the index")
            if self._pending is not None and i in self._pending:
                out[j] = self._pending.reconstruct([i])[0]
                continue
            rows = self.client.query(self.collection, filter=f"pk == {json.dumps(f'{keys[i]}:{i}')}",
                                     output_fields=["vector"], consistency_level="Strong")
            if not rows:
                raise IndexFormatError(self.collection, f"the vector of id {i!r} is missing from the collection")
            out[j] = np.asarray(rows[0]["vector"], dtype=np.float32)
        return out

    def _search_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        ef = params.get("ef_search") or self.options.get("ef_search")
        nprobe = params.get("nprobe") or self.options.get("nprobe")
        inner: dict[str, Any] = {}
        if self.factory == "HNSW":
            inner["ef"] = int(ef or 128)
        elif self.factory == "IVF_FLAT":
            inner["nprobe"] = int(nprobe or 32)
        return {"params": inner}

    def search(self, queries: np.ndarray, k: int = 10, *, filter: Any = None,
               allowed: Collection[str] | None = None, **params: Any) -> SearchResult:
        """Top-k live vectors of this generation (staged additions included for the writer).

        ``filter``: a ``Filter`` (``twotower.indexing.filters``), evaluated by Milvus on the rows'
        metadata; ``allowed``: ids the hits must be among. Both may be given.
        """
        q = np.asarray(queries, dtype=np.float32)
        single = q.ndim == 1
        k = check_k(k)
        if q.ndim not in (1, 2) or q.shape[-1] != self.dim:
            raise ValueError(f"queries have shape {q.shape}; this index holds vectors of dimension {self.dim}")
        q = q.reshape(-1, self.dim)  # (Q, D)
        k = int(k)
        if k > MAX_LIMIT:
            raise ValueError(f"search: k={k} exceeds the {MAX_LIMIT} hits Milvus returns for one search")
        base = f"gen <= {self.generation + (1 if self._flushed else 0)}"  # the writer sees its flushed rows
        if allowed is not None:
            allowed = set(allowed)
            base += f" and doc_id in {json.dumps(sorted(allowed))}"
        native = None if filter is None else filter.to_milvus("metadata")
        try:
            if (self.record["uri"], native) in _REJECTED:
                raise _Rejected(native)
            hits = self._milvus_top(q, k, base if native is None else f"{base} and ({native})", params)
        except Exception as e:  # noqa: BLE001 - only a filter this Milvus cannot evaluate is retried
            if native is None or not isinstance(e, _Rejected) and "MilvusException" not in type(e).__name__:
                raise
            # e.g. Milvus Lite has no `in` on JSON paths: the same rows, resolved from the documents instead
            if (self.record["uri"], native) not in _REJECTED:
                logger.info("Milvus rejected the filter expression (%s); filtering by the documents' ids", e)
                _REJECTED.add((self.record["uri"], native))
            where, args = filter.to_sql("metadata")
            ids = sorted(r[0] for r in self.docs.query(f"SELECT id FROM docs WHERE {where}", args))
            hits = self._milvus_top(q, k, f"{base} and doc_id in {json.dumps(ids)}", params)
        pending = self._pending_top(q, k, filter, allowed)
        ids_out: list[list[str]] = []
        scores = np.full((len(q), k), MISSING_SCORE, dtype=np.float32)
        for j in range(len(q)):
            merged = sorted(hits[j] + pending[j], key=lambda h: -h[1])[:k]
            ids_out.append([i for i, _ in merged] + [MISSING_ID] * (k - len(merged)))
            scores[j, :len(merged)] = [s for _, s in merged]
        if single:
            return SearchResult(ids=ids_out[:1], scores=scores[:1])
        return SearchResult(ids=ids_out, scores=scores)

    def _score(self, distance: float) -> float:
        return 0.0 - float(distance) if self.metric == "l2" else float(distance)

    def _milvus_top(self, q: np.ndarray, k: int, expr: str, params: Mapping[str, Any]) -> list[list[tuple[str, float]]]:
        """Each query's k best live hits from Milvus: over-fetch, drop stale keys, go deeper while needed."""
        stale = self.tombstone_count  # rows of this snapshot's garbage table (later commits': found by going deeper)
        limit = min(MAX_LIMIT, k + stale + max(8, k // 4))
        out: list[list[tuple[str, float]] | None] = [None] * len(q)
        todo = list(range(len(q)))
        while todo:
            res = self.client.search(self.collection, data=q[todo].tolist(), limit=limit, filter=expr,
                                     output_fields=["doc_id", "gen"], search_params=self._search_params(params),
                                     consistency_level="Strong")
            raw = [[(h["entity"]["doc_id"], int(h["entity"]["gen"]), self._score(h["distance"])) for h in row]
                   for row in res]
            current = self._keys(list({i for row in raw for i, _g, _s in row}))
            again = []
            for j, row in zip(todo, raw):
                live = [(i, s) for i, g, s in row if current.get(i) == g]
                if len(live) < k and len(row) == limit and limit < MAX_LIMIT:
                    again.append(j)  # stale rows took places and Milvus has more: ask deeper
                out[j] = live[:k]
            todo, limit = again, min(MAX_LIMIT, limit * 4)
        return out  # type: ignore[return-value]

    def _pending_top(self, q: np.ndarray, k: int, flt: Any, allowed: Collection[str] | None
                     ) -> list[list[tuple[str, float]]]:
        """Hits among the staged (uncommitted) vectors: the writer sees its own changes."""
        p = self._pending
        if p is None or not len(p):
            return [[] for _ in range(len(q))]
        ok = [i for i in p.ids() if (allowed is None or i in allowed)
              and (flt is None or flt.matches(self._meta.get(i, {})))]
        if not ok:
            return [[] for _ in range(len(q))]
        res = p.search(q, len(p))
        keep = set(ok)
        return [[(i, float(s)) for i, s in zip(row, srow) if i in keep][:k]
                for row, srow in zip(res.ids, res.scores.tolist())]

    # ------------------------------------------------------------------ commit
    def digest(self) -> int:
        """Digest of the live ids (the keys table, staged changes included), kept current at every change."""
        return int(self.docs.get_meta("milvus_ids_digest") or "0", 16)

    def digest_now(self) -> int:
        """The same, recomputed from every key (``twotower index check``)."""
        return set_digest(r[0] for r in self.docs.query("SELECT id FROM vector_keys"))

    def prepare_commit(self, directory: Path, seq: int, written: list[Path],
                       checkpoint: Callable[[str], None] = lambda stage: None) -> CommitPlan:
        """Before the commit point: drop rows of an interrupted attempt, upsert the staged vectors as ``g+1:<id>``."""
        checkpoint("before_vectors")
        if not self._flushed:  # nothing written yet in this attempt: rows of a failed earlier attempt go first
            self.client.delete(self.collection, filter=f"gen > {self.generation}")
            self._flushed = True
        self._flush()
        # Seal the rows of this commit before the commit point: persisted by Milvus, and searched through the
        # collection's index rather than as growing (unindexed) rows.
        self.client.flush(self.collection)
        checkpoint("milvus_written")
        self.docs.write("UPDATE vector_garbage SET retired = ? WHERE retired IS NULL", [(time.time(),)])
        return CommitPlan(segments=[], added=[], dropped=[], tombstones=[], next_seq=seq)

    def apply(self, segments: Any) -> None:
        """After the commit point: the committed state is generation g+1; old garbage is deleted."""
        self.generation += 1
        self._pending, self._meta, self._stale_staged, self._flushed = None, {}, 0, False
        try:
            self.collect(grace=True)
        except Exception as e:  # noqa: BLE001 - the commit stands; the garbage table keeps the keys for later
            logger.warning("Milvus collection %s: could not delete superseded rows yet (%s); retried later",
                           self.collection, e)

    def collect(self, grace: bool = True) -> int:
        """Delete superseded rows retired more than ``RETAIN_SECONDS`` ago (all of them without `grace`)."""
        if self.docs.in_transaction:
            return 0  # staged changes in the writer's transaction: collect after the next commit
        cutoff = time.time() - (RETAIN_SECONDS if grace else -1.0)
        keys = [r[0] for r in self.docs.query(
            "SELECT key FROM vector_garbage WHERE retired IS NOT NULL AND retired < ?", (cutoff,))]
        for s in range(0, len(keys), INSERT_BATCH):
            chunk = keys[s:s + INSERT_BATCH]
            self.client.delete(self.collection, ids=chunk)
            self.docs.write("DELETE FROM vector_garbage WHERE key = ?", [(key,) for key in chunk])
        return len(keys)

    def repair(self) -> None:
        """Writer open: delete rows of an interrupted commit (``gen > g``) and check every current key is there."""
        orphans = row_count(self.client, self.collection, f"gen > {self.generation}")
        if orphans:
            logger.warning("Milvus collection %s: deleting %d vectors of a commit that did not complete",
                           self.collection, orphans)
            self.client.delete(self.collection, filter=f"gen > {self.generation}")
        self.collect(grace=True)
        missing = self.missing_keys(limit=5)
        if missing:
            raise IndexFormatError(self.collection, f"Milvus collection {self.collection!r} at {self.record['uri']} "
                                                    f"lacks the vectors of {missing[0]} live document(s), e.g. "
                                                    f"{missing[1]}; run `twotower index check`")

    def missing_keys(self, limit: int | None = None) -> tuple[int, list[str]] | None:
        """(count, example ids) of current keys the collection lacks, or None when it holds them all.

        Cheap when all is well (one count); it lists keys only when the count says something is missing.
        """
        n_keys = len(self)
        garbage = [r[0] for r in self.docs.query("SELECT key FROM vector_garbage")]
        present_garbage = 0
        for s in range(0, len(garbage), 1000):
            present_garbage += len(self.client.query(self.collection, filter=f"pk in {json.dumps(garbage[s:s + 1000])}",
                                                     output_fields=["pk"], consistency_level="Strong"))
        in_milvus = row_count(self.client, self.collection, f"gen <= {self.generation}")
        if in_milvus - present_garbage >= n_keys:
            return None
        have: set[str] = set()
        it = self.client.query_iterator(self.collection, batch_size=5000, filter=f"gen <= {self.generation}",
                                        output_fields=["pk"])
        try:
            while batch := it.next():
                have.update(r["pk"] for r in batch)
        finally:
            it.close()
        lost = [i for i, g in self.docs.query("SELECT id, generation FROM vector_keys") if f"{g}:{i}" not in have]
        if not lost:
            return None
        return len(lost), lost[:limit] if limit else lost

    def close(self) -> None:
        """Writer close: delete the superseded rows no reader can still need.

        All of them when this writer is the only store of the process on a Milvus Lite file (no other process can
        open it); otherwise only those past ``RETAIN_SECONDS``. Why: `twotower serve` searches through a store of
        its own on the same client, still on the commit before until it moves to the new one, and its searches
        answered 0 hits for the documents a write had just replaced or deleted when their rows went at close.
        The rest are deleted by a later writer (its commit, or its open).
        """
        uri = self.record["uri"]
        with _clients_lock:
            alone = is_local(uri) and _holders.get(uri, 0) <= 1
        try:
            self.collect(grace=not alone)
        except Exception as e:  # noqa: BLE001 - kept in the garbage table for the next writer
            logger.warning("Milvus collection %s: superseded rows not deleted (%s)", self.collection, e)

    def __repr__(self) -> str:
        return (f"MilvusVectors({self.record['uri']!r}, collection={self.collection!r}, dim={self.dim}, "
                f"metric={self.metric!r}, index={self.factory}, generation={self.generation})")
