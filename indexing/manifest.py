"""``manifest.json``: the human-readable description of an index directory.

It says what the directory holds (format version, vector dimension, metric, FAISS
factory or Milvus index type, BM25 settings, counts, and where the vectors live: ``backend``
``faiss`` — segment files in the directory — or ``milvus`` with the ``milvus`` object naming the
URI and collection) and carries a free-form ``extra`` object the pipeline
fills (encoder fingerprint, pooling, max length…). It is *descriptive*: the commit
point of the directory is the ``generation`` in ``docs.sqlite``; ``counts`` and
``generation`` here are refreshed after each commit (and repaired by ``IndexStore.open``
if a crash came between the two).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from twotower.common.atomic import atomic_write_json
from twotower.indexing.errors import IndexFormatError

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "twotower-index"
FORMAT_VERSION = 1
_METRICS = ("cosine", "ip", "l2")


@dataclass
class Manifest:
    """Contents of ``manifest.json`` (see module docstring)."""

    dim: int
    metric: str
    factory: str
    bm25: dict[str, Any] | None = None  # BM25 constructor arguments, or None when disabled
    counts: dict[str, int] = field(default_factory=lambda: {"documents": 0, "vectors": 0, "tombstones": 0})
    generation: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    backend: str = "faiss"  # where the vectors live: "faiss" (segment files here) or "milvus"
    milvus: dict[str, Any] | None = None  # backend "milvus": {uri, collection, fingerprint, index_id}
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def write(self, path: str | Path) -> None:
        """Atomically write to ``path`` (normally ``<dir>/manifest.json``)."""
        atomic_write_json(path, asdict(self))

    @classmethod
    def read(cls, path: str | Path) -> Manifest:
        """Read and validate; raises ``IndexFormatError`` naming the file on any problem."""
        path = Path(path)
        if not path.is_file():
            raise IndexFormatError(path, "manifest not found: not a twotower index directory")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise IndexFormatError(path, f"corrupt manifest JSON: {e}") from None
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: Any, path: str | Path = MANIFEST_NAME) -> Manifest:
        if not isinstance(data, dict):
            raise IndexFormatError(path, "manifest must be a JSON object")
        if data.get("format") != FORMAT_NAME:
            raise IndexFormatError(
                path, f"field 'format' must be {FORMAT_NAME!r}, got {data.get('format')!r}"
            )
        version = data.get("format_version")
        if not isinstance(version, int) or version < 1:
            raise IndexFormatError(path, f"field 'format_version' must be a positive int, got {version!r}")
        if version > FORMAT_VERSION:
            raise IndexFormatError(
                path,
                f"format_version {version} is newer than this code supports ({FORMAT_VERSION}); upgrade twotower",
            )
        checks = {
            "dim": lambda v: isinstance(v, int) and v > 0,
            "metric": lambda v: v in _METRICS,
            "factory": lambda v: isinstance(v, str) and bool(v),
            "bm25": lambda v: v is None or isinstance(v, dict),
            "counts": lambda v: isinstance(v, dict) and all(isinstance(x, int) for x in v.values()),
            "generation": lambda v: isinstance(v, int) and v >= 0,
            "extra": lambda v: isinstance(v, dict),
        }
        for key, ok in checks.items():
            if key not in data:
                raise IndexFormatError(path, f"manifest lacks field {key!r}")
            if not ok(data[key]):
                raise IndexFormatError(path, f"manifest field {key!r} has an invalid value {data[key]!r}")
        known = {k: data[k] for k in (*checks, "format", "format_version")}
        backend = data.get("backend", "faiss")  # absent in directories written before the Milvus backend
        if backend not in ("faiss", "milvus"):
            raise IndexFormatError(path, f"manifest field 'backend' must be 'faiss' or 'milvus', got {backend!r}")
        milvus = data.get("milvus")
        if backend == "milvus" and not (isinstance(milvus, dict) and all(
                isinstance(milvus.get(key), str) and milvus.get(key) for key in ("uri", "collection", "index_id"))):
            raise IndexFormatError(path, "manifest field 'milvus' must be an object with non-empty 'uri', "
                                         f"'collection' and 'index_id' strings, got {milvus!r}")
        return cls(**known, backend=backend, milvus=milvus if backend == "milvus" else None)
