"""XQuAD-en end to end: index all 240 paragraphs, ask the held-out questions, read answers from the top passages.

Reports the gold-paragraph retrieval rate (top-1 and top-k) and SQuAD v1.1
EM/F1 of the first answer, for the reader alone on the gold paragraph (an
upper bound) and for retrieve -> read.  The questions are the 10 test articles
of benchmarks/tasks_xquad.py (same seeded split), so the reader never trained
on them; the index holds all 48 articles' paragraphs.

    .venv/bin/python benchmarks/tasks_xquad_answer.py --reader runs/tasks/xquad/xquad -k 3
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from tasks_common import base_parser


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "xquad-answer")
    p.add_argument("--reader", required=True, help="QA checkpoint from benchmarks/tasks_xquad.py")
    p.add_argument("-k", type=int, default=3, help="passages read per question")
    p.add_argument("--reranker", help="optional cross-encoder directory")
    p.add_argument("--hybrid", action="store_true")
    p.add_argument("--split-seed", type=int, default=0)
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from tasks_xquad import article_split

    from encoder.task_model import TaskModel
    from retrieval.cli.task_inputs import qa_metrics
    from retrieval.pipeline import SearchPipeline
    from retrieval.reader import read_answers

    path = os.path.join(args.data, "xquad-en", "xquad.en.json")
    _, _, test, _ = article_split(path, seed=args.split_seed)
    from eval.io import read_squad

    contexts = list(dict.fromkeys(ex.context for ex in read_squad(path)))
    pid = {c: f"p{i}" for i, c in enumerate(contexts)}
    reader = TaskModel.from_pretrained(args.reader)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        corpus = os.path.join(work, "corpus.jsonl")
        with open(corpus, "w", encoding="utf-8") as f:
            for c in contexts:
                f.write(json.dumps({"_id": pid[c], "text": c}) + "\n")
        pipe = SearchPipeline.build(corpus, os.path.join(work, "idx"), reranker=args.reranker,
                                    bm25=args.hybrid, progress=not args.no_progress)
        with pipe:
            hits = pipe.search([ex.question for ex in test], k=args.k, rerank=args.reranker is not None,
                               hybrid=args.hybrid)
    index_seconds = time.perf_counter() - t0
    top1 = sum(h[0].id == pid[ex.context] for ex, h in zip(test, hits)) / len(test)
    topk = sum(any(x.id == pid[ex.context] for x in h) for ex, h in zip(test, hits)) / len(test)
    # reader alone, on the gold paragraph
    oracle = reader.predict(test, batch_size=32)
    # retrieve -> read: the first answer, or "" for "no answer"
    from encoder.qa_decode import QAPrediction

    e2e = []
    for ex, h in zip(test, hits):
        a = read_answers(reader, ex.question, h, max_answers=1)[0]
        e2e.append(QAPrediction(ex.id, a.text, a.start or -1, a.end or -1, a.score, a.null_score, a.no_answer))
    results = {
        "questions": len(test), "paragraphs": len(contexts), "k": args.k, "reranker": args.reranker,
        "hybrid": args.hybrid, "gold_paragraph_top1": top1, f"gold_paragraph_top{args.k}": topk,
        "reader_on_gold_paragraph": qa_metrics(oracle, test), "retrieve_then_read": qa_metrics(e2e, test),
        "no_answer_rate": sum(p.no_answer for p in e2e) / len(e2e),
        "seconds": round(time.perf_counter() - t0, 1), "index_and_search_seconds": round(index_seconds, 1),
    }
    os.makedirs(args.out, exist_ok=True)
    from encoder.atomic import atomic_write_text

    atomic_write_text(os.path.join(args.out, "results.json"), json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
