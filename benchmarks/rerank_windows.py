"""How a reranker should read long abstracts: the head up to --max-length, or windows of W tokens (MaxP).

On BEIR SciFact the 81 dev claims carved from *train* exactly as the trainers carve them (seed 0;
`benchmarks/scifact_train_common.py`) are searched in a full-corpus index (dense, and the hybrid of
dense + BM25 by RRF), and a reranker scores each claim's top `--rerank-k` read each way in
`--configs` (``head``, or ``W:S`` for windows of W tokens every S, the title in front of each; with
`--keep K` only the K windows BM25 ranks best among a document's windows are scored).  For each
first stage it prints nDCG@10 of the reranker alone and of the interpolation with the first stage at
the weight that is best on these dev claims (the trainer's choice).  Test claims are not read:
this chooses how to read.

    .venv/bin/python benchmarks/rerank_windows.py --index runs/serve/scifact-minilm --reranker default
    .venv/bin/python benchmarks/rerank_windows.py --index runs/serve/scifact-minilm --reranker DIR --configs head,64:48,96:64,128:96 --keep 0

`--reranker` is a cross-encoder directory, ``default`` (the shipped one) or a directory written by
`twotower.retrieval.default_reranker.pack` (e.g. ``scripts/make_default_reranker.py --out DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from scifact_train_common import DEFAULT_DATA, evaluate, load_splits


def load(reranker: str, max_length: int | None, bf16):
    from twotower.retrieval import default_reranker
    from twotower.retrieval.cross_encoder import CrossEncoder

    if reranker == default_reranker.NAME:
        return default_reranker.load(max_length=max_length, bf16=bf16)
    if os.path.isfile(os.path.join(reranker, default_reranker.MANIFEST)):
        return default_reranker.load(directory=reranker, max_length=max_length, bf16=bf16)
    return CrossEncoder.from_pretrained(reranker, max_length=max_length, bf16=bf16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--index", required=True, help="a SciFact index built with --bm25 (the full corpus)")
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--reranker", default="default")
    ap.add_argument("--configs", default="head,96:64", help="comma-separated: head, or W:S windows")
    ap.add_argument("--keep", type=int, default=3, help="windows scored per document and claim (0: all)")
    ap.add_argument("--rerank-k", type=int, default=20)
    ap.add_argument("--max-length", type=int, default=192)
    ap.add_argument("--bf16", choices=["auto", "0", "1"], default="auto")
    ap.add_argument("--out", default=None, help="also write the table as JSON here")
    args = ap.parse_args()

    from twotower.common.device import cpu_description
    from twotower.retrieval import SearchPipeline
    from twotower.retrieval.cross_encoder import RerankWindows
    from twotower.retrieval.training.alpha import choose_alpha

    corpus, dev_q, dev_qrels, _, _ = load_splits(args.data)
    qids = sorted(dev_q)
    bf16 = {"auto": "auto", "0": False, "1": True}[args.bf16]
    ce = load(args.reranker, args.max_length, bf16)
    # How long the abstracts are for a reranker: tokens of "title text" against the room the head reader
    # leaves beside a median dev claim ([CLS] claim [SEP] abstract [SEP] in --max-length).
    lengths = np.array([len(offsets) for offsets, _ in ce.tokenizer.token_spans(list(corpus.values()))])
    claim = int(np.median([len(offsets) for offsets, _ in ce.tokenizer.token_spans([dev_q[q] for q in qids])]))
    room = ce.max_length - claim - 3
    print(f"abstracts (title + text): median {int(np.median(lengths))} tokens; {100 * np.mean(lengths > room):.0f} % "
          f"longer than the {room} a median dev claim ({claim} tokens) leaves in --max-length {ce.max_length}")
    firsts, docs = {}, {}
    with SearchPipeline.load(args.index, bf16=bf16, use_default_reranker=False) as pipe:
        for name, hybrid in (("dense", False), ("hybrid", True)):
            hits = pipe.search([dev_q[q] for q in qids], k=args.rerank_k, recall_k=100, hybrid=hybrid, rerank=False)
            firsts[name] = {q: {h.id: h.score for h in row} for q, row in zip(qids, hits)}
            docs.update({h.id: (h.title or "", h.text) for row in hits for h in row})
    pairs = sorted({(q, d) for run in firsts.values() for q, ranked in run.items() for d in ranked})
    rows = []
    for config in args.configs.split(","):
        if config == "head":
            ce.windows = None
        else:
            window, stride = (int(x) for x in config.split(":"))
            ce.windows = RerankWindows(window, stride, args.keep or None)
        t0 = time.perf_counter()
        scores = ce.predict([(dev_q[q], docs[d]) for q, d in pairs])
        seconds = time.perf_counter() - t0
        by_pair = dict(zip(pairs, scores.tolist()))
        row = {"config": config, "keep": args.keep if config != "head" else None, "pairs": len(pairs),
               "seconds": round(seconds, 1)}
        for name, first in firsts.items():
            rerank = {q: {d: by_pair[(q, d)] for d in ranked} for q, ranked in first.items()}
            alpha, curve = choose_alpha(rerank, first, dev_qrels)
            row[name] = {"first_stage": evaluate(first, dev_qrels)["ndcg@10"],
                         "alone": evaluate(rerank, dev_qrels)["ndcg@10"],
                         "alpha": alpha, "interpolated": round(curve[alpha], 4),
                         "by_alpha": {str(a): round(v, 4) for a, v in curve.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"| reading | dense: alone | dense: interpolated (weight) | hybrid: alone | hybrid: interpolated (weight) "
          f"| seconds ({len(pairs)} claim/abstract pairs) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        name = "head (first tokens up to --max-length)" if r["config"] == "head" else \
            f"windows {r['config']}" + (f", best {r['keep']} by BM25" if r["keep"] else ", all")
        print(f"| {name} | {r['dense']['alone']:.4f} | {r['dense']['interpolated']:.4f} ({r['dense']['alpha']}) "
              f"| {r['hybrid']['alone']:.4f} | {r['hybrid']['interpolated']:.4f} ({r['hybrid']['alpha']}) "
              f"| {r['seconds']} |")
    print(f"first stages on dev: dense {rows[0]['dense']['first_stage']:.4f}, hybrid {rows[0]['hybrid']['first_stage']:.4f}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"cpu": cpu_description(), "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
