"""TREC question classification (6 coarse classes by default): accuracy and the per-class table.

TREC has no dev set: 10% of train is carved off (seeded) for epoch selection;
test (500 questions) is scored once per seed.

    .venv/bin/python benchmarks/tasks_trec.py --epochs 3
"""

from __future__ import annotations

import os

from tasks_common import base_parser, run, seeds_of


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "trec")
    p.add_argument("--label-column", default="label_coarse", choices=("label_coarse", "label_fine"))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--freeze-encoder", action="store_true")
    args = p.parse_args()

    from twotower.encoder.finetuning.finetune import FinetuneConfig
    from twotower.encoder.finetuning.task_examples import build_label_map, carve_dev
    from twotower.eval.metrics import classification_report, misclassified
    from twotower.eval.tasks import classify_metrics, read_text_examples

    d = os.path.join(args.data, "trec-qc")
    train = read_text_examples(os.path.join(d, "train.tsv"), label_column=args.label_column)
    train, dev = carve_dev("classify", train, 0.1, seed=0)
    test = read_text_examples(os.path.join(d, "test.tsv"), label_column=args.label_column)
    # every class, in the run's label order, for the per-class table
    labels = build_label_map([ex.label for ex in train + dev])

    def detail(preds, examples):
        r = classification_report([ex.label for ex in examples], [p.label for p in preds], labels=labels)
        wrong = misclassified([ex.label for ex in examples], [p.label for p in preds])
        return {"per_class": r.per_class(), "table": r.format(), "confusion": r.confusion.tolist(),
                "labels": labels, "misclassified": [{"text": examples[i].text, "gold": examples[i].label,
                                                     "pred": preds[i].label} for i in wrong[:20]]}

    cfg = FinetuneConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, max_length=args.max_length,
                         freeze_encoder=args.freeze_encoder, seeds=seeds_of(args.seeds), metric="accuracy",
                         progress=not args.no_progress)
    name = "trec-" + args.label_column.split("_")[1] + ("-frozen" if args.freeze_encoder else "")
    run(name, "classify", args, train, dev, test, cfg, classify_metrics, detail)


if __name__ == "__main__":
    main()
