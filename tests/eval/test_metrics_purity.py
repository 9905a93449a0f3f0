"""twotower.eval.metrics is pure numpy: importing it loads none of our other packages and no scipy/torch/sklearn."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import twotower.eval as eval_package
import twotower.eval.metrics as metrics

ROOT = Path(__file__).resolve().parents[2]


def test_importing_metrics_loads_only_numpy():
    code = (
        "import sys, twotower.eval.metrics; "
        "ours = {'twotower.encoder', 'twotower.indexing', 'twotower.retrieval', 'twotower.cli'}; "
        "heavy = {'scipy', 'torch', 'sklearn', 'pytrec_eval', 'seqeval', 'matplotlib'}; "
        "bad = sorted({m for m in sys.modules if '.'.join(m.split('.')[:2]) in ours or m.split('.')[0] in heavy}); "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_public_api_is_exported():
    for module in (eval_package, metrics):
        assert len(set(module.__all__)) == len(module.__all__)
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert missing == []
    for name in ("evaluate", "write_report", "read_trec_run", "load_beir", "DataError", "paired_t_test"):
        assert name in eval_package.__all__
