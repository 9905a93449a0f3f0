"""Peak memory of an index build over 200k short synthetic documents (goal: < 2 GB beyond the index itself).

The build streams: the corpus is validated line by line (only ids are kept), each
shard of 8,192 documents is encoded and written to disk, and assembly adds shard
by shard.  What must stay in memory is the FAISS index (and BM25 with --bm25).

To keep the measurement about the pipeline rather than the model, the encoder is
a *random* 1-layer BERT with MiniLM's width (hidden 384, so the vectors are as
large as all-MiniLM-L6-v2's) and the bert-base-uncased vocabulary; the documents
are 5-30 random English words.  The script runs the build in a fresh process and
reads that process's ``VmHWM`` (peak resident set) from /proc.

    .venv/bin/python benchmarks/index_memory.py [--n 200000] [--bm25]

Reported: RSS after imports + model load (baseline), peak RSS, the serialized
vector file (≈ the FAISS index in memory), and peak - baseline - index.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education").split()

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {repo!r})
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
from twotower.retrieval import DualEncoder, SearchPipeline
de = DualEncoder.from_pretrained({model!r}, bf16="auto")
de.encode_documents(["warm up the encoder"])
base = status("VmRSS:")
t = time.perf_counter()
pipe = SearchPipeline.build({corpus!r}, {out!r}, de, bm25={bm25!r}, progress=False)
secs = time.perf_counter() - t
info = pipe.info()
pipe.close()
print(json.dumps({{"baseline_mb": base, "peak_mb": status("VmHWM:"), "seconds": secs, "factory": info["factory"],
                  "documents": info["documents"]}}))
"""


def make_model(directory: str, vocab: str) -> None:
    import torch

    from twotower.encoder import EncoderConfig, Tokenizer, save_encoder
    from twotower.encoder.core.model import BertModel

    tok = Tokenizer.from_vocab(vocab)
    tok.model_max_length = 64
    torch.manual_seed(0)
    config = EncoderConfig(vocab_size=tok.vocab_size, hidden_size=384, num_hidden_layers=1, num_attention_heads=6,
                           intermediate_size=1536, max_position_embeddings=64)
    save_encoder(BertModel(config, add_pooling_layer=False), tok, directory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--bm25", action="store_true")
    ap.add_argument("--vocab", default=os.path.join(REPO, "..", "shared", "data", "bert-base-uncased-vocab",
                                                    "vocab.txt"))
    ap.add_argument("--workdir", default=None, help="where to write corpus, model and index (default: a temp dir)")
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="index-memory-")
    os.makedirs(work, exist_ok=True)
    try:
        model = os.path.join(work, "model")
        if not os.path.isdir(model):
            make_model(model, args.vocab)
        corpus = os.path.join(work, f"corpus-{args.n}.jsonl")
        if not os.path.isfile(corpus):
            rng = random.Random(0)
            with open(corpus, "w") as f:
                for i in range(args.n):
                    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))
                    f.write(json.dumps({"_id": f"doc{i}", "title": "", "text": text}) + "\n")
        out = os.path.join(work, "idx")
        shutil.rmtree(out, ignore_errors=True)
        code = CHILD.format(repo=REPO, model=model, corpus=corpus, out=out, bm25=args.bm25)
        t = time.perf_counter()
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(res.stderr[-3000:])
        r = json.loads(res.stdout.strip().splitlines()[-1])
        index_mb = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".faiss")) / 2**20
        bm25 = [f for f in os.listdir(out) if f.startswith("bm25-")]
        bm25_mb = os.path.getsize(os.path.join(out, bm25[0])) / 2**20 if bm25 else 0.0
        r.update(index_file_mb=round(index_mb, 1), bm25_file_mb=round(bm25_mb, 1),
                 corpus_mb=round(os.path.getsize(corpus) / 2**20, 1),
                 beyond_index_mb=round(r["peak_mb"] - r["baseline_mb"] - index_mb - bm25_mb, 1),
                 wall_s=round(time.perf_counter() - t, 1))
        print(json.dumps(r))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
