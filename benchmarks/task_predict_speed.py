"""Task-head prediction speed: `TaskModel.predict` batched by a fixed count vs by a token budget.

Two heads on all-MiniLM-L6-v2 (each with a seeded random head: speed does not depend on what the
head learned), on real text read at the lengths users meet:

- ``classify``: movie-review-polarity reviews (about 700 words), read up to ``--classify-length``
  tokens (512 by default), as `twotower predict` and `search --classifier` read them;
- ``qa``: XQuAD-en questions against passages of three consecutive paragraphs of their article
  (``--qa-paragraphs``), in windows of 384 tokens, as `SearchPipeline.answer`'s reader reads passages.

Each head predicts the same texts two ways, alternating, in one process: ``fixed``, a fixed number
of rows a forward (``--fixed``: 64, or 16 for ``qa``, the defaults before token budgets), and
``budget``, `predict`'s default (``batch_size=None``): length-sorted rows, as many a forward as fit
in the encoder's token budget (`encode.default_batch_tokens`).  It reports texts a second (median of
``--repeats`` passes), the minor page faults a text (activations above glibc's largest mmap
threshold, 32 MiB, are mapped and faulted in afresh each forward) and the largest difference
between the two ways' logits (batch shapes change fp32 rounding, nothing else).

    .venv/bin/python benchmarks/task_predict_speed.py --out runs/task_predict_speed.json
    TWOTOWER_MALLOC=default .venv/bin/python benchmarks/task_predict_speed.py   # glibc's own thresholds
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rerank_throughput import alternate  # noqa: E402
from tasks_common import DEFAULT_DATA, minilm_path  # noqa: E402

from twotower.common.device import cpu_description  # noqa: E402
from twotower.encoder.finetuning.task_examples import QAExample, TextExample  # noqa: E402
from twotower.encoder.finetuning.task_model import TaskModel  # noqa: E402
from twotower.encoder.finetuning.tasks import TaskInfo  # noqa: E402


def classify_examples(data: str, n: int) -> list[TextExample]:
    with gzip.open(os.path.join(data, "movie-review-polarity", "reviews.jsonl.gz"), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    step = max(1, len(rows) // n)  # both classes: the file lists negatives, then positives
    return [TextExample(r["text"]) for r in rows[::step][:n]]


def qa_examples(data: str, n: int, paragraphs: int) -> list[QAExample]:
    """The questions of runs of `paragraphs` consecutive paragraphs of an article, each read against the whole run:
    passages as long as a document's (XQuAD's paragraphs alone, 177 tokens with the question, fit one window).
    `n` of them, spread evenly over the articles."""
    with open(os.path.join(data, "xquad-en", "xquad.en.json"), encoding="utf-8") as f:
        articles = json.load(f)["data"]
    out = []
    for article in articles:
        paras = article["paragraphs"]
        for a in range(0, len(paras) - paragraphs + 1, paragraphs):
            context = "\n".join(p["context"] for p in paras[a:a + paragraphs])
            out += [QAExample(qa["id"], qa["question"], context) for p in paras[a:a + paragraphs] for qa in p["qas"]]
    return out[:: max(1, len(out) // n)][:n]


def logits(tm: TaskModel, feats, batch_size: int | None, bf16: bool) -> np.ndarray:
    """Every row's logits, flat (QA rows differ in length)."""
    return np.concatenate([o.ravel() for o in tm.outputs(feats, batch_size, bf16)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DEFAULT_DATA, help="folder holding movie-review-polarity/ and xquad-en/")
    ap.add_argument("--heads", default="classify,qa")
    ap.add_argument("--texts", type=int, default=192, help="examples a head predicts each pass")
    ap.add_argument("--classify-length", type=int, default=512)
    ap.add_argument("--qa-paragraphs", type=int, default=3, help="XQuAD paragraphs a passage (1: the paragraph alone)")
    ap.add_argument("--fixed", type=int, default=None, help="rows a forward of the fixed way (default 64; qa 16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="predict under bf16 autocast (both ways)")
    ap.add_argument("--out", default=None, help="append the rows to this JSON file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = cpu_description()
    print(f"# {cpu['model']}, {args.threads} threads, {'bf16' if args.bf16 else 'fp32'}, "
          f"TWOTOWER_MALLOC={os.environ.get('TWOTOWER_MALLOC', '(unset)')}")
    rows = []
    for head in args.heads.split(","):
        if head == "classify":
            info = TaskInfo(head="classify", labels=["neg", "pos"], max_length=args.classify_length)
            examples = classify_examples(args.data, args.texts)
            fixed = args.fixed or 64
        elif head == "qa":
            info = TaskInfo(head="qa", max_length=384)
            examples = qa_examples(args.data, args.texts, args.qa_paragraphs)
            fixed = args.fixed or 16
        else:
            raise SystemExit(f"--heads: unknown head {head!r} (classify, qa)")
        tm = TaskModel.from_encoder(minilm_path(), info, seed=0)
        feats = tm.featurize(examples)
        lengths = feats.lengths()
        runners = {f"fixed {fixed}": functools.partial(logits, tm, feats, fixed, args.bf16),
                   "budget": functools.partial(logits, tm, feats, None, args.bf16)}
        seconds, outs, faults = alternate(runners, args.repeats)
        a, b = outs.values()
        diff = float(np.abs(a - b).max())
        for name in runners:
            s = statistics.median(seconds[name])
            row = {"head": head, "way": name, "texts": len(examples), "rows": len(lengths),
                   "mean_tokens": float(np.mean(lengths)), "texts_per_s": len(examples) / s,
                   "faults_per_text": statistics.median(faults[name]) / len(examples), "seconds": seconds[name],
                   "max_abs_logit_diff": diff, "bf16": args.bf16, "threads": args.threads, "cpu": cpu,
                   "malloc": os.environ.get("TWOTOWER_MALLOC", "")}
            rows.append(row)
            print(f"{head:8s} {name:9s} {row['texts_per_s']:7.2f} texts/s  {row['faults_per_text']:9.0f} faults/text  "
                  f"({len(lengths)} rows, {row['mean_tokens']:.0f} tokens on average; max |logit diff| {diff:.1e})")
    if args.out:
        old = json.load(open(args.out, encoding="utf-8")) if os.path.exists(args.out) else []
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(old + rows, f, indent=1)


if __name__ == "__main__":
    main()
