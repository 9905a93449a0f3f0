"""What building search results costs: 10,000 `Hit` objects (1,000 queries x 10), collector on vs paused.

The pipeline-overhead benchmark on a small Flat index is dominated by this cost; this script isolates it
(CPU seconds of this process, best and mean of `--repeats`, with torch and faiss loaded as in a search process), and compares a NamedTuple with the same fields:

    .venv/bin/python benchmarks/hit_construction.py
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections import namedtuple
from dataclasses import MISSING, fields

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from twotower.retrieval.hit import Hit, gc_paused

# The same fields as Hit, as a tuple (derived, so the comparison stays like for like if Hit changes).
HitTuple = namedtuple("HitTuple", [f.name for f in fields(Hit)],
                      defaults=[f.default for f in fields(Hit) if f.default is not MISSING])


def timed_ms(fn, repeats: int) -> tuple[float, float]:
    """(best, mean) CPU ms. The mean matters here: a collection runs in only some repetitions, so the best
    repetition hides what the collector costs on average."""
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return 1000 * min(times), 1000 * sum(times) / len(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    import faiss  # noqa: F401  (a search process's heap: the collector's cost grows with what is loaded)
    import torch  # noqa: F401
    ids = [[f"doc{q * args.k + j}" for j in range(args.k)] for q in range(args.queries)]
    scores = [[1.0 / (j + 1) for j in range(args.k)] for _ in range(args.queries)]
    ranks = range(1, args.k + 1)
    new = tuple.__new__

    def hits():
        return [[Hit(d, None, None, r, s, s, r) for r, d, s in zip(ranks, i, x)] for i, x in zip(ids, scores)]

    def hits_paused():
        with gc_paused():
            return hits()

    def tuples_paused():
        with gc_paused():
            return [[new(HitTuple, (d, None, None, r, s, s, r, None, None, None)) for r, d, s in zip(ranks, i, x)]
                    for i, x in zip(ids, scores)]

    assert gc.isenabled()
    rows = {"Hit, collector on": timed_ms(hits, args.repeats),
            "Hit, collector paused (what the pipeline does)": timed_ms(hits_paused, args.repeats),
            "NamedTuple, collector paused": timed_ms(tuples_paused, args.repeats)}
    print(f"{args.queries * args.k:,} results, {args.repeats} repetitions, CPU ms (best / mean):")
    for name, (best, mean) in rows.items():
        print(f"  {name}: {best:.2f} / {mean:.2f}")


if __name__ == "__main__":
    main()
