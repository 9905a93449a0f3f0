"""Does our MLM pretraining help SST-2?  Pretrained vs the same architecture randomly initialised, each at its own
dev-chosen learning rate.

A fixed learning rate favours whichever side it happens to suit (a barely-pretrained encoder and a random one
need not like the same step size), so each side picks its lr from ``--lrs`` by seed 0's best dev accuracy; the
chosen lr is then run with the remaining seeds and test (GLUE dev, 872 sentences) is reported as mean ± sample std
over all seeds.  Splits, subsampling and everything else are those of ``tasks_sst2.py`` (full fine-tuning).

    .venv/bin/python benchmarks/sst2_pretraining_gain.py --model runs/mlm-mini-2h --out runs/tasks/sst2-gain-2h

``--poolings cls,mean`` widens each side's dev grid to lr x classifier pooling ([CLS] pooler or the mean of token
states, encoder.heads); the pair with the best dev accuracy is then run with the other seeds.

``--dev sentences`` chooses on whole held-out sentences instead of dev.tsv's phrases, 88.6 % of which are spans of
train phrases (sst2_splits.py); ``--select-seeds 3`` scores each grid point by its mean dev accuracy over the
first three seeds instead of seed 0 alone (a 678-sentence dev has a standard error of ~1.5 points).

The random side reads only the checkpoint's config and tokenizer; ``--sides random`` runs it alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

from sst2_splits import sentence_dev
from tasks_common import REPO, base_parser, run, seeds_of, subsample


def run_name(init: str, pooling: str, lr: float) -> str:
    """Folder of one grid point; [CLS] runs keep the names they had before the pooling option."""
    return f"{init}-lr{lr:g}" if pooling == "cls" else f"{init}-{pooling}-lr{lr:g}"


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "sst2-gain")
    p.add_argument("--lrs", default="3e-5,1e-4,3e-4,1e-3", help="the grid each side chooses from on dev")
    p.add_argument("--poolings", default="cls", help="classifier poolings each side also chooses from on dev")
    p.add_argument("--max-train", type=int, default=20000)
    p.add_argument("--max-dev", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--evals-per-epoch", type=int, default=2)
    p.add_argument("--dev", choices=("phrases", "sentences"), default="phrases",
                   help="phrases: dev.tsv as given; sentences: its whole sentences, their pieces removed from train")
    p.add_argument("--select-seeds", type=int, default=1,
                   help="each grid point runs this many seeds and is chosen by their mean dev accuracy")
    p.add_argument("--sides", default="pretrained,random",
                   help="run only some sides; each lands in <out>/<side>.json and the gain is computed "
                        "once both are there (so the random side can run before the checkpoint exists)")
    args = p.parse_args()
    if args.model == "minilm":
        p.error("--model must be our pretrained checkpoint directory")

    from twotower.common.atomic import atomic_write_text
    from twotower.encoder.finetuning.finetune import FinetuneConfig
    from twotower.eval.tasks import classify_metrics, read_text_examples

    d = os.path.join(args.data, "sst2")
    train = read_text_examples(os.path.join(d, "train.tsv"))
    dev = read_text_examples(os.path.join(d, "dev.tsv"))
    if args.dev == "sentences":
        train, dev = sentence_dev(train, dev)
    train, dev = subsample(train, args.max_train), subsample(dev, args.max_dev)
    test = read_text_examples(os.path.join(d, "test.tsv"))
    seeds = seeds_of(args.seeds)
    if not 1 <= args.select_seeds <= len(seeds):
        p.error(f"--select-seeds must be between 1 and the number of --seeds ({len(seeds)})")
    pick = args.select_seeds
    lrs = [float(x) for x in args.lrs.split(",")]
    poolings = [x.strip() for x in args.poolings.split(",") if x.strip()]
    if not poolings or any(x not in ("cls", "mean") for x in poolings):
        p.error(f"--poolings: choose from cls, mean (got {args.poolings!r})")
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        architecture = {k: v for k, v in json.load(f).items() if k != "architectures"}  # both sides: the same

    def one(init: str, lr: float, pooling: str, run_seeds: tuple[int, ...], name: str) -> dict:
        cfg = FinetuneConfig(epochs=args.epochs, batch_size=args.batch_size, lr=lr, max_length=args.max_length,
                             seeds=run_seeds, evals_per_epoch=args.evals_per_epoch, metric="accuracy",
                             # None for cls: the value older results.json files hold, so they are reused
                             progress=not args.no_progress, pooling=None if pooling == "cls" else pooling)
        done = os.path.join(args.out, name, "results.json")
        if os.path.isfile(done):  # runs are deterministic: reuse one made with the same settings and data
            with open(done, encoding="utf-8") as f:
                old = json.load(f)
            want = json.loads(json.dumps(dataclasses.asdict(cfg)))  # tuples -> lists, as stored
            same = all(old["config"].get(k) == v for k, v in want.items() if k not in ("progress", "bf16"))
            if same and old["counts"] == {"train": len(train), "dev": len(dev), "test": len(test),
                                          "train_rows": len(train)} and old["model"] == args.model \
                    and old.get("dev_split", "phrases") == args.dev:
                print(f"reusing {done}")
                return old
        ns = argparse.Namespace(**{**vars(args), "init": init})
        return run(name, "classify", ns, train, dev, test, cfg, classify_metrics, extra={"dev_split": args.dev})

    for init in args.sides.split(","):
        if init not in ("pretrained", "random"):
            p.error(f"--sides: unknown side {init!r}")
        grid = [(pool, lr) for pool in poolings for lr in lrs]
        sweep = {g: one(init, g[1], g[0], seeds[:pick], run_name(init, *g) + ("" if pick == 1 else f"-x{pick}"))
                 for g in grid}
        dev_acc = {g: statistics.mean(s["dev"]["accuracy"] for s in r["per_seed"]) for g, r in sweep.items()}
        pooling, lr = max(grid, key=lambda g: dev_acc[g])  # first of equals: the grid's order
        per_seed = list(sweep[(pooling, lr)]["per_seed"])
        if len(seeds) > pick:
            per_seed += one(init, lr, pooling, seeds[pick:], f"{run_name(init, pooling, lr)}-seeds")["per_seed"]
        test_acc = [s["test"]["accuracy"] for s in per_seed]
        side = {
            "model": args.model, "counts": {"train": len(train), "dev": len(dev), "test": len(test)},
            "epochs": args.epochs, "lrs": lrs, "seeds": list(seeds), "batch_size": args.batch_size,
            "max_length": args.max_length, "evals_per_epoch": args.evals_per_epoch, "architecture": architecture,
            "poolings": poolings, "chosen_pooling": pooling, "dev_split": args.dev, "select_seeds": pick,
            "dev_accuracy_by_lr": {(f"{lr_:g}" if pool == "cls" else f"{pool} {lr_:g}"): v
                                   for (pool, lr_), v in dev_acc.items()}, "chosen_lr": lr,
            "test_accuracy_per_seed": test_acc, "dev_accuracy_per_seed": [s["dev"]["accuracy"] for s in per_seed],
            "test_mean": statistics.mean(test_acc),
            "test_std": statistics.stdev(test_acc) if len(test_acc) > 1 else 0.0,
        }
        atomic_write_text(os.path.join(args.out, f"{init}.json"), json.dumps(side, indent=2) + "\n")
    sides = {}
    for init in ("pretrained", "random"):
        path = os.path.join(args.out, f"{init}.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                sides[init] = json.load(f)
    for init, s in sides.items():
        dev_by_lr = ", ".join(f"{k}: {v:.4f}" for k, v in s["dev_accuracy_by_lr"].items())
        chose_on = ",".join(str(x) for x in s["seeds"][:s.get("select_seeds", 1)])
        print(f"| {init} | dev (seeds {chose_on}) {dev_by_lr} | {s.get('chosen_pooling', 'cls')} lr {s['chosen_lr']:g} | "
              f"test {s['test_mean']:.4f} ± {s['test_std']:.4f} ({len(s['test_accuracy_per_seed'])} seeds) |")
    if len(sides) < 2:
        return
    setting = {"counts": None, "epochs": None, "lrs": None, "seeds": None, "batch_size": None, "max_length": None,
               "evals_per_epoch": None, "architecture": None, "poolings": ["cls"], "dev_split": "phrases",
               "select_seeds": 1}  # older side files lack the later keys: their defaults
    if any(sides["pretrained"].get(k, v) != sides["random"].get(k, v) for k, v in setting.items()):
        raise SystemExit(f"the two sides in {args.out} ran with different settings ({', '.join(setting)})")
    gain = sides["pretrained"]["test_mean"] - sides["random"]["test_mean"]
    result = {**sides, "gain_points": 100 * gain}
    atomic_write_text(os.path.join(args.out, "gain.json"), json.dumps(result, indent=2) + "\n")
    print(f"pretrained - random: {100 * gain:+.2f} points  ({os.path.relpath(args.out, REPO)}/gain.json)")


if __name__ == "__main__":
    main()
