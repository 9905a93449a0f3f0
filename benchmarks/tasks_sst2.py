"""SST-2 sentiment: full fine-tuning vs a frozen encoder on the same split, 3 seeds each.

Splits (see shared/data/sst2/SOURCE.md): train.tsv and dev.tsv are the GLUE
train set split 90/10; test.tsv is the GLUE dev set (872 sentences), used only
for reporting.  To fit a shared 2-core CPU the training set is subsampled
(--max-train, seeded, the same subset for every seed and for both modes), dev
is subsampled for epoch selection (--max-dev), and max_length is 64.

    .venv/bin/python benchmarks/tasks_sst2.py --modes full,frozen --max-train 20000 --epochs 1
"""

from __future__ import annotations

import os

from tasks_common import base_parser, run, seeds_of, subsample


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "sst2")
    p.add_argument("--modes", default="full,frozen")
    p.add_argument("--max-train", type=int, default=20000)
    p.add_argument("--max-dev", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--frozen-epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--frozen-lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--evals-per-epoch", type=int, default=2)
    args = p.parse_args()

    from twotower.encoder.finetuning.finetune import FinetuneConfig
    from twotower.eval.metrics import classification_report, misclassified
    from twotower.eval.tasks import classify_metrics, read_text_examples

    d = os.path.join(args.data, "sst2")
    train = subsample(read_text_examples(os.path.join(d, "train.tsv")), args.max_train)
    dev = subsample(read_text_examples(os.path.join(d, "dev.tsv")), args.max_dev)
    test = read_text_examples(os.path.join(d, "test.tsv"))

    def detail(preds, examples):
        r = classification_report([ex.label for ex in examples], [p.label for p in preds])
        wrong = misclassified([ex.label for ex in examples], [p.label for p in preds])
        return {"per_class": r.per_class(), "accuracy": r.accuracy, "table": r.format(),
                "misclassified": [{"text": examples[i].text, "gold": examples[i].label, "pred": preds[i].label,
                                   "p": round(preds[i].score, 3)} for i in wrong[:15]]}

    for mode in args.modes.split(","):
        frozen = mode == "frozen"
        cfg = FinetuneConfig(
            epochs=args.frozen_epochs if frozen else args.epochs, batch_size=args.batch_size,
            lr=args.frozen_lr if frozen else args.lr, freeze_encoder=frozen, max_length=args.max_length,
            seeds=seeds_of(args.seeds), evals_per_epoch=1 if frozen else args.evals_per_epoch,
            metric="accuracy", progress=not args.no_progress,
        )
        run(f"sst2-{mode}" + ("" if args.init == "pretrained" else "-random"), "classify", args, train, dev, test,
            cfg, classify_metrics, detail)


if __name__ == "__main__":
    main()
