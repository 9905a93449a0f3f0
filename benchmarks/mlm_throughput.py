"""MLM pretraining throughput and quality-at-equal-tokens: ours vs transformers.BertForMaskedLM, same process.

Both sides train the same architecture (default `mini`: 4 layers, hidden 256, 4 heads, ffn 1024, vocab
from the tokenizer, rows of 128, batch 64) from the same seed on the same corpus, with AdamW (no decay on
bias/LayerNorm), linear warmup/decay over the same number of steps and clip 1.0.  Steps alternate in
blocks (ours, peer, ours, ...) so that load from other processes on a shared machine hits both alike.

Ours:  `twotower.encoder.pretraining.mlm.BertForPreTraining` on packed rows ([CLS] piece [SEP], block-diagonal attention only
       in batches that hold a document boundary), dynamic masking, sparse MLM head (gather the ~15%
       targets, then transform + tied decoder), bf16 autocast when `--bf16` says so; in training on CPU
       one fused QKV projection, explicit attention with cheap dropout masks (encoder/core/dropout.py) and
       the few-pass cross-entropy of encoder/pretraining/fused_cross_entropy.py (SDPA serves inference).
Peer:  `transformers.BertForMaskedLM` fed exactly as `run_mlm.py` does by default: the tokenized lines
       ([CLS] line [SEP]) concatenated and cut into 128-token blocks (group_texts, so no padding either),
       `DataCollatorForLanguageModeling(mlm_probability=0.15)`, fp32 (what HF Trainer does on a CPU without
       a bf16 flag), full-vocabulary logits at every position, the model's default attention.

Quality: after the same number of training tokens both models are evaluated on one fixed validation set
(our packed validation rows masked once at 15% with seed 0; both see input_ids + attention_mask).
Each side draws from its own copy of torch's global generator (dropout, the collator's masks), so
neither side's random stream depends on how many numbers the other drew; `--seed` changes the model
inits, data orders, masks and dropout of both sides.

Allocator (`--malloc`, common/malloc.py): `ours` (default) runs each side as it ships — our steps
with the heap retaining freed blocks, as `twotower pretrain` sets it, the peer's with glibc's usual
thresholds; `retain` gives both sides our setting; `default` never touches the allocator.

    .venv/bin/python benchmarks/mlm_throughput.py --steps 40 --block 5
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

from twotower.common.device import autocast, cpu_description, resolve_bf16
from twotower.common.malloc import retain_freed_memory
from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.tokenizer import Tokenizer
from twotower.encoder.pretraining.corpus import tokenize_corpus
from twotower.encoder.pretraining.masking import MaskingSpec, TokenSpace
from twotower.encoder.pretraining.mlm import BertForPreTraining
from twotower.encoder.pretraining.pretrain_data import BatchMaker, PackedRows, RowOrder, validation_batches
from twotower.encoder.training.optim import lr_factor, make_optimizer, set_lr

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def hf_blocks(corpus, tok: Tokenizer, seq_len: int, max_lines_tokens: int) -> np.ndarray:
    """run_mlm.py group_texts: per-line [CLS] ids [SEP], concatenated, cut into seq_len blocks."""
    # Lines are not kept in our cache, so rebuild them from the text (first max_lines_tokens tokens).
    from twotower.encoder.pretraining.corpus import read_documents

    stream: list[int] = []
    for path in corpus.meta_paths:
        for doc in read_documents(path):
            for ids in tok.encode_ids(doc):
                stream += [tok.cls_id, *ids, tok.sep_id]
            if len(stream) >= max_lines_tokens:
                break
        if len(stream) >= max_lines_tokens:
            break
    n = len(stream) // seq_len
    return np.asarray(stream[: n * seq_len], dtype=np.int64).reshape(n, seq_len)


# Buckets of self CPU time (torch.profiler op names), to see what a training step spends outside matmuls.
BUCKETS = (
    ("fused attention", ("flash_attention",)),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("dropout RNG", ("bernoulli", "native_dropout", "aten::random_")),
    ("copies and dtype casts", ("aten::copy_", "aten::_to_copy")),
    ("softmax / loss", ("softmax", "nll_loss", "cross_entropy")),
)


def bucket_of(name: str) -> str:
    for bucket, keys in BUCKETS:
        if any(name == k or (not k.startswith("aten::") and k in name) for k in keys):
            return bucket
    return "other (element-wise, norms, indexing)"


def profile_steps(step, indices) -> dict:
    """Self CPU time per bucket over some training steps (ms per step)."""
    from torch.profiler import ProfilerActivity, profile

    indices = list(indices)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in indices:
            step(i)
    ms: dict[str, float] = {}
    ops: dict[str, float] = {}
    for ev in prof.key_averages():
        b = bucket_of(ev.key)
        ms[b] = ms.get(b, 0.0) + ev.self_cpu_time_total / 1000 / len(indices)
        ops[ev.key] = ev.self_cpu_time_total / 1000 / len(indices)
    total = sum(ms.values())
    return {"total_ms": total, "ms": dict(sorted(ms.items(), key=lambda kv: -kv[1])),
            "share": {k: v / total for k, v in sorted(ms.items(), key=lambda kv: -kv[1])},
            "top_ops_ms": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:15])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--tokenizer", default="runs/mlm-tok16k", help="a 16k WordPiece tokenizer directory")
    ap.add_argument("--size", default="mini")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40, help="training steps per side")
    ap.add_argument("--block", type=int, default=5, help="steps per alternation block")
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per side (first-call overheads)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--bf16", default="auto", choices=["auto", "on", "off"], help="our side's autocast")
    ap.add_argument("--valid-rows", type=int, default=256)
    ap.add_argument("--cache-dir", default="runs/.cache")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    ap.add_argument("--seed", type=int, default=0, help="model init, data order, masks and dropout of both sides")
    ap.add_argument("--malloc", default="ours", choices=["ours", "retain", "default"],
                    help="allocator per side (see the module docstring)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after timing, profile STEPS more steps per side and report where the time goes")
    args = ap.parse_args()

    from transformers import (
        BertConfig,
        BertForMaskedLM,
        DataCollatorForLanguageModeling,
        PreTrainedTokenizerFast,
    )

    torch.manual_seed(args.seed)
    train_file = os.path.join(args.data, "gutenberg-en-mlm", "train.txt.gz")
    valid_file = os.path.join(args.data, "gutenberg-en-mlm", "valid.txt.gz")
    tok = Tokenizer.from_pretrained(args.tokenizer)
    corpus = tokenize_corpus([train_file], tok, args.cache_dir, progress=True)
    corpus.meta_paths = [train_file]
    rows = PackedRows(corpus, args.seq_len, tok)
    space = TokenSpace.from_tokenizer(tok)
    maker = BatchMaker(rows, space, MaskingSpec(), seed=args.seed)
    order = RowOrder(len(rows), seed=args.seed)
    vcorpus = tokenize_corpus([valid_file], tok, args.cache_dir)
    valid = validation_batches(PackedRows(vcorpus, args.seq_len, tok), space, args.batch_size, args.valid_rows)

    config = EncoderConfig.named(args.size, tok.vocab_size, pad_token_id=tok.pad_id)
    ours = BertForPreTraining(config)
    ours_opt = make_optimizer(ours, args.lr)
    bf16 = resolve_bf16(True if args.bf16 == "on" else False if args.bf16 == "off" else "auto", "cpu")

    hf_cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=config.hidden_size,
                        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
                        intermediate_size=config.intermediate_size, pad_token_id=tok.pad_id)
    peer = BertForMaskedLM(hf_cfg)
    peer_opt = make_optimizer(peer, args.lr)
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(args.tokenizer, "tokenizer.json"),
                                     unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                                     mask_token="[MASK]")
    collator = DataCollatorForLanguageModeling(tokenizer=hf_tok, mlm_probability=0.15, return_tensors="pt")
    total = args.steps + args.warmup_steps
    blocks = hf_blocks(corpus, tok, args.seq_len, ((total + args.profile) * args.batch_size + 1) * args.seq_len)
    perm = np.random.default_rng(args.seed).permutation(len(blocks))

    stats = {"ours": {"time": 0.0, "tokens": 0, "steps": 0}, "peer": {"time": 0.0, "tokens": 0, "steps": 0}}

    def ours_step(i: int) -> None:
        set_lr(ours_opt, args.lr, lr_factor(i / total))
        t = time.perf_counter()
        (idx, epoch, off), = order.next_step(args.batch_size, 1)
        batch = maker.make(idx, epoch, off)
        with autocast("cpu", bf16):
            out = ours(**batch.model_inputs())
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(ours.parameters(), 1.0)
        ours_opt.step()
        ours_opt.zero_grad(set_to_none=True)
        if i >= args.warmup_steps:
            stats["ours"]["time"] += time.perf_counter() - t
            stats["ours"]["tokens"] += batch.n_tokens
            stats["ours"]["steps"] += 1

    def peer_step(i: int) -> None:
        set_lr(peer_opt, args.lr, lr_factor(i / total))
        t = time.perf_counter()
        sel = perm[i * args.batch_size:(i + 1) * args.batch_size]
        batch = collator([{"input_ids": blocks[j].tolist()} for j in sel])
        out = peer(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=batch["labels"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(peer.parameters(), 1.0)
        peer_opt.step()
        peer_opt.zero_grad(set_to_none=True)
        if i >= args.warmup_steps:
            stats["peer"]["time"] += time.perf_counter() - t
            stats["peer"]["tokens"] += int(batch["input_ids"].numel())
            stats["peer"]["steps"] += 1

    rng = {"ours": torch.get_rng_state(), "peer": torch.get_rng_state()}  # one stream per side
    malloc_retain = {"ours": args.malloc != "default", "peer": args.malloc == "retain"}

    def as_side(side: str):
        """Enter `side`'s random stream and allocator setting; returns the function that leaves it."""
        torch.set_rng_state(rng[side])
        if args.malloc != "default":
            retain_freed_memory(malloc_retain[side])

        def leave() -> None:
            rng[side] = torch.get_rng_state()
        return leave

    ours.train()
    peer.train()
    i_ours = i_peer = 0
    while i_ours < total or i_peer < total:
        leave = as_side("ours")
        for _ in range(args.block):
            if i_ours < total:
                ours_step(i_ours)
                i_ours += 1
        leave()
        leave = as_side("peer")
        for _ in range(args.block):
            if i_peer < total:
                peer_step(i_peer)
                i_peer += 1
        leave()
        print(f"step {i_ours}/{total}  ours {stats['ours']['tokens'] / max(stats['ours']['time'], 1e-9):,.0f} tok/s"
              f"  peer {stats['peer']['tokens'] / max(stats['peer']['time'], 1e-9):,.0f} tok/s", flush=True)

    @torch.no_grad()
    def evaluate(fn) -> dict:
        correct = count = 0
        loss = 0.0
        for b in valid:
            logits, labels = fn(b)
            keep = labels != -100
            lg, lb = logits[keep].float(), labels[keep]
            loss += torch.nn.functional.cross_entropy(lg, lb, reduction="sum").item()
            correct += int((lg.argmax(-1) == lb).sum())
            count += int(keep.sum())
        return {"mlm_accuracy": correct / count, "perplexity": float(np.exp(loss / count)), "targets": count}

    ours.eval()
    peer.eval()

    def ours_logits(b):
        with autocast("cpu", bf16):
            out = ours(input_ids=b.input_ids, labels=b.labels, attention_mask=b.attention_mask,
                       document_ids=b.document_ids)
        return out.logits, out.targets

    def peer_logits(b):
        return peer(input_ids=b.input_ids, attention_mask=b.attention_mask).logits, b.labels

    result = {
        "config": {"size": args.size, "vocab": tok.vocab_size, "seq_len": args.seq_len, "batch": args.batch_size,
                   "steps_timed": args.steps, "threads": torch.get_num_threads(), "ours_bf16": bf16,
                   "seed": args.seed, "malloc": args.malloc, "cpu": cpu_description(),
                   "peer_attn": getattr(peer.config, "_attn_implementation", "?"), "torch": torch.__version__},
        "ours_tok_s": stats["ours"]["tokens"] / stats["ours"]["time"],
        "peer_tok_s": stats["peer"]["tokens"] / stats["peer"]["time"],
        "ours_train_tokens": stats["ours"]["tokens"], "peer_train_tokens": stats["peer"]["tokens"],
        "ours_valid": evaluate(ours_logits), "peer_valid": evaluate(peer_logits),
    }
    result["ratio"] = result["ours_tok_s"] / result["peer_tok_s"]
    if args.profile:  # after timing and validation, so neither sees these steps
        ours.train()
        peer.train()
        prof = {}
        for side, step in (("ours", ours_step), ("peer", peer_step)):
            leave = as_side(side)
            prof[side] = profile_steps(step, range(total, total + args.profile))
            leave()
        # The ratio if every op of ours except its matmuls and fused attention cost nothing.
        gemm = sum(prof["ours"]["ms"].get(b, 0.0) for b in ("matmul", "fused attention"))
        prof["ceiling_ratio_ours_gemm_only"] = prof["peer"]["total_ms"] / max(gemm, 1e-9)
        result["profile"] = prof
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
