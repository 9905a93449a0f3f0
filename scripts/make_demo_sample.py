"""Rebuild the bundled SciFact sample (scifact-sample.jsonl.gz, example_queries.jsonl) from BEIR SciFact.

Run from the repository root:
    .venv/bin/python scripts/make_demo_sample.py --data ../shared/data/beir-scifact

Every abstract cited by a test claim is kept (so the example queries have answers), and
every abstract cited by a *train* claim (so the demo reranker has labeled pairs to learn
from: ``scifact-train-claims.jsonl.gz``); random other abstracts (seed 0) fill the sample
up to --size documents.
The output is byte-for-byte reproducible (gzip mtime 0, sorted by original order).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(HERE, "..", "..", "..", "shared", "data", "beir-scifact"))
    ap.add_argument("--size", type=int, default=2000)
    ap.add_argument("--queries", default="659,132,641,623,1262", help="test query ids for example_queries.jsonl")
    args = ap.parse_args()

    with open(os.path.join(args.data, "corpus.jsonl"), encoding="utf-8") as f:
        corpus = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(args.data, "queries.jsonl"), encoding="utf-8") as f:
        queries = {q["_id"]: q["text"] for q in map(json.loads, f)}
    with open(os.path.join(args.data, "qrels", "test.tsv"), encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    with open(os.path.join(args.data, "qrels", "train.tsv"), encoding="utf-8") as f:
        train_rows = [r for r in csv.DictReader(f, delimiter="\t") if int(r["score"]) > 0]
    cited = {r["corpus-id"] for r in rows} | {r["corpus-id"] for r in train_rows}
    rng = random.Random(0)
    others = [d["_id"] for d in corpus if d["_id"] not in cited]
    keep = cited | set(rng.sample(others, max(0, args.size - len(cited))))
    docs = [{"_id": d["_id"], "title": d["title"], "text": d["text"]} for d in corpus if d["_id"] in keep]
    out = os.path.join(HERE, "scifact-sample.jsonl.gz")
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
        for d in docs:
            gz.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))
    # Train claims with their evidence abstracts (ids into the sample): the demo reranker's labeled pairs.
    train_pos: dict[str, list[str]] = {}
    for r in train_rows:
        train_pos.setdefault(r["query-id"], []).append(r["corpus-id"])
    claims = os.path.join(HERE, "scifact-train-claims.jsonl.gz")
    with open(claims, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
        for q, pos in train_pos.items():
            line = {"query_id": q, "query": queries[q], "pos": pos}
            gz.write((json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8"))
    # Example queries: hand-picked readable test claims; all their cited abstracts are in the sample.
    picked: dict[str, list[str]] = {}
    for r in rows:
        picked.setdefault(r["query-id"], []).append(r["corpus-id"])
    qids = args.queries.split(",")
    with open(os.path.join(HERE, "example_queries.jsonl"), "w", encoding="utf-8") as f:
        for q in qids:
            f.write(json.dumps({"_id": q, "text": queries[q], "relevant": picked[q]}) + "\n")
    print(f"{len(docs)} documents -> {out}; {len(train_pos)} train claims -> {claims}; {len(qids)} example queries")


if __name__ == "__main__":
    main()
