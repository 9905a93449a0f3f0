"""A reranker's effect on all 300 SciFact test claims over the bundled 2,000-doc sample (report only).

Run after `make demo` (it reads the demo's cached index; the reranker is the shipped one unless
`--reranker DIR`):

    .venv/bin/python benchmarks/demo_reranker_eval.py --data ../shared/data/beir-scifact

`--index` another index of SciFact (the full corpus: `twotower index build --bm25`) scores the same
systems there; `--runs DIR` writes their TREC runs for `benchmarks/scifact_seen_evidence.py`.

The test claims are only scored here; the reranker was trained on train claims and its
interpolation weight chosen on held-out train claims.
"""

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from twotower.eval.io.beir import read_beir_qrels, read_beir_queries
from twotower.eval.io.trec import write_trec_run
from twotower.eval.metrics import evaluate
from twotower.retrieval import SearchPipeline

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data", "beir-scifact"))
ap.add_argument("--index", default=os.path.join(REPO, ".cache", "demo-index"))
ap.add_argument("--reranker", default="default",
                help="cross-encoder directory, or 'default' (the shipped one; the default)")
ap.add_argument("--runs", default=None, metavar="DIR",
                help="also write each system's TREC run here (for benchmarks/scifact_seen_evidence.py)")
ap.add_argument("--hybrid-alpha", type=float, default=None,
                help="weight of the reranker over the hybrid (default: the one stored with the reranker)")
ap.add_argument("--dense-alpha", type=float, default=None,
                help="weight of the reranker over dense (default: the one stored with the reranker)")
ap.add_argument("--rerank-k", type=int, default=None, help="candidates reranked (default: the pipeline's)")
ap.add_argument("--systems", default="dense,hybrid,dense+rerank,dense+rerank1,hybrid+rerank",
                help="comma-separated subset of dense, hybrid, dense+rerank, dense+rerank1 (alone), hybrid+rerank")
args = ap.parse_args()
qs = read_beir_queries(os.path.join(args.data, "queries.jsonl"))
qrels = read_beir_qrels(os.path.join(args.data, "qrels", "test.tsv"))
qids = sorted(qrels)
texts = [qs[q] for q in qids]
out = {}
with SearchPipeline.load(args.index, reranker=args.reranker) as pipe:
    dense_alpha = pipe.rerank_alpha() if args.dense_alpha is None else args.dense_alpha
    hybrid_alpha = pipe.rerank_alpha(hybrid=True) if args.hybrid_alpha is None else args.hybrid_alpha
    given = {"dense": args.dense_alpha, "hybrid": args.hybrid_alpha}
    how = {s: "stored" if given[s] is None else "given" for s in given}  # run names say whose weight it is
    depth = {} if args.rerank_k is None else {"rerank_k": args.rerank_k}
    systems = {
        "dense": ("dense", dict(rerank=False)),
        "hybrid": ("hybrid", dict(rerank=False, hybrid=True)),
        "dense+rerank": (f"dense+rerank(alpha {dense_alpha}, {how['dense']})",
                         dict(rerank_alpha=dense_alpha, **depth)),
        "dense+rerank1": ("dense+rerank(alpha 1)", dict(rerank_alpha=1.0, **depth)),
        "hybrid+rerank": (f"hybrid+rerank(alpha {hybrid_alpha}, {how['hybrid']})",
                          dict(hybrid=True, rerank_alpha=hybrid_alpha, **depth)),
    }
    unknown = set(args.systems.split(",")) - set(systems)
    if unknown:
        ap.error(f"--systems: unknown {sorted(unknown)}; choose from {list(systems)}")
    for name, kw in (systems[s] for s in args.systems.split(",")):
        hits = pipe.search(texts, k=10, recall_k=100, fetch_documents=False, **kw)
        run = {q: {h.id: h.score for h in row} for q, row in zip(qids, hits)}
        out[name] = evaluate(run, qrels, ["ndcg@10", "recall@10"]).means
        print(name, out[name], flush=True)
        if args.runs:
            os.makedirs(args.runs, exist_ok=True)
            tag = name.split("(")[0].replace("+", "_") + ("_alpha1" if "alpha 1)" in name else "")
            write_trec_run(run, os.path.join(args.runs, f"test_{tag}.trec"), tag=tag)
