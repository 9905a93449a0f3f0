"""XQuAD-en extractive QA: split by article (seeded, 38 train / 10 test), SQuAD v1.1 EM/F1 on held-out articles.

XQuAD-en is 1,190 SQuAD v1.1 dev questions over 240 paragraphs of 48 articles.
Articles, not questions, are split so no test paragraph was seen in training;
4 of the 38 training articles are held out again as dev (epoch selection).
Contexts are cut into windows of --max-length tokens overlapping by
--doc-stride; answers are chosen over all windows of a question.

    .venv/bin/python benchmarks/tasks_xquad.py --epochs 3 --max-length 192 --doc-stride 64
"""

from __future__ import annotations

import os

from tasks_common import base_parser, run, seeds_of


def article_split(path: str, n_train: int = 38, n_dev: int = 4, seed: int = 0):
    """(train, dev, test) QAExample lists and the article titles of each."""
    import numpy as np

    from twotower.eval.io import read_squad
    from twotower.eval.tasks import read_qa_examples

    titles = list(dict.fromkeys(ex.title for ex in read_squad(path)))
    examples = read_qa_examples(path)  # offsets checked
    title_of = {ex.id: ex.title for ex in read_squad(path)}
    order = [titles[i] for i in np.random.default_rng(seed).permutation(len(titles))]
    train_t, test_t = order[:n_train], order[n_train:]
    dev_t, train_t = train_t[:n_dev], train_t[n_dev:]
    pick = lambda ts: [ex for ex in examples if title_of[ex.id] in set(ts)]  # noqa: E731
    return pick(train_t), pick(dev_t), pick(test_t), {"train": train_t, "dev": dev_t, "test": test_t}


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "xquad")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=192)
    p.add_argument("--doc-stride", type=int, default=64)
    p.add_argument("--max-answer-length", type=int, default=30)
    p.add_argument("--split-seed", type=int, default=0)
    args = p.parse_args()

    from twotower.encoder.finetuning.finetune import FinetuneConfig
    from twotower.eval.tasks import qa_metrics

    path = os.path.join(args.data, "xquad-en", "xquad.en.json")
    train, dev, test, articles = article_split(path, seed=args.split_seed)

    def detail(preds, examples):
        wrong = [(p, ex) for p, ex in zip(preds, examples) if p.answer not in [t for t, _ in ex.answers]]
        return {**qa_metrics(preds, examples), "examples": [
            {"question": ex.question, "gold": [t for t, _ in ex.answers][:3], "pred": p.answer}
            for p, ex in wrong[:15]]}

    cfg = FinetuneConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, max_length=args.max_length,
                         doc_stride=args.doc_stride, max_answer_length=args.max_answer_length,
                         seeds=seeds_of(args.seeds), metric="f1", eval_batch_size=64, progress=not args.no_progress)
    run("xquad", "qa", args, train, dev, test, cfg, qa_metrics, detail,
        extra={"articles": articles, "questions": {"train": len(train), "dev": len(dev), "test": len(test)}})


if __name__ == "__main__":
    main()
