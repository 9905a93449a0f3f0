"""Milvus (Lite) vs FAISS behind the same ``IndexStore``: build time, queries/s, recall@10 against exact.

Data: the real all-MiniLM-L6-v2 sentence embeddings cached by ``benchmarks/ann_recall.py encode``
(Gutenberg sentences; queries from other books). Each backend is built through the library's
own path — ``IndexStore.create`` (``milvus=MilvusSpec(...)`` for Milvus), ``add`` in batches of
10,000 documents, one ``commit`` — so "build s" includes the SQLite documents on both sides (for
Milvus, "index ready s" is the further wait until Milvus reports its index built over every row), and
searches go through ``IndexStore.search`` (for Milvus: the generation filter and the live-key
check of ``twotower.indexing.milvus``). Exact top-10 (FAISS ``Flat``) is the reference for recall.

Rows: FAISS ``Flat`` and ``HNSW32`` (the library's default efSearch, 128), and Milvus Lite with each index type given
(``--milvus-types``, default FLAT, IVF_FLAT, HNSW). Queries/s: *single* (one query per call, what an
online service sees) and *batch* (all queries in one call).

    .venv/bin/python benchmarks/ann_recall.py encode --n 200000 --queries 200 --cache runs/idxbench/ann
    .venv/bin/python benchmarks/milvus_vs_faiss.py --n 200000 --cache runs/idxbench/ann
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.ann_recall import load_corpus, recall_against  # noqa: E402

BATCH = 10_000


def build(directory: str, x: np.ndarray, *, factory: str | None, milvus_uri: str | None) -> tuple[object, float]:
    from twotower.indexing import IndexStore
    from twotower.indexing.milvus import MilvusSpec

    spec = MilvusSpec(milvus_uri, f"bench_{(factory or 'flat').lower()}") if milvus_uri else None
    t0 = time.perf_counter()
    store = IndexStore.create(directory, x.shape[1], factory, "cosine", milvus=spec, expected_size=len(x))
    for s in range(0, len(x), BATCH):
        store.add([{"id": f"s{i}", "text": ""} for i in range(s, min(s + BATCH, len(x)))], x[s:s + BATCH])
    store.commit()
    return store, time.perf_counter() - t0


def wait_indexed(store, timeout: float = 1800.0) -> float:
    """Milvus: seconds until the collection's index covers every row (Milvus Lite builds it in the background)."""
    client, name = store.vectors.client, store.vectors.collection
    t0 = time.perf_counter()
    client.flush(name)
    while time.perf_counter() - t0 < timeout:
        info = client.describe_index(name, "vector")
        if int(info.get("pending_index_rows", 0)) == 0 and int(info.get("indexed_rows", 0)) >= len(store):
            break
        time.sleep(1.0)
    client.release_collection(name)
    client.load_collection(name)  # searches then use the built index of every segment
    return time.perf_counter() - t0


def timed_search(store, q: np.ndarray, k: int, single: bool) -> tuple[list[list[str]], float]:
    t0 = time.perf_counter()
    if single:
        ids = [store.search(q[j:j + 1], k).ids[0] for j in range(len(q))]
    else:
        ids = store.search(q, k).ids
    return ids, len(q) / (time.perf_counter() - t0)



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=os.path.join(REPO, "runs", "idxbench", "ann"),
                    help="embedding cache of `ann_recall.py encode`")
    ap.add_argument("--n", type=int, default=200_000, help="corpus vectors to index")
    ap.add_argument("--queries", type=int, default=200, help="queries to time (from the cache)")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--milvus-types", default="FLAT,IVF_FLAT,HNSW", help="Milvus index types to build")
    ap.add_argument("--faiss", default="Flat,HNSW32", help="FAISS factories to build")
    ap.add_argument("--threads", type=int, default=1, help="FAISS threads")
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "idxbench", "milvus_vs_faiss.json"))
    args = ap.parse_args()
    import faiss

    faiss.omp_set_num_threads(args.threads)
    x = load_corpus(args.cache, args.n)  # (n, 384)
    q = np.load(os.path.join(args.cache, "queries.npy"))[: args.queries]  # (Q, 384)
    work = tempfile.mkdtemp(prefix="milvus_vs_faiss_", dir=os.path.join(REPO, "runs", "idxbench"))
    rows, truth = [], None
    try:
        plan = [("faiss", f) for f in args.faiss.split(",") if f] + \
               [("milvus", t) for t in args.milvus_types.split(",") if t]
        for backend, kind in plan:
            uri = os.path.join(work, "lite.db") if backend == "milvus" else None
            store, build_s = build(os.path.join(work, f"{backend}-{kind}"), x, factory=kind, milvus_uri=uri)
            index_s = wait_indexed(store) if backend == "milvus" else 0.0
            store.search(q[:2], args.k)  # warm-up
            ids_b, qps_b = timed_search(store, q, args.k, single=False)
            ids_s, qps_s = timed_search(store, q, args.k, single=True)
            if truth is None and backend == "faiss" and kind == "Flat":
                truth = ids_b
            row = {"backend": backend, "index": kind, "n": len(x), "build_s": round(build_s, 1),
                   "index_ready_s": round(index_s, 1),
                   "qps_single": round(qps_s, 1), "qps_batch": round(qps_b, 1),
                   "recall@10": round(recall_against(ids_s, truth), 4) if truth is not None else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
            store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"n": len(x), "queries": len(q), "rows": rows}, f, indent=2)
    print("| backend | index | build s | + index ready s | QPS single | QPS batch | recall@10 vs exact |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['index']} | {r['build_s']} | {r['index_ready_s']} | {r['qps_single']} | "
              f"{r['qps_batch']} | {r['recall@10']} |")


if __name__ == "__main__":
    main()
