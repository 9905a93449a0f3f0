"""What one save of a resumable training state costs: its size and the seconds `save_train_state` takes.

    .venv/bin/python benchmarks/state_save.py [--repeats 3] [--out runs/state_save.json]

Two layouts, both of all-MiniLM-L6-v2 trained whole with AdamW after one step (so both moments exist):
``reranker``, what `train reranker` / `train dual` save after each dev evaluation (weights + moments + the
generators), and ``finetune``, what `twotower finetune` saves (the same plus the seed's best weights). The
state is written into a temporary directory beside the repository's ``runs/``, fsync'd as a real save is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    import torch

    from twotower.common.device import cpu_description
    from twotower.encoder.training.train_state import save_train_state
    from twotower.retrieval.cross_encoder import CrossEncoder
    from twotower.retrieval.manifest import default_model_dir

    model = CrossEncoder.from_encoder(default_model_dir(), device="cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()  # both moments now exist, as after any training step
    best = {k: v.detach().clone() for k, v in model.state_dict().items()}

    os.makedirs(REPO / "runs", exist_ok=True)
    root = tempfile.mkdtemp(prefix="state-save-", dir=REPO / "runs")
    result = {"cpu": cpu_description(), "layouts": {}}
    try:
        for name, extra in (("reranker", None), ("finetune", {"best": best})):
            directory = os.path.join(root, name)
            seconds = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                save_train_state(directory, model.state_dict(), opt, {"step": 1}, extra=extra)
                seconds.append(time.perf_counter() - t0)
            size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
            result["layouts"][name] = {"mb": round(size / 1e6, 1), "seconds": [round(s, 2) for s in seconds],
                                       "median_s": round(statistics.median(seconds), 2)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
