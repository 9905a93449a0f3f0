"""Build the README's retrieval results table from ../shared/data: BM25, dense, hybrid, reranked.

One row per (collection, system): SciFact (BEIR test split) and the classic
collections Cranfield, CISI, Medline and ADI (their single judged split).
BM25 is `indexing.BM25` (Lucene variant, k1 0.9, b 0.4, English stemming);
dense is all-MiniLM-L6-v2 through `SearchPipeline`; hybrid is RRF (k=60) of the
two; reranked uses `--reranker DIR` over the hybrid top `--recall-k`.
Every collection also gets a full `eval.write_report` directory (runs, JSON,
markdown, Recall@k PNG) under `--out`.

    .venv/bin/python benchmarks/results_table.py --data ../shared/data --systems bm25
    .venv/bin/python benchmarks/results_table.py --data ../shared/data --systems bm25,dense,hybrid [--reranker DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from twotower.eval import load_beir, write_report
from twotower.eval.io.beir import available_splits
from twotower.indexing import BM25

COLLECTIONS = {
    "scifact": "beir-scifact",
    "cranfield": "classic-ir/cranfield",
    "cisi": "classic-ir/cisi",
    "medline": "classic-ir/medline",
    "adi": "classic-ir/adi",
}
METRICS = ("ndcg@10", "mrr@10", "recall@100", "map")


def bm25_run(docs: dict, queries: dict[str, str], k: int) -> dict[str, dict[str, float]]:
    bm = BM25()
    ids = list(docs)
    bm.add(ids, [f"{docs[i].title} {docs[i].text}".strip() for i in ids])
    qids = list(queries)
    res = bm.search([queries[q] for q in qids], k=k)
    return {
        q: {d: float(s) for d, s in zip(res.ids[i], res.scores[i]) if d}
        for i, q in enumerate(qids)
    }


def pipeline_runs(
    name: str, docs: dict, queries: dict[str, str], systems: list[str], work: str, recall_k: int, reranker: str | None
) -> dict[str, dict[str, dict[str, float]]]:
    from twotower.retrieval import SearchPipeline

    index_dir = os.path.join(work, f"{name}-index")
    if os.path.isfile(os.path.join(index_dir, "manifest.json")):
        pipe = SearchPipeline.load(index_dir, reranker=reranker)
    else:
        # An index refuses documents with a blank title and text (Cranfield has two); they match nothing anyway.
        corpus = [{"_id": i, "title": d.title, "text": d.text} for i, d in docs.items()
                  if d.title.strip() or d.text.strip()]
        if len(corpus) < len(docs):
            print(f"{name}: {len(docs) - len(corpus)} documents with no title or text left out of the index")
        pipe = SearchPipeline.build(corpus, index_dir, bm25=True, reranker=reranker, progress=True)
    qids = list(queries)
    texts = [queries[q] for q in qids]
    out = {}
    wanted = {"dense": dict(hybrid=False, rerank=False), "hybrid": dict(hybrid=True, rerank=False),
              "reranked": dict(hybrid=True, rerank=True)}
    for system in systems:
        if system not in wanted:
            continue
        hits = pipe.search(texts, k=recall_k, recall_k=recall_k, fetch_documents=False, **wanted[system])
        out[system] = {q: {h.id: float(h.score) for h in hs} for q, hs in zip(qids, hits)}
    pipe.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))
    ap.add_argument("--collections", default=",".join(COLLECTIONS))
    ap.add_argument("--systems", default="bm25,dense,hybrid", help="bm25,dense,hybrid,reranked")
    ap.add_argument("--reranker", default=None)
    ap.add_argument("--recall-k", type=int, default=100)
    ap.add_argument("--out", default="runs/results-table")
    args = ap.parse_args()
    systems = args.systems.split(",")
    if "reranked" in systems and not args.reranker:
        ap.error("--systems reranked needs --reranker DIR")
    rows = []
    for name in args.collections.split(","):
        root = os.path.join(args.data, COLLECTIONS[name])
        split = "test" if "test" in available_splits(root) else available_splits(root)[0]
        ds = load_beir(root, split=split)
        queries = {q: ds.queries[q] for q in ds.qrels}
        t0 = time.perf_counter()
        runs = {}
        if "bm25" in systems:
            runs["bm25"] = bm25_run(ds.corpus, queries, args.recall_k)
        if set(systems) - {"bm25"}:
            runs.update(pipeline_runs(name, ds.corpus, queries, systems, args.out, args.recall_k, args.reranker))
        report = write_report(runs, ds.qrels, os.path.join(args.out, name), metrics=METRICS,
                              title=f"{name} ({split}, {len(queries)} queries, {len(ds.corpus)} docs)")
        for system, evaluation in report.evaluations.items():
            means = evaluation.means
            rows.append((name, split, len(queries), len(ds.corpus), system, means))
        print(f"{name}: {time.perf_counter() - t0:.1f}s", flush=True)
    lines = ["| collection | split | queries | docs | system | " + " | ".join(METRICS) + " |",
             "|---|---|---|---|---|" + "---|" * len(METRICS)]
    for name, split, nq, nd, system, means in rows:
        lines.append(f"| {name} | {split} | {nq} | {nd} | {system} | "
                     + " | ".join(f"{means[m]:.4f}" for m in METRICS) + " |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "table.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "table.json"), "w", encoding="utf-8") as f:
        json.dump([dict(collection=r[0], split=r[1], system=r[4], **r[5]) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
