"""Memory and page faults of a long-running search process: claims searched and reranked one at a time.

A service answers one query after another for hours; this is that loop in one process
(`SearchPipeline.search` with the index's reranker, SciFact claims in file order), reporting at a
few points: resident memory (now, and the process's peak so far), what glibc's heap holds in use and
free (``mallinfo2``), the minor page faults so far, the library's heap trims so far (and their mean
duration) and the seconds so far.  Memory in use flat while free-in-heap climbs is fragmentation,
not a leak.  Compare allocator settings by running it more than once: with ``TWOTOWER_MALLOC=default``
(glibc left alone), with ``--trim-above inf`` (the library's fixed thresholds but no trimming), and as the
library runs (fixed thresholds, and the heap trimmed once resident memory has grown by ``--trim-above`` MiB,
`common/malloc.py`'s `TRIM_ABOVE`):

    TWOTOWER_MALLOC=default .venv/bin/python benchmarks/search_memory.py --index runs/serve/scifact-minilm
    .venv/bin/python benchmarks/search_memory.py --index runs/serve/scifact-minilm --trim-above inf
    .venv/bin/python benchmarks/search_memory.py --index runs/serve/scifact-minilm
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import resource
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rerank_depth import parse_search_args  # noqa: E402

from twotower.common import malloc  # noqa: E402
from twotower.common.device import cpu_description  # noqa: E402
from twotower.eval.io.beir import read_beir_queries  # noqa: E402
from twotower.retrieval import SearchPipeline  # noqa: E402


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_mb() -> dict[str, float]:
    """glibc's view of the heap in MB: in use, free inside it, mmapped blocks (empty where there is no mallinfo2)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = _Mallinfo2
    m = libc.mallinfo2()
    return {"in_use_mb": m.uordblks / 2**20, "free_in_heap_mb": m.fordblks / 2**20, "mmapped_mb": m.hblkhd / 2**20}


def rss_mb() -> float:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--index", required=True, help="an index directory (twotower index build)")
    ap.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data", "beir-scifact"))
    ap.add_argument("--reranker", default="default")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--report-at", default="1,25,50,100,150,200")
    ap.add_argument("--trim-above", type=float, default=malloc.TRIM_ABOVE / 2**20,
                    help="MiB of resident growth after which inference trims the heap (inf: never; default: the "
                         "library's)")
    args, bf16 = parse_search_args(ap)
    malloc.TRIM_ABOVE = args.trim_above * 2**20
    trims: list[float] = []  # seconds each of the library's trims took
    libc = malloc._glibc()  # the library's handle (cached): count and time its trims
    if libc is not None:
        trim = libc.malloc_trim

        def timed_trim(pad: int) -> int:
            start = time.perf_counter()
            try:
                return trim(pad)
            finally:
                trims.append(time.perf_counter() - start)

        libc.malloc_trim = timed_trim
    claims = list(read_beir_queries(os.path.join(args.data, "queries.jsonl")).values())[:args.queries]
    marks = {int(x) for x in args.report_at.split(",")} | {len(claims)}
    rows = []
    with SearchPipeline.load(args.index, reranker=args.reranker, bf16=bf16) as pipe:
        faults0, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        for i, claim in enumerate(claims, 1):
            pipe.search(claim, k=10, rerank=True)
            if i in marks:
                row = {"queries": i, "seconds": round(time.perf_counter() - start, 1), "rss_mb": round(rss_mb()),
                       "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),  # kB on Linux
                       "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0, "trims": len(trims),
                       "trim_ms_mean": round(1000 * sum(trims) / len(trims), 1) if trims else None,
                       **{k: round(v) for k, v in heap_mb().items()}}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"cpu": cpu_description(), "malloc": os.environ.get("TWOTOWER_MALLOC", "library"),
                       "trim_above_mib": args.trim_above if args.trim_above != float("inf") else None,
                       "bf16": args.bf16, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
