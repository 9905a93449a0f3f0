"""XQuAD-en end to end: index all 240 paragraphs, ask the held-out questions, read answers from the top passages.

Reports the gold-paragraph retrieval rate (top-1 and top-k) and SQuAD v1.1
EM/F1 of the first answer, for the reader alone on the gold paragraph (an
upper bound) and for retrieve -> read (`SearchPipeline.answer`).  The questions
are the 10 test articles of benchmarks/tasks_xquad.py (same seeded split), so
the reader never trained on them; the index holds all 48 articles' paragraphs.

Answers from different passages are ranked by span score alone (DrQA) and by
span score + w * passage score (BERTserini), w chosen on the 4 dev articles'
questions from ``--weights`` (best dev F1, the smaller w on ties); test is
reported for w = 0 and for the chosen w.  Every passage is read once; the
weights only re-rank those answers (`twotower.retrieval.reader.rank_answers`).

    .venv/bin/python benchmarks/tasks_xquad_answer.py --reader runs/tasks/xquad/xquad -k 3
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from tasks_common import base_parser

WEIGHTS = "0,0.5,1,2,5,10,20,50,100"


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "xquad-answer")
    p.add_argument("--reader", required=True, help="QA checkpoint from benchmarks/tasks_xquad.py")
    p.add_argument("-k", type=int, default=3, help="passages read per question")
    p.add_argument("--reranker", help="optional cross-encoder directory")
    p.add_argument("--hybrid", action="store_true")
    p.add_argument("--split-seed", type=int, default=0)
    p.add_argument("--weights", default=WEIGHTS, help="retrieval weights tried on dev")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from tasks_xquad import article_split

    from twotower.encoder.finetuning.qa_decode import QAPrediction
    from twotower.encoder.finetuning.task_model import TaskModel
    from twotower.eval.io import read_squad
    from twotower.eval.tasks import qa_metrics
    from twotower.retrieval.pipeline import SearchPipeline
    from twotower.retrieval.reader import rank_answers

    path = os.path.join(args.data, "xquad-en", "xquad.en.json")
    _, dev, test, _ = article_split(path, seed=args.split_seed)
    contexts = list(dict.fromkeys(ex.context for ex in read_squad(path)))
    pid = {c: f"p{i}" for i, c in enumerate(contexts)}
    reader = TaskModel.from_pretrained(args.reader)
    weights = [float(w) for w in args.weights.split(",")]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        corpus = os.path.join(work, "corpus.jsonl")
        with open(corpus, "w", encoding="utf-8") as f:
            for c in contexts:
                f.write(json.dumps({"_id": pid[c], "text": c}) + "\n")
        pipe = SearchPipeline.build(corpus, os.path.join(work, "idx"), reranker=args.reranker,
                                    bm25=args.hybrid, progress=not args.no_progress)
        index_seconds = time.perf_counter() - t0
        with pipe:
            # every passage's best span, read once (weight 0, all k answers kept)
            read = {name: pipe.answer([ex.question for ex in split], reader, k=args.k, max_answers=args.k,
                                      rerank=args.reranker is not None, hybrid=args.hybrid)
                    for name, split in (("dev", dev), ("test", test))}

    def first_answers(split, results, w):
        out = []
        for ex, r in zip(split, results):
            ranked = rank_answers(r.answers, w) if not r.best.no_answer else [r.best]
            a = ranked[0]
            out.append(QAPrediction(ex.id, a.text, a.start if a.start is not None else -1,
                                    a.end if a.end is not None else -1, a.score, a.null_score, a.no_answer))
        return out

    def gold_rates(split, results):
        top1 = sum(r.hits[0].id == pid[ex.context] for ex, r in zip(split, results)) / len(split)
        topk = sum(any(h.id == pid[ex.context] for h in r.hits) for ex, r in zip(split, results)) / len(split)
        return top1, topk

    dev_by_w = {w: qa_metrics(first_answers(dev, read["dev"], w), dev) for w in weights}
    chosen = max(weights, key=lambda w: (dev_by_w[w]["f1"], -w))
    top1, topk = gold_rates(test, read["test"])
    e2e = first_answers(test, read["test"], 0.0)
    results = {
        "questions": len(test), "dev_questions": len(dev), "paragraphs": len(contexts), "k": args.k,
        "reranker": args.reranker, "hybrid": args.hybrid, "gold_paragraph_top1": top1,
        f"gold_paragraph_top{args.k}": topk, "dev_gold_paragraph_top1_topk": gold_rates(dev, read["dev"]),
        "reader_on_gold_paragraph": qa_metrics(reader.predict(test, batch_size=32), test),
        "retrieve_then_read": qa_metrics(e2e, test),
        "dev_by_retrieval_weight": {f"{w:g}": m for w, m in dev_by_w.items()},
        "chosen_retrieval_weight": chosen,
        "retrieve_then_read_weighted": qa_metrics(first_answers(test, read["test"], chosen), test),
        "no_answer_rate": sum(x.no_answer for x in e2e) / len(e2e),
        "seconds": round(time.perf_counter() - t0, 1), "index_seconds": round(index_seconds, 1),
    }
    os.makedirs(args.out, exist_ok=True)
    from twotower.common.atomic import atomic_write_text

    atomic_write_text(os.path.join(args.out, "results.json"), json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
