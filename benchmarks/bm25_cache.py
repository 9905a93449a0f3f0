"""What a reader pays for BM25 when an index has no cache for its generation: rebuilt from the documents vs
the cache loaded.

    .venv/bin/python benchmarks/bm25_cache.py --data ../shared/data/gutenberg-en-mlm [--passages 50000]

Why: until writes kept the cache (`IndexStore.add` / `delete` update it and the commit saves it), every
process that searched an index with BM25 after an `index add` rebuilt it from all documents. The passages
are consecutive 150-word pieces of the Gutenberg training text; the rebuild here is `BM25.add` alone (a
reader also reads the documents from SQLite first, so this understates its cost).
"""

from __future__ import annotations

import argparse
import gzip
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from twotower.indexing import BM25


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="../shared/data/gutenberg-en-mlm", help="folder holding train.txt.gz")
    ap.add_argument("--passages", type=int, default=50_000)
    ap.add_argument("--words", type=int, default=150, help="words per passage")
    args = ap.parse_args()
    need, words = args.passages * args.words, []
    with gzip.open(os.path.join(args.data, "train.txt.gz"), "rt", encoding="utf-8") as f:
        for line in f:
            words.extend(line.split())
            if len(words) >= need:
                break
    docs = [" ".join(words[i * args.words:(i + 1) * args.words]) for i in range(len(words) // args.words)]
    ids = [f"p{i}" for i in range(len(docs))]
    start = time.perf_counter()
    bm = BM25()
    bm.add(ids, docs)
    rebuild = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bm25.npz")
        bm.save(path)
        start = time.perf_counter()
        BM25.load(path)
        load = time.perf_counter() - start
        size = os.path.getsize(path)
    print(f"{len(docs):,} passages of {args.words} words ({platform.processor() or platform.machine()}): "
          f"rebuild {rebuild:.2f} s, load the cache {load:.2f} s ({rebuild / load:.0f}x); cache {size / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
