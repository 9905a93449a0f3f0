#!/usr/bin/env bash
# `make demo`: index the bundled SciFact sample (2,000 abstracts, CC BY 4.0 / ODC-By, see
# retrieval/data/README.md) with all-MiniLM-L6-v2 and show five *test* claims' recall results at
# once; then answer the same claims with recall-then-rerank, using the reranker twotower ships
# (trained by the library on SciFact *train* claims: docs/training.md), and say per claim whether
# reranking helped.
#
# The index is cached in .cache/demo-index (DEMO_INDEX=...; an interrupted build resumes from its
# finished shards). RERANKER=<cross-encoder dir> uses another reranker; RERANKER=none shows recall
# only. DEMO_TRAIN=1 also trains a reranker on the bundled labeled claims first (minutes; cached in
# .cache/demo-reranker) and reranks with it: fine-tuning on your own labeled pairs, end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python writes the bytecode of what each command imports, so every command after the first starts in
# about 3 s instead of 5 (`search` on CPU-B), even where the environment turns caching off
# (PYTHONDONTWRITEBYTECODE); the demo's set-up leaves compiling to this instead of compiling all of .venv.
unset PYTHONDONTWRITEBYTECODE
PY=${PY:-.venv/bin/python}
IDX=${DEMO_INDEX:-.cache/demo-index}
CORPUS=retrieval/data/scifact-sample.jsonl.gz
QUERIES=retrieval/data/example_queries.jsonl
RERANKER=${RERANKER:-}
RERANKER_DIR=${DEMO_RERANKER:-.cache/demo-reranker}
DEMO_TRAIN=${DEMO_TRAIN:-0}

if [ -f "$IDX/manifest.json" ]; then
  echo "== using the cached index $IDX (delete it to rebuild)"
else
  echo "== building $IDX from $CORPUS (all-MiniLM-L6-v2 + BM25; a few minutes on 2 CPU cores)"
  mkdir -p "$(dirname "$IDX")"
  "$PY" -m twotower index build --corpus "$CORPUS" --out "$IDX" --bm25
fi
"$PY" -m twotower index info --index "$IDX"
echo
search=("$PY" -m twotower search --index "$IDX" --queries "$QUERIES" -k 3 --recall-k 100)
echo "== recall: dense retrieval with all-MiniLM-L6-v2, the top 3 of each example claim (no reranker yet)"
echo
"${search[@]}" --no-rerank

if [ -z "$RERANKER" ] && [ "$DEMO_TRAIN" = 1 ]; then
  if [ -f "$RERANKER_DIR/demo_reranker.json" ] && ! grep -q '"finished": false' "$RERANKER_DIR/demo_reranker.json"; then
    echo "== using the cached demo reranker in $RERANKER_DIR (delete it to retrain)"
  else
    echo "== training a reranker on labeled pairs, the shipped reranker's recipe: all-MiniLM-L6-v2, listwise"
    echo "   loss on 809 SciFact train claims with negatives from the index's dense ranking, its scores"
    echo "   distilled next to the labels (the index lends its vectors), abstracts read as windows of 96 tokens"
    echo "   (each step trains on the window BM25 ranks best), 150 steps (minutes on 2 CPU cores; cached)"
  fi
  RERANKER=$("$PY" -m twotower train demo-reranker --out "$RERANKER_DIR" --trainable-layers 6 \
      --teacher "$IDX" --mine dense --first-stage dense --passage-window 96 --window-choice bm25 --evals 1 \
    | "$PY" -c 'import json, sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["reranker"])')
  "$PY" - "$RERANKER_DIR/demo_reranker.json" <<'PYEOF'
import json, sys
m = json.load(open(sys.argv[1]))
first = "dense" if m["settings"].get("first_stage") == "dense" else "BM25"
print("   held-out train claims (dev), %s top-20: nDCG@10 %.3f reranked vs %.3f %s alone" % (
    first, m["best_dev_ndcg@10"], m["first_stage_dev_ndcg@10"], first))
a = m.get("interpolation_alpha")
if a is not None:
    print("   final score = %.1f x reranker + %.1f x first stage (z-scores; weight chosen on dev)" % (a, 1 - a))
PYEOF
  echo
fi
if [ -z "$RERANKER" ]; then
  RERANKER=default
  "$PY" - <<'PYEOF'
import os
from twotower.retrieval.default_reranker import DIRECTORY, read_manifest
m = read_manifest()
d = m["dev"]
size = sum(os.path.getsize(os.path.join(DIRECTORY, f)) for f in os.listdir(DIRECTORY))
first = "dense" if "dense_ndcg@10" in d else "bm25"  # what dev reranked: the dense model's top 20 (or BM25's)
w = m["recipe"].get("windows")
print("== the reranker twotower ships: all-MiniLM-L6-v2 fine-tuned (embeddings frozen) on 809 SciFact train")
print("   claims, a %.1f MB delta over the model (docs/training.md)%s." % (
    size / 1e6, ",\n   reading abstracts as windows of %d tokens" % w["window"] if w else ""))
print("   Held-out train claims, %s top 20:" % ("the dense model's" if first == "dense" else "BM25's"))
print("   nDCG@10 %.3f reranked alone vs %.3f %s alone; final score = %.1f x reranker + %.1f x first stage" % (
    d["reranker_ndcg@10"], d[first + "_ndcg@10"], first, d["interpolation_alpha"], 1 - d["interpolation_alpha"]))
PYEOF
  echo
fi
[ "$RERANKER" = none ] && RERANKER=

if [ -n "$RERANKER" ]; then
  echo "== recall 100 with the dual encoder, rerank the top 20 with the cross-encoder ($RERANKER), show the top 3"
  echo
  "${search[@]}" --reranker "$RERANKER"
fi

# Where did the abstracts SciFact annotates as evidence for each claim land, with and without reranking?
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m twotower search --index "$IDX" --queries "$QUERIES" -k 10 --recall-k 100 --no-rerank --json > "$tmp/recall.json"
if [ -n "$RERANKER" ]; then
  "$PY" -m twotower search --index "$IDX" --queries "$QUERIES" -k 10 --recall-k 100 --reranker "$RERANKER" \
    --json > "$tmp/rerank.json"
fi
echo
"$PY" - "$QUERIES" "$tmp/recall.json" "$tmp/rerank.json" <<'PYEOF'
import json, os, sys
relevant = {q["_id"]: set(q["relevant"]) for q in map(json.loads, open(sys.argv[1]))}
runs = {"recall only": sys.argv[2]}
if os.path.exists(sys.argv[3]):
    runs["reranked"] = sys.argv[3]
ranks = {}
for name, path in runs.items():
    for r in json.load(open(path)):
        hits = [h["rank"] for h in r["hits"] if h["id"] in relevant[r["qid"]]]
        ranks.setdefault(r["qid"], {})[name] = hits[0] if hits else None
print("best rank of an evidence abstract (top 10 shown; - = not in the top 10):")
print("claim  " + "  ".join("%12s" % n for n in runs) + ("  reranking" if len(runs) > 1 else ""))
for qid, by in ranks.items():
    row = "%5s  " % qid + "  ".join("%12s" % (by.get(n) or "-") for n in runs)
    if len(runs) > 1:
        before, after = by.get("recall only") or 99, by.get("reranked") or 99
        same = "no change (already first)" if before == 1 else "did not help"
        row += "  " + ("helped" if after < before else same if after == before else "hurt")
    print(row)
for n in runs:
    top3 = sum(1 for by in ranks.values() if by.get(n) and by[n] <= 3)
    print("%s: %d of %d claims have an evidence abstract in the top 3" % (n, top3, len(ranks)))
PYEOF
echo; echo "== serve this index with a search page: $PY -m twotower serve --index $IDX${RERANKER:+ --reranker $RERANKER}, then open http://127.0.0.1:8000/ (docs/serve.md)"
