"""WNUT-17 emerging-entity NER: entity-level F1 (conlleval / seqeval rules) on test.

Official splits: train 3,394 / dev 1,009 / test 1,287 sentences; dev picks the
epoch, test is scored once per seed.  Words are labelled on their first
WordPiece; a cross-check against seqeval is recorded when it is installed.

    .venv/bin/python benchmarks/tasks_wnut.py --epochs 4
"""

from __future__ import annotations

import os

from tasks_common import base_parser, run, seeds_of


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "wnut17")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--freeze-encoder", action="store_true")
    args = p.parse_args()

    from twotower.encoder.finetuning.finetune import FinetuneConfig
    from twotower.eval.metrics import tagging_report
    from twotower.eval.tasks import read_tag_examples, tag_metrics

    d = os.path.join(args.data, "wnut17")
    train = read_tag_examples(os.path.join(d, "wnut17train.conll"))
    dev = read_tag_examples(os.path.join(d, "emerging.dev.conll"))
    test = read_tag_examples(os.path.join(d, "emerging.test.annotated"))

    def detail(preds, examples):
        gold, pred = [ex.tags for ex in examples], [p.tags for p in preds]
        r = tagging_report(gold, pred)
        out = {"precision": r.precision, "recall": r.recall, "f1": r.f1, "per_type": r.per_type,
               "token_accuracy": r.token_accuracy}
        try:
            from seqeval.metrics import f1_score

            out["seqeval_f1"] = f1_score(gold, pred)
        except ImportError:
            pass
        return out

    cfg = FinetuneConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, max_length=args.max_length,
                         freeze_encoder=args.freeze_encoder, seeds=seeds_of(args.seeds), metric="f1",
                         progress=not args.no_progress)
    run("wnut17" + ("-frozen" if args.freeze_encoder else ""), "tag", args, train, dev, test, cfg, tag_metrics,
        detail)


if __name__ == "__main__":
    main()
