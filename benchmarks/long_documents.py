"""Long documents: truncated at the model's maximum vs split into passages (MaxP), dense retrieval.

Two sets:

* **SciFact** (BEIR): nDCG@10 over all claims of a split, and over the claims whose evidence
  abstract (title + text) is longer than the model's maximum (256 tokens for all-MiniLM-L6-v2),
  i.e. the claims truncation can hurt.  Window and stride are chosen on the train claims and
  reported on test.
* **XQuAD-en articles**: the 240 paragraphs of XQuAD-en concatenated per article (48 long
  documents, about 900 tokens each), its 1,190 questions as queries, each question's article as
  the one relevant document: nDCG@10, recall@10 and recall@100.

Each configuration is one index built with `SearchPipeline.build` (exact search, Flat) and cached
under ``--out``; rerunning the script only searches.  Dense first stage, no reranker.

    .venv/bin/python benchmarks/long_documents.py [--data ../shared/data] [--configs truncate,128:96,192:144,254:190]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), model)
    except OSError:
        pass
    flags = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set(next(ln for ln in f if ln.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    import torch

    return f"{model}, {torch.get_num_threads()} threads, {'/'.join(isa) or 'no avx2'}"


def xquad_articles(path: str, out_dir: str) -> tuple[str, dict[str, str], dict[str, dict[str, int]]]:
    """(corpus.jsonl of articles, questions, qrels): paragraphs joined by a blank line per article."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)["data"]
    corpus = os.path.join(out_dir, "xquad-articles.jsonl")
    queries, qrels = {}, {}
    rows = []
    for a, article in enumerate(data):
        doc_id = f"article{a}"
        rows.append({"_id": doc_id, "title": article.get("title", "").replace("_", " "),
                     "text": "\n\n".join(p["context"] for p in article["paragraphs"])})
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                queries[qa["id"]] = qa["question"]
                qrels[qa["id"]] = {doc_id: 1}
    tmp = corpus + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, corpus)
    return corpus, queries, qrels


def build(corpus: str, directory: str, config: str, batch_size: int) -> float:
    """Build (once) the index of one configuration; returns the seconds it took (0 when cached)."""
    from twotower.retrieval import SearchPipeline

    if os.path.isdir(directory):
        return 0.0
    kw = {"factory": "Flat", "batch_size": batch_size, "progress": False}
    if config != "truncate":
        window, stride = (int(x) for x in config.split(":"))
        kw.update(passages=True, passage_window=window, passage_stride=stride)
    t = time.perf_counter()
    SearchPipeline.build(corpus, directory, **kw).close()
    return time.perf_counter() - t


def search(directory: str, queries: dict[str, str], aggregate: str = "max") -> dict[str, dict[str, float]]:
    from twotower.retrieval import SearchPipeline

    qids = list(queries)
    with SearchPipeline.load(directory, use_default_reranker=False) as pipe:
        hits = pipe.search([queries[q] for q in qids], k=100, recall_k=100, rerank=False, fetch_documents=False,
                           aggregate=aggregate if pipe.passages is not None else None)  # whole documents: refused
    return {q: {h.id: float(h.score) for h in row} for q, row in zip(qids, hits)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data"), help="the staged data folder")
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "long_documents"), help="index cache and results")
    ap.add_argument("--configs", default="truncate,128:96,192:144,254:190",
                    help="comma-separated: 'truncate' or WINDOW:STRIDE in tokens")
    ap.add_argument("--sets", default="scifact,xquad", help="comma-separated: scifact, xquad")
    ap.add_argument("--aggregate", default="max", choices=["max", "sum", "first"])
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    from twotower.common.device import resolve_bf16
    from twotower.eval.io import load_beir
    from twotower.eval.metrics.retrieval import evaluate
    from twotower.indexing import document_text
    from twotower.retrieval import DualEncoder
    from twotower.retrieval.manifest import default_model_dir

    encoder = DualEncoder.from_pretrained(default_model_dir())
    cap = encoder.document_max_length
    configs = args.configs.split(",")
    report = {"machine": machine(), "bf16": resolve_bf16("auto", "cpu"), "model_max_length": cap,
              "command": " ".join(["benchmarks/long_documents.py", *sys.argv[1:]]), "results": {}}
    print(f"# {report['machine']}; bf16 (auto): {report['bf16']}; model max length {cap}", flush=True)

    if "scifact" in args.sets:
        root = os.path.join(args.data, "beir-scifact")
        ds = load_beir(root, "test")
        docs = ds.corpus
        ids = list(docs)
        lengths = encoder.document_tower.tokenizer.lengths(
            [document_text({"title": docs[i].title, "text": docs[i].text}) for i in ids], max_length=1 << 30)
        long_ids = {i for i, n in zip(ids, lengths) if n > cap}
        print(f"scifact: {len(long_ids)} of {len(ids)} abstracts longer than {cap} tokens", flush=True)
        splits = {"train": load_beir(root, "train", corpus=False), "test": ds}
        for config in configs:
            directory = os.path.join(args.out, f"scifact-{config.replace(':', '-')}")
            secs = build(os.path.join(root, "corpus.jsonl"), directory, config, args.batch_size)
            for split, data in splits.items():
                qrels = data.qrels
                queries = {q: data.queries[q] for q in qrels}
                run = search(directory, queries, args.aggregate)
                long_q = {q: r for q, r in qrels.items() if any(d in long_ids and v > 0 for d, v in r.items())}
                all_m = evaluate(run, qrels, "ndcg@10,recall@100").means
                long_m = evaluate(run, long_q, "ndcg@10,recall@100").means if long_q else {}
                row = {"ndcg@10": all_m["ndcg@10"], "recall@100": all_m["recall@100"],
                       "long_ndcg@10": long_m.get("ndcg@10"), "long_queries": len(long_q), "queries": len(qrels),
                       "build_seconds": round(secs, 1)}
                report["results"][f"scifact/{split}/{config}"] = row
                print(f"scifact {split:5s} {config:9s} nDCG@10 {row['ndcg@10']:.4f}  R@100 {row['recall@100']:.4f}  "
                      f"long-evidence claims ({len(long_q)}) nDCG@10 {row['long_ndcg@10'] or 0:.4f}"
                      f"{f'  (built in {secs:.0f} s)' if secs else ''}", flush=True)

    if "xquad" in args.sets:
        corpus, queries, qrels = xquad_articles(os.path.join(args.data, "xquad-en", "xquad.en.json"), args.out)
        for config in configs:
            directory = os.path.join(args.out, f"xquad-{config.replace(':', '-')}")
            secs = build(corpus, directory, config, args.batch_size)
            m = evaluate(search(directory, queries, args.aggregate), qrels, "ndcg@10,recall@10,recall@100").means
            report["results"][f"xquad/{config}"] = {**m, "queries": len(qrels), "build_seconds": round(secs, 1)}
            print(f"xquad-articles {config:9s} nDCG@10 {m['ndcg@10']:.4f}  R@10 {m['recall@10']:.4f}  "
                  f"R@100 {m['recall@100']:.4f}", flush=True)

    path = os.path.join(args.out, f"results-{args.aggregate}.json")
    if os.path.isfile(path):  # runs of other configurations: keep their rows
        with open(path, encoding="utf-8") as f:
            report["results"] = {**json.load(f).get("results", {}), **report["results"]}
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
