"""Our side of benchmarks/mlm_throughput.py alone: train N steps, report validation MLM accuracy and perplexity.

The library is imported from the *current directory*, so one script measures two versions of the code
(here: this one and commit 9fabf42), to show a speed change did not change what is learned:

    .venv/bin/python benchmarks/mlm_ours_quality.py --steps 101 --seed 0
    git worktree add /tmp/s4 9fabf42 && ln -s "$PWD/runs" /tmp/s4/runs
    (cd /tmp/s4 && "$OLDPWD/.venv/bin/python" "$OLDPWD/benchmarks/mlm_ours_quality.py" --steps 101 --seed 0)

Data order, masking, optimizer, schedule (over --steps) and the validation set are those of the throughput
benchmark's ours side run with ``--steps 100 --warmup-steps 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.getcwd())

from twotower.common.device import autocast, resolve_bf16
from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.tokenizer import Tokenizer
from twotower.encoder.pretraining.corpus import tokenize_corpus
from twotower.encoder.pretraining.masking import MaskingSpec, TokenSpace
from twotower.encoder.pretraining.mlm import BertForPreTraining
from twotower.encoder.pretraining.pretrain_data import BatchMaker, PackedRows, RowOrder, validation_batches
from twotower.encoder.training.optim import lr_factor, make_optimizer, set_lr

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=101)
    ap.add_argument("--seed", type=int, default=0, help="torch seed: initial weights and dropout")
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--tokenizer", default="runs/mlm-tok16k")
    ap.add_argument("--cache-dir", default="runs/.cache")
    ap.add_argument("--lr", type=float, default=5e-4)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    d = os.path.join(args.data, "gutenberg-en-mlm")
    tok = Tokenizer.from_pretrained(args.tokenizer)
    rows = PackedRows(tokenize_corpus([os.path.join(d, "train.txt.gz")], tok, args.cache_dir), 128, tok)
    space = TokenSpace.from_tokenizer(tok)
    maker = BatchMaker(rows, space, MaskingSpec(), seed=0)
    order = RowOrder(len(rows), seed=0)
    vrows = PackedRows(tokenize_corpus([os.path.join(d, "valid.txt.gz")], tok, args.cache_dir), 128, tok)
    valid = validation_batches(vrows, space, 64, 256)
    model = BertForPreTraining(EncoderConfig.named("mini", tok.vocab_size, pad_token_id=tok.pad_id))
    opt = make_optimizer(model, args.lr)
    bf16 = resolve_bf16("auto", "cpu")

    t0 = time.perf_counter()
    for i in range(args.steps):
        set_lr(opt, args.lr, lr_factor(i / args.steps))
        (idx, epoch, off), = order.next_step(64, 1)
        batch = maker.make(idx, epoch, off)
        with autocast("cpu", bf16):
            out = model(**batch.model_inputs())
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - t0

    model.eval()
    correct = count = 0
    loss = 0.0
    with torch.no_grad():
        for b in valid:
            with autocast("cpu", bf16):
                o = model(input_ids=b.input_ids, labels=b.labels, attention_mask=b.attention_mask,
                          document_ids=b.document_ids)
            lg, lb = o.logits.float(), o.targets
            loss += torch.nn.functional.cross_entropy(lg, lb, reduction="sum").item()
            correct += int((lg.argmax(-1) == lb).sum())
            count += lb.numel()
    print(json.dumps({"code": os.getcwd(), "steps": args.steps, "seed": args.seed, "mlm_accuracy": correct / count,
                      "perplexity": float(np.exp(loss / count)), "targets": count,
                      "train_tokens_per_s": args.steps * 64 * 128 / seconds}))


if __name__ == "__main__":
    main()
