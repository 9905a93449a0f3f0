"""The kernels behind our CPU training step, timed against what they replace (same process, same shapes).

- one 8192 × 256 × 1024 matmul in fp32 and bf16 (is bf16 worth anything on this CPU?)
- dropout mask of a (64·128, 256) bf16 activation: `bernoulli_` (nn.Dropout / SDPA) vs encoder.dropout.keep_mask
- attention forward + backward, bf16, at (B, heads, T, 64) for T = 128 / 256 / 512 with B·T = 8192 tokens:
  `F.scaled_dot_product_attention` vs `twotower.encoder.core.model.explicit_attention`, dropout 0 and 0.1
- and, beside them, inference attention (no grad) at a reranking batch's shape, 16 rows of 256 tokens (12 heads
  of 32, key padding), fp32 and bf16: SDPA vs `chunked_attention`, which CPU inference in bf16 uses
- cross-entropy forward + backward over gathered MLM logits (1216 × 16000, bf16, and fp32):
  `F.cross_entropy(logits.float())` + argmax vs `twotower.encoder.pretraining.fused_cross_entropy.cross_entropy_with_correct`,
  and the fp32 copy of those logits into a fresh array vs into a reused one (first-touch page faults)
- one AdamW step over the parameters of `mini` (vocab 16k: 7.47 M parameters in 74 tensors): PyTorch's
  default on CPU (a loop over tensors), `foreach=True` and `fused=True`; encoder.optim.make_optimizer uses the
  default on both sides of the throughput benchmark

    .venv/bin/python benchmarks/cpu_train_kernels.py --out runs/cpu_train_kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from twotower.common.device import cpu_bf16_supported, cpu_description
from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.dropout import keep_mask
from twotower.encoder.core.model import build_attention_mask, chunked_attention, explicit_attention
from twotower.encoder.pretraining.fused_cross_entropy import cross_entropy_with_correct
from twotower.encoder.pretraining.mlm import BertForPreTraining
from twotower.encoder.training.optim import param_groups


def ms(fn, repeats: int) -> float:
    """Median wall time of `fn` in ms, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    r = args.repeats
    res: dict = {"threads": torch.get_num_threads(), "torch": torch.__version__}

    shape = (64 * 128, 256)
    res["dropout_mask_ms"] = {
        "bernoulli_": ms(lambda: torch.empty(shape, dtype=torch.bfloat16).bernoulli_(0.9), r),
        "keep_mask": ms(lambda: keep_mask(shape, 0.1, torch.bfloat16), r),
    }

    res["attention_fwd_bwd_ms"] = {}
    for T in (128, 256, 512):
        B = 8192 // T
        q, k, v = (torch.randn(B, args.heads, T, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

        def step(fn, p, qkv=(q, k, v)):
            fn(*qkv, p).sum().backward()

        def sdpa(a, b, c, d):
            return F.scaled_dot_product_attention(a, b, c, dropout_p=d)

        def explicit(a, b, c, d):
            return explicit_attention(a, b, c, None, d)

        row = {}
        for p in (0.0, 0.1):
            row[f"sdpa_p{p}"] = ms(lambda p=p: step(sdpa, p), r)
            row[f"explicit_p{p}"] = ms(lambda p=p: step(explicit, p), r)
        res["attention_fwd_bwd_ms"][f"T{T}_B{B}"] = row

    res["attention_inference_ms"] = {}
    lengths = torch.randint(218, 257, (16,)).sort(descending=True).values
    lengths[0] = 256
    mask = build_attention_mask((torch.arange(256)[None, :] < lengths[:, None]).long(), None)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(16, 12, 256, 32, dtype=dtype) for _ in range(3))
        with torch.inference_mode():
            res["attention_inference_ms"][str(dtype).removeprefix("torch.")] = {
                "sdpa": ms(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), r),
                "chunked": ms(lambda q=q, k=k, v=v: chunked_attention(q, k, v, mask, self_attention=True), r)}

    # What bf16 is worth on this CPU: one (8192 x 256) x (256 x 1024) matmul per dtype (without native bf16
    # oneDNN has no fast kernel and bf16 is ~100x slower; with AVX512-BF16 / AMX it is faster than fp32).
    a, b = torch.randn(8192, 256), torch.randn(256, 1024)
    res["matmul_8192x256x1024_ms"] = {"fp32": ms(lambda: a @ b, r)}
    a16, b16 = a.bfloat16(), b.bfloat16()
    res["matmul_8192x256x1024_ms"]["bf16"] = ms(lambda: a16 @ b16, 1 if not cpu_bf16_supported() else r)
    res["cpu"] = cpu_description()

    N, V = 1216, 16000
    logits = (torch.randn(N, V) * 3).to(torch.bfloat16)
    targets = torch.randint(0, V, (N,))

    def plain(src: torch.Tensor) -> None:
        x = src.clone().requires_grad_(True)
        x32 = x.float()
        F.cross_entropy(x32, targets).backward()
        (x32.detach().argmax(-1) == targets).sum()

    def fused(src: torch.Tensor) -> None:
        x = src.clone().requires_grad_(True)
        cross_entropy_with_correct(x, targets)[0].backward()

    # bf16 logits (autocast on CPUs with native bf16), then fp32 (CPUs without it train in fp32)
    for key, src in (("cross_entropy_fwd_bwd_ms", logits), ("cross_entropy_fp32_fwd_bwd_ms", logits.float())):
        res[key] = {"plain": ms(lambda src=src: plain(src), r), "fused": ms(lambda src=src: fused(src), r)}
    # why the fused route keeps a scratch: the same fp32 copy into a fresh array vs into a reused one
    scratch = torch.empty(N, V)
    res["logits_fp32_copy_ms"] = {"fresh_array": ms(lambda: logits.float(), r),
                                  "reused_array": ms(lambda: scratch.copy_(logits), r)}

    model = BertForPreTraining(EncoderConfig.named("mini", 16000))
    for q in model.parameters():
        q.grad = torch.randn_like(q) * 1e-3
    res["adamw_step_ms"] = {"parameters": sum(q.numel() for q in model.parameters()),
                            "tensors": sum(1 for _ in model.parameters())}
    for name, kw in (("default", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        opt = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-4, eps=1e-6, **kw)
        res["adamw_step_ms"][name] = ms(opt.step, r)
    print(json.dumps(res, indent=2))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
