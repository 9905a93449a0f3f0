#!/usr/bin/env bash
# The from-scratch retrieval track on BEIR SciFact: our tokenizer, our MLM pretraining, self-supervised
# pairs, then SciFact train; dense, hybrid and reranked runs reported on test (chosen on dev only).
#
#   nohup benchmarks/scifact_from_scratch.sh > runs/scratch.log 2>&1 &
#
# Environment: DATA (BEIR SciFact dir), GUTENBERG (gutenberg-en-mlm dir), OUT (default runs/scratch),
# and the budgets MLM_BUDGET (25m), SSL_BUDGET (8m), DUAL_SECONDS (600), RERANK_SECONDS (600).
# Each stage skips itself when its output exists, so a stopped run continues at the stage it was in.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
DATA=${DATA:-../shared/data/beir-scifact}
GUTENBERG=${GUTENBERG:-../shared/data/gutenberg-en-mlm}
OUT=${OUT:-runs/scratch}
mkdir -p "$OUT"
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }

# 1. WordPiece vocabulary (16k, lowercase) learned from the pretraining text: Gutenberg + SciFact abstracts.
if [ ! -f "$OUT/tokenizer/tokenizer.json" ]; then
  stamp tokenizer
  $PY -m twotower tokenizer train --input "$GUTENBERG/train.txt.gz" "$DATA/corpus.jsonl" \
      --vocab-size 16000 --out "$OUT/tokenizer" --no-progress
fi

# 2. MLM pretraining from random weights (mini: 4 layers, hidden 256). The SciFact abstracts (1.7M tokens) are
#    listed twice next to Gutenberg (14.5M tokens) so that about a fifth of the tokens are in-domain.
if [ ! -f "$OUT/mlm/model.safetensors" ]; then
  stamp "mlm pretraining ${MLM_BUDGET:-25m}"
  $PY -m twotower pretrain --corpus "$GUTENBERG/train.txt.gz" "$DATA/corpus.jsonl" "$DATA/corpus.jsonl" \
      --valid "$GUTENBERG/valid.txt.gz" --tokenizer "$OUT/tokenizer" --out "$OUT/mlm" --size mini \
      --budget "${MLM_BUDGET:-25m}" --batch-size 32 --lr 7e-4 --dropout 0 --valid-rows 256 --evals 5 \
      --log-every 20 --cache-dir runs/.cache --no-progress
fi

# 3. Self-supervised pairs (Contriever-style independent cropping: two random spans of one abstract), then a
#    contrastive stage on them with in-batch negatives only (no labels involved).
if [ ! -f "$OUT/pairs.jsonl" ]; then
  stamp pairs
  $PY -m twotower train pairs --corpus "$DATA/corpus.jsonl" --method crop --pairs-per-document 4 \
      --out "$OUT/pairs.jsonl"
fi
if [ ! -d "$OUT/ssl/best" ]; then
  stamp "self-supervised dual ${SSL_BUDGET:-8m}"
  $PY -m twotower train dual --model "$OUT/mlm" --data "$OUT/pairs.jsonl" --out "$OUT/ssl" --mine none \
      --batch-size 64 --hard-negatives 0 --lr 1e-4 --temperature 0.05 --epochs 5 \
      --time-budget "${SSL_BUDGET:-8m}" --eval-interval 4m --dev-size 500 --train-doc-max-length 128 --no-progress
fi

# 4. Supervised dual encoder on SciFact train (BM25 negatives, dev carved from train), then dense / BM25 /
#    RRF hybrid / dev-weighted hybrid runs for dev and test.
if [ ! -f "$OUT/dual/results.json" ]; then
  stamp "supervised dual ${DUAL_SECONDS:-600}s"
  $PY benchmarks/scifact_train_dual.py --data "$DATA" --model "$OUT/ssl/best" --out "$OUT/dual" \
      --time-budget "${DUAL_SECONDS:-600}" --epochs 20 --lr 1e-4 --eval-interval 150
fi

# 5. Cross-encoder from our MLM checkpoint, negatives from the dev-best first stage; reranks its top-100 and
#    interpolates with it (weight chosen on dev).
if [ ! -f "$OUT/reranker/results.json" ]; then
  stamp "reranker ${RERANK_SECONDS:-600}s"
  $PY benchmarks/scifact_train_reranker.py --data "$DATA" --model "$OUT/mlm" --dual-out "$OUT/dual" \
      --out "$OUT/reranker" --time-budget "${RERANK_SECONDS:-600}" --eval-interval 200 --epochs 4 \
      --lr 2e-4 --max-length 256
fi
stamp done
