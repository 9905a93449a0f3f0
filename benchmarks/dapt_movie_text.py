"""Unlabeled in-domain text for continued MLM pretraining before SST-2 (docs/results.md, "Pretraining").

Writes two plain-text corpora (documents separated by blank lines):

- ``movie_text.txt``: the movie-review-polarity v2.0 reviews (IMDb newsgroup reviews, CC BY 4.0), then the
  *text* of every phrase of ``sst2/train.tsv`` as its own document.  Labels are never read.  A review that
  shares any 8-word sequence with an SST-2 test sentence is dropped, so no test text is pretrained on.
- ``sst2_dev_text.txt``: the text of ``sst2/dev.tsv`` (our dev split), for MLM validation only.

    .venv/bin/python benchmarks/dapt_movie_text.py --out runs/dapt
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def sentences(path: str) -> list[str]:
    with open(path, encoding="utf-8", newline="") as f:
        return [r["sentence"].strip() for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]


def ngrams(words: list[str], n: int = 8) -> set[str]:
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--out", default="runs/dapt")
    ap.add_argument("--ngram", type=int, default=8, help="drop reviews sharing an n-gram with a test sentence")
    args = ap.parse_args()
    sst = os.path.join(args.data, "sst2")
    test_grams: set[str] = set()
    for s in sentences(os.path.join(sst, "test.tsv")):
        test_grams |= ngrams(s.split(), args.ngram)
    with gzip.open(os.path.join(args.data, "movie-review-polarity", "reviews.jsonl.gz"), "rt", encoding="utf-8") as f:
        reviews = [json.loads(line)["text"] for line in f if line.strip()]
    os.makedirs(args.out, exist_ok=True)
    kept = dropped = 0
    train = sentences(os.path.join(sst, "train.tsv"))
    with open(os.path.join(args.out, "movie_text.txt"), "w", encoding="utf-8") as f:
        for text in reviews:
            if ngrams(text.split(), args.ngram) & test_grams:
                dropped += 1
                continue
            kept += 1
            f.write("\n".join(p.strip() for p in text.split("\n") if p.strip()) + "\n\n")
        for s in train:
            f.write(s + "\n\n")
    with open(os.path.join(args.out, "sst2_dev_text.txt"), "w", encoding="utf-8") as f:
        for s in sentences(os.path.join(sst, "dev.tsv")):
            f.write(s + "\n\n")
    print(json.dumps({"reviews_kept": kept, "reviews_dropped": dropped, "sst2_train_phrases": len(train)}))


if __name__ == "__main__":
    main()
