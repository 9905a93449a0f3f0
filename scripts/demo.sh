#!/usr/bin/env bash
# `make demo`: index the bundled SciFact sample (1,500 abstracts, CC BY 4.0 / ODC-By, see
# retrieval/data/README.md) with all-MiniLM-L6-v2 and answer five example claims.
#
# The index is cached in .cache/demo-index (override with DEMO_INDEX=...) and reused;
# an interrupted build resumes from its finished shards when you run this again.
# Reranking: set RERANKER=<cross-encoder dir> to rerank the top 100 with it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
IDX=${DEMO_INDEX:-.cache/demo-index}
CORPUS=retrieval/data/scifact-sample.jsonl.gz
QUERIES=retrieval/data/example_queries.jsonl
RERANKER=${RERANKER:-}

if [ -f "$IDX/manifest.json" ]; then
  echo "== using the cached index $IDX (delete it to rebuild)"
else
  echo "== building $IDX from $CORPUS (all-MiniLM-L6-v2 + BM25; a few minutes on 2 CPU cores)"
  mkdir -p "$(dirname "$IDX")"
  "$PY" -m retrieval index build --corpus "$CORPUS" --out "$IDX" --bm25
fi
"$PY" -m retrieval index info --index "$IDX"
echo

search=("$PY" -m retrieval search --index "$IDX" --queries "$QUERIES" -k 3 --recall-k 100)
if [ -n "$RERANKER" ]; then
  echo "== recall 100 with the dual encoder, rerank with the cross-encoder in $RERANKER, show the top 3"
  search+=(--reranker "$RERANKER")
else
  echo "== NOTE: this demo shows RECALL ONLY (dense retrieval with all-MiniLM-L6-v2): no trained"
  echo "   reranker is wired in yet. Set RERANKER=<cross-encoder dir> to rerank the top 100."
  search+=(--no-rerank)
fi
echo
"${search[@]}"

# Did the abstracts SciFact annotates as evidence for each claim make the top 3?
"${search[@]}" --json | "$PY" -c '
import json, sys
results = json.load(sys.stdin)
relevant = {q["_id"]: set(q["relevant"]) for q in map(json.loads, open(sys.argv[1]))}
found = 0
for r in results:
    ranks = [h["rank"] for h in r["hits"] if h["id"] in relevant[r["qid"]]]
    found += bool(ranks)
    where = ranks[0] if ranks else "> 3"
    print("claim %5s: evidence abstract at rank %s" % (r["qid"], where))
print("%d of %d claims have an evidence abstract in the top 3" % (found, len(results)))
' "$QUERIES"
