"""The single-file format of a saved ``VectorIndex``.

Layout: a plain FAISS index file followed by a trailer
``[JSON state][u64 little-endian length of the JSON][8-byte magic]``. FAISS stops
reading at the end of its own data, so ``faiss.read_index(path)`` (and memory mapping
with ``IO_FLAG_MMAP_IFC``) works on the file unchanged, while one file means one atomic
rename per save. The JSON holds the configuration and the id map.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import faiss

from twotower.common.atomic import atomic_path
from twotower.indexing.errors import IndexFormatError

TRAILER_MAGIC = b"TTVECIX1"
FORMAT_NAME = "twotower-vector-index"
FORMAT_VERSION = 1
REQUIRED_FIELDS = ("dim", "metric", "factory", "ids_by_label", "tombstones")


def write_vector_file(path: str | Path, index: faiss.Index, state: dict[str, Any]) -> None:
    """Atomically write ``index`` plus ``state`` (format fields are added here)."""
    full = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **state}
    header = json.dumps(full, ensure_ascii=False).encode("utf-8")

    def _write(tmp: Path) -> None:
        faiss.write_index(index, str(tmp))
        with open(tmp, "ab") as f:
            f.write(header)
            f.write(struct.pack("<Q", len(header)))
            f.write(TRAILER_MAGIC)

    with atomic_path(path) as tmp:
        _write(Path(tmp))


def read_state(path: str | Path) -> dict[str, Any]:
    """The JSON trailer of a vector file (``IndexFormatError`` naming the file if absent/corrupt)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: vector index file not found")
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 16:
            raise IndexFormatError(path, "file too short to be a twotower vector index")
        f.seek(size - 16)
        (length,) = struct.unpack("<Q", f.read(8))
        if f.read(8) != TRAILER_MAGIC:
            raise IndexFormatError(path, "not a twotower vector index (trailer magic missing)")
        if length > size - 16:
            raise IndexFormatError(path, f"trailer length {length} exceeds the file size")
        f.seek(size - 16 - length)
        try:
            state = json.loads(f.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise IndexFormatError(path, f"corrupt trailer JSON: {e}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_NAME:
        raise IndexFormatError(path, f"trailer format is not {FORMAT_NAME!r}")
    version = state.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise IndexFormatError(
            path, f"format_version {version!r} is not supported (this code reads up to {FORMAT_VERSION})"
        )
    for key in REQUIRED_FIELDS:
        if key not in state:
            raise IndexFormatError(path, f"trailer lacks field {key!r}")
    return state


def read_vector_file(path: str | Path, *, mmap: bool) -> tuple[faiss.Index, dict[str, Any]]:
    """Read the FAISS index (memory-mapped when ``mmap``) and its trailer state."""
    state = read_state(path)
    try:
        index = faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC if mmap else 0)
    except RuntimeError as e:
        msg = str(e).strip().splitlines()[-1]
        raise IndexFormatError(path, f"FAISS cannot read the index: {msg}") from None
    return index, state
