"""Incremental commits: wall time and bytes written to add 100 documents to a large index.

For each corpus size (default 20k and 200k) and factory (Flat, HNSW32) the script builds an
``indexing.IndexStore`` of ``size - adds*batch`` documents in one commit, then adds ``adds``
batches of ``batch`` documents, one ``add`` + ``commit`` each, and reports per add:

* wall seconds of ``add`` + ``commit``;
* bytes written, from ``/proc/self/io`` ``wchar`` (every byte this process handed to
  ``write``: the vector files, SQLite and its WAL, the manifest) — so the figure does not
  depend on how the store lays its files out;

then times a read-only open (with its checks) and compares its search results (200 queries, k=10)
with a fresh ``VectorIndex.build`` of the same vectors in the same order: for Flat the ids
must be identical rank by rank (ties — equal scores — may swap within their group) and the
scores equal to float rounding; for HNSW the two graphs differ (built in a different order
of batches), so the script reports recall@10 of each against exact search instead.

Vectors: real all-MiniLM-L6-v2 embeddings of Gutenberg sentences, from the cache of
``benchmarks/ann_recall.py encode`` (``--cache``). Sizes beyond what is cached are made by
*tiling* the real vectors with Gaussian noise (sigma ``--noise``, then re-normalised): the
copies are near the originals, as paraphrases would be, but they are not real embeddings —
the results page says which sizes were tiled.

    .venv/bin/python benchmarks/ann_recall.py encode --n 20000 --queries 200 --cache runs/idxbench/ann
    .venv/bin/python benchmarks/incremental_commit.py --cache runs/idxbench/ann
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.ann_recall import recall_against  # noqa: E402  (one definition for the index benchmarks)


def wchar() -> int:
    """Bytes this process has passed to write() so far (Linux /proc/self/io)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def load_vectors(cache: str, n: int, noise: float, seed: int = 0) -> tuple[np.ndarray, int]:
    """(n, D) float32 vectors: the cached real ones first, then noisy copies; returns (vectors, real count)."""
    chunks = sorted(os.listdir(os.path.join(cache, "chunks")))
    real = np.concatenate([np.load(os.path.join(cache, "chunks", c)) for c in chunks]).astype(np.float32)
    if n <= len(real):
        return real[:n], n
    rng = np.random.default_rng(seed)
    parts, have = [real], len(real)
    while have < n:
        take = min(len(real), n - have)
        copy = real[:take] + noise * rng.standard_normal((take, real.shape[1]), dtype=np.float32)
        copy /= np.linalg.norm(copy, axis=1, keepdims=True)
        parts.append(copy)
        have += take
    return np.concatenate(parts), len(real)


def docs(lo: int, hi: int) -> list[dict]:
    return [{"id": f"d{i}", "text": f"document {i}"} for i in range(lo, hi)]


def compare(got_ids: list[list[str]], got_scores: np.ndarray, ref_ids: list[list[str]], ref_scores: np.ndarray,
            tol: float = 1e-5) -> tuple[int, float]:
    """Queries whose ranked ids agree with the reference (up to swaps inside groups of tied scores), max |score diff|."""
    same = 0
    for gi, gs, ri, rs in zip(got_ids, got_scores, ref_ids, ref_scores):
        ok = np.allclose(gs, rs, atol=tol)
        if ok and gi != ri:  # allow swaps among equal scores only
            groups: dict[float, tuple[set, set]] = {}
            for a, b, s in zip(gi, ri, np.round(rs / tol)):
                groups.setdefault(float(s), (set(), set()))
                groups[float(s)][0].add(a)
                groups[float(s)][1].add(b)
            ok = all(x == y for x, y in groups.values())
        same += ok
    return same, float(np.max(np.abs(np.asarray(got_scores) - np.asarray(ref_scores))))



def run_one(vecs: np.ndarray, queries: np.ndarray, factory: str, args: argparse.Namespace) -> dict:
    from twotower.indexing import IndexStore, VectorIndex

    n = len(vecs)
    base = n - args.adds * args.batch
    directory = os.path.join(args.work, f"{factory}-{n}")
    shutil.rmtree(directory, ignore_errors=True)
    t = time.perf_counter()
    store = IndexStore.create(directory, vecs.shape[1], factory, "cosine")
    for s in range(0, base, 20000):
        e = min(base, s + 20000)
        store.add(docs(s, e), vecs[s:e])
    store.commit()
    store.close()
    build_s = time.perf_counter() - t
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    adds = []
    store = IndexStore.open(directory)
    for r in range(args.adds):
        lo = base + r * args.batch
        w0, t0 = wchar(), time.perf_counter()
        store.add(docs(lo, lo + args.batch), vecs[lo:lo + args.batch])
        store.commit()
        adds.append({"seconds": time.perf_counter() - t0, "bytes_written": wchar() - w0})
        print(f"  {factory} n={n}: add {r}: {adds[-1]['seconds']:.3f}s, {adds[-1]['bytes_written']:,} bytes",
              flush=True)
    store.close()
    out = {"factory": factory, "n": n, "base_build_seconds": build_s, "index_bytes_before_adds": size,
           "adds": adds, "median_seconds": float(np.median([a["seconds"] for a in adds])),
           "median_bytes_written": int(np.median([a["bytes_written"] for a in adds])),
           "mean_bytes_written": float(np.mean([a["bytes_written"] for a in adds])),
           "max_bytes_written": int(max(a["bytes_written"] for a in adds))}
    t = time.perf_counter()
    IndexStore.open(directory, readonly=True).close()
    out["reader_open_seconds"] = time.perf_counter() - t
    if args.no_compare:
        shutil.rmtree(directory, ignore_errors=True)
        return out
    with IndexStore.open(directory, readonly=True) as ro:
        got = ro.search(queries, args.k)
    fresh = VectorIndex.build([f"d{i}" for i in range(n)], vecs, factory=factory, metric="cosine")
    ref = fresh.search(queries, args.k)
    if factory == "Flat":
        same, diff = compare(got.ids, got.scores, ref.ids, ref.scores)
        out.update(identical_queries=same, queries=len(queries), max_score_diff=diff)
    else:
        exact = VectorIndex.build([f"d{i}" for i in range(n)], vecs, factory="Flat", metric="cosine")
        ex = exact.search(queries, args.k).ids
        out.update(recall_incremental=recall_against(got.ids, ex), recall_fresh=recall_against(ref.ids, ex), queries=len(queries))
    del fresh
    shutil.rmtree(directory, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default=os.path.join(REPO, "runs", "idxbench", "ann"))
    p.add_argument("--work", default=os.path.join(REPO, "runs", "idxbench", "work"))
    p.add_argument("--sizes", default="20000,200000")
    p.add_argument("--factories", default="Flat,HNSW32")
    p.add_argument("--adds", type=int, default=20, help="add+commit rounds measured per index")
    p.add_argument("--batch", type=int, default=100, help="documents per add")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--noise", type=float, default=0.05, help="sigma of the noise on tiled copies")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-compare", action="store_true", help="skip the comparison with a fresh build")
    p.add_argument("--label", default="", help="a name for this run in the JSON (e.g. before / after)")
    p.add_argument("--json", default=None, help="append the results as one JSON line to this file")
    args = p.parse_args()
    import faiss

    faiss.omp_set_num_threads(args.threads)
    os.makedirs(args.work, exist_ok=True)
    queries = np.load(os.path.join(args.cache, "queries.npy")).astype(np.float32)
    results = []
    for n in [int(s) for s in args.sizes.split(",")]:
        vecs, real = load_vectors(args.cache, n, args.noise)
        for factory in args.factories.split(","):
            r = run_one(vecs, queries, factory, args)
            r["real_vectors"] = real
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "adds"}), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"label": args.label, "results": results}) + "\n")


if __name__ == "__main__":
    main()
