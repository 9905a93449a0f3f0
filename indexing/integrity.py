"""Checksums and id digests that let an index directory prove its files are the ones it committed.

Two kinds of evidence, chosen for what they cost:

* ``set_digest`` — an *order-independent, incremental* digest of a set of strings: the sum
  modulo 2^64 of each string's 8-byte BLAKE2b. Adding or removing a member updates it in
  O(1), so the document store keeps the digest of its ids (and of its rows) current at every
  write without rescanning, and a vector segment records the digest of its ids. Opening an
  index recomputes the digests of the ids actually present (~0.1 s per 200k ids) and compares:
  a renamed id, a row swapped for another with the same count, or a tombstone table that
  disagrees with the documents all change a digest. It guards against accidents and careless
  tools, not against someone who rewrites the digests too (that is what ``sha256`` of the
  files, recorded at commit time and checked by ``twotower index check``, is for — and even
  those can be recomputed by a determined adversary with write access).
* ``file_sha256`` — of each committed file, recorded when the file is written.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

_MASK = (1 << 64) - 1


def _h(value: str) -> int:
    return int.from_bytes(hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def set_digest(values: Iterable[str]) -> int:
    """Order-independent digest of a set of strings (sum of 64-bit BLAKE2b hashes mod 2^64)."""
    return sum(map(_h, values)) & _MASK


def combine(*digests: int, minus: Iterable[int] = ()) -> int:
    """The digest of a union of disjoint sets (sum) minus removed subsets."""
    return (sum(digests) - sum(minus)) & _MASK


def row_key(doc: Mapping[str, Any]) -> str:
    """The string a document row contributes to the content digest (id, title, text, metadata;
    a passage row's parent and span too)."""
    meta = doc["metadata"] if isinstance(doc["metadata"], str) else json.dumps(
        doc["metadata"], ensure_ascii=False, sort_keys=True, allow_nan=False)
    fields = [doc["id"], doc["title"], doc["text"], meta]
    if doc.get("parent") is not None:
        fields += [doc["parent"], doc["start"], doc["end"]]
    return json.dumps(fields, ensure_ascii=False)


def hex64(digest: int) -> str:
    return f"{digest:016x}"


def file_sha256(path: str | os.PathLike, block: int = 1 << 20) -> str:
    """SHA-256 of a file's bytes, read in `block`-sized pieces (memory stays bounded)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()
