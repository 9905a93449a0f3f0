"""Does MLM pretraining help downstream?  SST-2 with a frozen encoder + a linear head: pretrained vs random init.

The same architecture (read from the checkpoint's config.json) is used twice: with the pretrained weights
and with BERT's random initialisation (several seeds).  Sentence features are the mean of the final hidden
states over real tokens (frozen encoder, no gradient).  A logistic-regression head is trained on a sample of
`train.tsv`; its L2 strength is chosen on `dev.tsv` (the held-out 10% of GLUE train); accuracy is reported
on `test.tsv` (the public GLUE dev set, 872 sentences).

    .venv/bin/python benchmarks/mlm_downstream_sst2.py --model runs/mlm-mini-30m --train-size 4000
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from twotower.encoder.core.checkpoint import load_encoder
from twotower.encoder.core.model import BertModel

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def read_tsv(path: str, limit: int | None = None, seed: int = 0) -> tuple[list[str], np.ndarray]:
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if limit and limit < len(rows):
        idx = np.random.default_rng(seed).choice(len(rows), limit, replace=False)
        rows = [rows[i] for i in sorted(idx)]
    return [r["sentence"].strip() for r in rows], np.asarray([int(r["label"]) for r in rows])


@torch.no_grad()
def features(model: BertModel, tok, texts: list[str], batch: int = 64, max_length: int = 64) -> np.ndarray:
    model.eval()
    out = []
    for i in range(0, len(texts), batch):
        b = tok.encode(texts[i:i + batch], max_length=max_length)
        h, _ = model(b.input_ids, attention_mask=b.attention_mask, token_type_ids=b.token_type_ids,
                     return_pooled=False)  # (B, T, H)
        m = b.attention_mask.unsqueeze(-1).float()
        out.append(((h * m).sum(1) / m.sum(1)).numpy())  # (B, H) mean over real tokens
    return np.concatenate(out)


def fit_logreg(x: np.ndarray, y: np.ndarray, l2: float, steps: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-regularised logistic regression by L-BFGS on standardised features."""
    xt, yt = torch.from_numpy(x).float(), torch.from_numpy(y).float()
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xt @ w + b, yt) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def accuracy(w, b, x, y) -> float:
    return float((((torch.from_numpy(x).float() @ w + b) > 0).numpy() == y.astype(bool)).mean())


def evaluate(model, tok, data) -> dict:
    (xtr, ytr), (xdv, ydv), (xte, yte) = [(features(model, tok, t), y) for t, y in data]
    mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
    xtr, xdv, xte = (xtr - mu) / sd, (xdv - mu) / sd, (xte - mu) / sd
    best = max((accuracy(*fit_logreg(xtr, ytr, l2), xdv, ydv), l2) for l2 in (1e-4, 1e-3, 1e-2, 1e-1))
    w, b = fit_logreg(xtr, ytr, best[1])
    return {"dev_accuracy": best[0], "l2": best[1], "test_accuracy": accuracy(w, b, xte, yte)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a pretrained checkpoint directory (ours or any HF BERT)")
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--train-size", type=int, default=4000)
    ap.add_argument("--dev-size", type=int, default=1000)
    ap.add_argument("--random-seeds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    d = os.path.join(args.data, "sst2")
    data = [read_tsv(os.path.join(d, "train.tsv"), args.train_size), read_tsv(os.path.join(d, "dev.tsv"),
                                                                             args.dev_size),
            read_tsv(os.path.join(d, "test.tsv"))]
    t = time.time()
    model, tok = load_encoder(args.model)
    result = {"model": args.model, "train_size": len(data[0][0]), "dev_size": len(data[1][0]),
              "test_size": len(data[2][0]), "pretrained": evaluate(model, tok, data), "random": []}
    for seed in range(args.random_seeds):
        torch.manual_seed(seed)
        result["random"].append(evaluate(BertModel(model.config, add_pooling_layer=False), tok, data))
    rnd = [r["test_accuracy"] for r in result["random"]]
    result["random_test_mean"], result["random_test_std"] = float(np.mean(rnd)), float(np.std(rnd))
    result["seconds"] = time.time() - t
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
