"""The peer side of the quality-under-a-budget benchmark: transformers.BertForMaskedLM for a wall-clock budget.

What the peer gets (its reasonable defaults, stated in docs/results.md): `BertConfig` with our size's
dimensions and HF's default dropout 0.1, fp32 (HF Trainer on a CPU without a bf16 flag), run_mlm.py's
group_texts blocks of 128 tokens and `DataCollatorForLanguageModeling(mlm_probability=0.15)`, full-vocabulary
logits.  It also gets our optimizer settings, which are kinder than run_mlm.py's defaults for training from
scratch: AdamW without decay on bias/LayerNorm, the same peak lr, batch, 6% warmup and linear decay keyed to
the same wall-clock budget, gradient clip 1.0.  Validation uses exactly our fixed validation set
(`twotower.encoder.pretraining.pretrain_data.validation_batches`: 15% masks, seed 0) so the numbers compare with our run's log.

    .venv/bin/python benchmarks/mlm_peer_budget.py --budget 30m --out runs/mlm-peer-30m
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from mlm_throughput import hf_blocks  # noqa: E402

from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.tokenizer import Tokenizer
from twotower.encoder.pretraining.corpus import tokenize_corpus
from twotower.encoder.pretraining.masking import TokenSpace
from twotower.encoder.pretraining.pretrain_data import PackedRows, validation_batches
from twotower.encoder.training.budget import parse_duration
from twotower.encoder.training.optim import lr_factor, make_optimizer, set_lr

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


@torch.no_grad()
def evaluate(model, valid) -> dict:
    model.eval()
    loss = correct = count = 0.0
    for b in valid:
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
        keep = b.labels != -100
        lg, lb = logits[keep].float(), b.labels[keep]
        loss += torch.nn.functional.cross_entropy(lg, lb, reduction="sum").item()
        correct += int((lg.argmax(-1) == lb).sum())
        count += int(keep.sum())
    model.train()
    return {"mlm_accuracy": correct / count, "mlm_loss": loss / count, "perplexity": float(np.exp(loss / count)),
            "targets": int(count)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--tokenizer", default="runs/mlm-tok16k")
    ap.add_argument("--size", default="mini")
    ap.add_argument("--budget", default="30m")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--valid-rows", type=int, default=256)
    ap.add_argument("--evals", type=int, default=5)
    ap.add_argument("--cache-dir", default="runs/.cache")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from transformers import (
        BertConfig,
        BertForMaskedLM,
        DataCollatorForLanguageModeling,
        PreTrainedTokenizerFast,
    )

    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    total = parse_duration(args.budget)
    tok = Tokenizer.from_pretrained(args.tokenizer)
    gut = os.path.join(args.data, "gutenberg-en-mlm")
    corpus = tokenize_corpus([os.path.join(gut, "train.txt.gz")], tok, args.cache_dir)
    corpus.meta_paths = [os.path.join(gut, "train.txt.gz")]
    vcorpus = tokenize_corpus([os.path.join(gut, "valid.txt.gz")], tok, args.cache_dir)
    valid = validation_batches(PackedRows(vcorpus, args.seq_len, tok), TokenSpace.from_tokenizer(tok),
                               args.batch_size, args.valid_rows)
    c = EncoderConfig.named(args.size, tok.vocab_size)
    model = BertForMaskedLM(BertConfig(vocab_size=tok.vocab_size, hidden_size=c.hidden_size,
                                       num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                                       intermediate_size=c.intermediate_size, pad_token_id=tok.pad_id))
    opt = make_optimizer(model, args.lr)
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(args.tokenizer, "tokenizer.json"),
                                     unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                                     mask_token="[MASK]")
    collator = DataCollatorForLanguageModeling(tokenizer=hf_tok, mlm_probability=0.15, return_tensors="pt")
    # Enough blocks for ~4x the tokens the peer can see in the budget on this kind of machine.
    blocks = hf_blocks(corpus, tok, args.seq_len, int(max(2e6, total * 4000)))
    perm = np.random.default_rng(0).permutation(len(blocks))
    log = open(os.path.join(args.out, "log.jsonl"), "w", encoding="utf-8")
    t0, step, tokens, next_eval = time.monotonic(), 0, 0, 1
    model.train()
    while (elapsed := time.monotonic() - t0) < total:
        set_lr(opt, args.lr, lr_factor(elapsed / total))
        i = (step * args.batch_size) % (len(perm) - args.batch_size)
        batch = collator([{"input_ids": blocks[j].tolist()} for j in perm[i:i + args.batch_size]])
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += int(batch["input_ids"].numel())
        rec = {"type": "train", "step": step, "tokens": tokens, "loss": out.loss.item(), "elapsed": elapsed}
        log.write(json.dumps(rec) + "\n")
        if (time.monotonic() - t0) / total >= next_eval / args.evals and next_eval < args.evals:
            next_eval += 1
            log.write(json.dumps({"type": "valid", "step": step, "tokens": tokens, **evaluate(model, valid)}) + "\n")
        log.flush()
    final = {"type": "valid", "step": step, "tokens": tokens, **evaluate(model, valid)}
    log.write(json.dumps(final) + "\n")
    log.close()
    summary = {"steps": step, "tokens": tokens, "elapsed_s": time.monotonic() - t0, "valid": final}
    with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
