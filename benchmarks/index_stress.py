"""Stress: one writer process commits while 4 reader processes and 4 threads sharing one pipeline search.

Bounded in time (``--seconds``, default 120). The parts, all real:

* an index built with ``SearchPipeline.build`` from the first ``--base`` SciFact documents
  (``../shared/data/beir-scifact``), encoded with the default model (all-MiniLM-L6-v2, fp32);
* a *writer process* that, every ``--pause`` seconds, adds ``--batch`` documents (SciFact texts
  under fresh ids, with their real MiniLM vectors, encoded once in the preparation step) and
  deletes half as many of the ones it added before, then commits — so segments are written,
  tombstoned and merged while the readers read;
* 4 *reader processes*, each opening the index read-only (a fresh ``IndexStore.open`` every
  10th round, ``refresh()`` otherwise) and searching pre-encoded SciFact query vectors;
* 4 *threads in this process sharing one* ``SearchPipeline``: they search SciFact query
  texts (the encoder runs in each thread) while a fifth thread calls ``pipe.store.refresh()``.

Reported: commits, searches (processes and threads), errors, hits whose document text is
missing, and — after the writer stops — whether every document of the last commit is in
the index and found by searching its own vector (top 50: the writer cycles through its pool of
texts, so a few documents share one vector and tie).

    .venv/bin/python benchmarks/index_stress.py --seconds 120
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
DATA = os.path.join(REPO, "..", "shared", "data", "beir-scifact")


def read_jsonl(path: str, n: int) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line))
            if len(out) == n:
                break
    return out


def prepare(args: argparse.Namespace) -> dict:
    """Encode the SciFact sample and queries once (cached in --work), build the base index (fresh each run)."""
    from twotower.indexing import document_text
    from twotower.retrieval import DualEncoder, SearchPipeline
    from twotower.retrieval.manifest import default_model_dir

    os.makedirs(args.work, exist_ok=True)
    docs = read_jsonl(os.path.join(DATA, "corpus.jsonl"), args.docs)
    queries = [q["text"] for q in read_jsonl(os.path.join(DATA, "queries.jsonl"), 300)]
    encoder = DualEncoder.from_pretrained(default_model_dir(), bf16=False)
    cache = os.path.join(args.work, f"scifact-{args.docs}.npy")
    if not os.path.exists(cache):
        t = time.perf_counter()
        vecs = encoder.encode_documents([document_text(d) for d in docs], batch_size=32)
        np.save(cache, vecs)
        print(f"encoded {len(docs)} documents in {time.perf_counter() - t:.0f}s", flush=True)
    qcache = os.path.join(args.work, "scifact-queries.npy")
    if not os.path.exists(qcache):
        np.save(qcache, encoder.encode_queries(queries))
    index = os.path.join(args.work, "index")
    shutil.rmtree(index, ignore_errors=True)
    corpus = os.path.join(args.work, "base.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        for d in docs[:args.base]:
            f.write(json.dumps(d) + "\n")
    SearchPipeline.build(corpus, index, encoder, factory=args.factory, progress=False).close()
    return {"docs": docs, "vectors": cache, "queries": queries, "query_vectors": qcache, "index": index}


def writer(index: str, docs: list[dict], vectors_path: str, base: int, batch: int, pause: float, stop: float,
           out: str) -> None:
    """Commit `batch` new documents (+ delete batch/2 earlier ones) every `pause` s until `stop` (monotonic)."""
    import faiss

    from twotower.indexing import IndexStore

    faiss.omp_set_num_threads(1)
    vecs = np.load(vectors_path)
    rng = np.random.default_rng(0)
    store = IndexStore.open(index)
    added: list[str] = []
    commits = errors = r = 0
    first_error = None
    pool = list(range(base, len(docs)))
    while time.monotonic() < stop:
        try:
            rows = [pool[(r * batch + j) % len(pool)] for j in range(batch)]
            new = [{"id": f"{docs[i]['_id']}~{r}", "title": docs[i].get("title", ""), "text": docs[i]["text"]}
                   for i in rows]
            store.add(new, vecs[rows])
            added += [d["id"] for d in new]
            if len(added) > 4 * batch:
                gone = [added.pop(int(rng.integers(0, len(added) - 2 * batch))) for _ in range(batch // 2)]
                store.delete(gone)
            store.commit()
            commits += 1
        except Exception as e:  # noqa: BLE001 - counted and reported
            errors += 1
            first_error = first_error or repr(e)
            store.rollback()
        r += 1
        time.sleep(pause)
    store.close()
    with open(out, "w") as f:
        json.dump({"commits": commits, "errors": errors, "first_error": first_error}, f)


def reader(index: str, qvec_path: str, stop: float, out: str) -> None:
    """Open / refresh read-only stores and search pre-encoded queries until `stop`; count errors and missing text."""
    import faiss

    from twotower.indexing import IndexStore

    faiss.omp_set_num_threads(1)
    q = np.load(qvec_path)
    searches = errors = missing = opens = 0
    first_error = None
    store = None
    r = 0
    while time.monotonic() < stop:
        try:
            if store is None or r % 10 == 0:
                if store is not None:
                    store.close()
                store = IndexStore.open(index, readonly=True)
                opens += 1
            else:
                store.refresh()
            with store.snapshot() as snap:
                res = snap.search(q[r % len(q):r % len(q) + 4], 10)
                got = snap.get([i for row in res.ids for i in row if i])
            searches += 4
            missing += sum(g is None or not g["text"] for g in got)
        except Exception as e:  # noqa: BLE001
            errors += 1
            first_error = first_error or repr(e)
            store = None
        r += 1
    if store is not None:
        store.close()
    with open(out, "w") as f:
        json.dump({"searches": searches, "errors": errors, "missing_text": missing, "opens": opens,
                   "first_error": first_error}, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--work", default=os.path.join(REPO, "runs", "index_stress"))
    p.add_argument("--docs", type=int, default=2000, help="SciFact documents encoded (base + writer pool)")
    p.add_argument("--base", type=int, default=500, help="documents in the index before the writer starts")
    p.add_argument("--batch", type=int, default=10, help="documents added per commit")
    p.add_argument("--pause", type=float, default=0.1, help="seconds between commits")
    p.add_argument("--factory", default="Flat")
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--json", default=None, help="write the figures here too")
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    from twotower.indexing import IndexStore
    from twotower.retrieval import SearchPipeline

    t0 = time.perf_counter()
    prep = prepare(args)
    print(f"prepared in {time.perf_counter() - t0:.0f}s", flush=True)
    stop = time.monotonic() + args.seconds
    ctx = mp.get_context("spawn")
    wout = os.path.join(args.work, "writer.json")
    procs = [ctx.Process(target=writer, args=(prep["index"], prep["docs"], prep["vectors"], args.base, args.batch,
                                              args.pause, stop, wout))]
    routs = [os.path.join(args.work, f"reader-{i}.json") for i in range(args.readers)]
    procs += [ctx.Process(target=reader, args=(prep["index"], prep["query_vectors"], stop, o)) for o in routs]
    for pr in procs:
        pr.start()

    pipe = SearchPipeline.load(prep["index"], bf16=False)
    lock = threading.Lock()
    stats = {"searches": 0, "errors": 0, "missing_text": 0, "refreshes": 0, "first_error": None}

    def search_loop(t: int) -> None:
        i = t
        while time.monotonic() < stop:
            try:
                hits = pipe.search(prep["queries"][i % len(prep["queries"])], k=10)
                with lock:
                    stats["searches"] += 1
                    stats["missing_text"] += sum(h.text is None for h in hits)
            except Exception as e:  # noqa: BLE001
                with lock:
                    stats["errors"] += 1
                    stats["first_error"] = stats["first_error"] or repr(e)
            i += args.threads

    def refresh_loop() -> None:
        while time.monotonic() < stop:
            try:
                stats["refreshes"] += bool(pipe.store.refresh())
            except Exception as e:  # noqa: BLE001
                with lock:
                    stats["errors"] += 1
                    stats["first_error"] = stats["first_error"] or repr(e)
            time.sleep(0.05)

    threads = [threading.Thread(target=search_loop, args=(t,)) for t in range(args.threads)]
    threads.append(threading.Thread(target=refresh_loop))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for pr in procs:
        pr.join(120)
    pipe.close()

    w = json.load(open(wout))
    rs = [json.load(open(o)) for o in routs]
    # every document of the last commit is stored and found by its own vector
    vecs = np.load(prep["vectors"])
    by_id = {d["_id"]: j for j, d in enumerate(prep["docs"])}
    with IndexStore.open(prep["index"], readonly=True, verify="full") as store:
        ids = list(store.docstore.iter_ids())
        rows = [by_id[i.split("~")[0]] for i in ids]
        found = 0
        for s in range(0, len(ids), 256):
            res = store.search(vecs[rows[s:s + 256]], 50)  # the writer re-adds texts: identical vectors tie
            found += sum(i in row for i, row in zip(ids[s:s + 256], res.ids))
        final = {"documents": len(ids), "vectors": len(store), "found_by_own_vector": found,
                 "segments": len(store.vectors.segments), "generation": store.generation}
    report = {
        "seconds": args.seconds, "factory": args.factory, "base_documents": args.base,
        "commits": w["commits"], "writer_errors": w["errors"], "writer_first_error": w["first_error"],
        "reader_processes": len(rs), "reader_searches": sum(r["searches"] for r in rs),
        "reader_opens": sum(r["opens"] for r in rs), "reader_errors": sum(r["errors"] for r in rs),
        "reader_missing_text": sum(r["missing_text"] for r in rs),
        "reader_first_error": next((r["first_error"] for r in rs if r["first_error"]), None),
        "pipeline_threads": args.threads, "thread_searches": stats["searches"], "thread_errors": stats["errors"],
        "thread_missing_text": stats["missing_text"], "pipeline_refreshes": stats["refreshes"],
        "thread_first_error": stats["first_error"], "final": final,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    ok = (report["writer_errors"] == report["reader_errors"] == report["thread_errors"] == 0
          and report["reader_missing_text"] == report["thread_missing_text"] == 0
          and final["documents"] == final["vectors"] == final["found_by_own_vector"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
