"""The report writer on synthetic runs: files, numbers, significance, plot."""

from __future__ import annotations

import json

import numpy as np
import pytest

from twotower.eval import evaluate, read_trec_run, write_report
from twotower.eval.report import format_metrics_table


def _systems(n_queries=40, seed=0):
    """A qrels and two runs: 'good' ranks a relevant document first more often than 'weak'."""
    rng = np.random.default_rng(seed)
    qrels, good, weak = {}, {}, {}
    for i in range(n_queries):
        qid = f"q{i}"
        relevant = [f"d{j}" for j in rng.choice(200, size=3, replace=False)]
        qrels[qid] = {d: int(rng.integers(1, 3)) for d in relevant}
        docs = {f"d{j}": float(rng.random()) for j in rng.choice(200, size=120, replace=False)}
        good[qid] = {**docs, **{d: 2.0 + rng.random() for d in relevant}}
        weak[qid] = {**docs, **{d: float(rng.random()) for d in relevant}}
    weak.pop("q0")  # a judged query the weak system did not answer
    weak["unjudged"] = {"d1": 1.0}
    return qrels, {"good": good, "weak": weak}


def test_write_report_files_and_numbers(tmp_path):
    qrels, runs = _systems()
    result = write_report(runs, qrels, tmp_path / "rep", metrics="ndcg@10,mrr@10,recall@100", baseline="weak")
    out = tmp_path / "rep"
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert names == [
        "metrics.json",
        "recall_at_k.png",
        "recall_at_k.tsv",
        "report.md",
        "runs/good.trec",
        "runs/weak.trec",
    ]
    assert read_trec_run(out / "runs" / "good.trec") == runs["good"]

    payload = json.loads((out / "metrics.json").read_text())
    for name, run in runs.items():
        expected = evaluate(run, qrels, "ndcg@10,mrr@10,recall@100")
        assert payload["systems"][name]["means"] == pytest.approx(expected.means)
        assert payload["systems"][name]["num_queries"] == 40
    assert payload["systems"]["weak"]["missing_from_run"] == 1
    assert payload["systems"]["weak"]["skipped_unjudged"] == 1
    assert payload["settings"]["drop_self_hits"] is False
    assert len(payload["recall_at_k"]["good"]) == 100
    assert payload["recall_at_k"]["good"][99] == pytest.approx(
        payload["systems"]["good"]["means"]["recall@100"]
    )

    sig = payload["significance"]["good"]
    assert sig["baseline"] == "weak" and sig["metric"] == "ndcg@10"
    assert sig["mean_difference"] > 0.3
    assert sig["t_test_p"] < 1e-6 and sig["randomization_p"] < 0.001
    low, high = sig["ci95"]
    diff = result.evaluations["good"].column("ndcg@10") - result.evaluations["weak"].column("ndcg@10")
    half = 1.96 * diff.std(ddof=1) / np.sqrt(diff.size)  # the normal interval; t's is a little wider at 40 queries
    assert low < sig["mean_difference"] < high and low < diff.mean() - half * 0.99 and high > diff.mean() + half * 0.99
    assert "weak" not in payload["significance"]
    assert set(result.significance) == {"good"}

    md = (out / "report.md").read_text()
    assert "| good |" in md and "| weak |" in md and "baseline" in md
    assert "drop_self_hits: off" in md and "trec_eval -c" in md
    assert f"{result.evaluations['good'].means['ndcg@10']:.4f}" in md
    assert f"{sig['mean_difference']:+.4f} [{low:+.4f}, {high:+.4f}]" in md

    png = (out / "recall_at_k.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    tsv = (out / "recall_at_k.tsv").read_text().splitlines()
    assert tsv[0] == "k\tgood\tweak" and len(tsv) == 101
    curve = result.recall_curves["good"]
    assert np.all(np.diff(curve) >= 0) and curve[-1] > result.recall_curves["weak"][9]


def test_report_single_system_and_drop_self_hits(tmp_path):
    qrels = {"q1": {"d1": 1}, "q2": {"d2": 1}}
    run = {"q1": {"q1": 5.0, "d1": 1.0}, "q2": {"d2": 1.0}}
    result = write_report({"only": run}, qrels, tmp_path, metrics=["mrr@10"], drop_self_hits=True, max_k=5)
    assert result.significance == {}
    assert result.evaluations["only"].means["mrr@10"] == 1.0
    assert "drop_self_hits: on" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "metrics.json").read_text())["settings"]["drop_self_hits"] is True


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"runs": {}}, "no system"),
        ({"runs": {"a b": {}}}, "becomes a file name"),
        ({"runs": {"a": {}}, "baseline": "z"}, "baseline"),
        ({"runs": {"a": {}}, "metrics": "bleu"}, "unknown metric"),
    ],
)
def test_report_rejects_bad_arguments(tmp_path, kwargs, match):
    runs = kwargs.pop("runs")
    with pytest.raises(ValueError, match=match):
        write_report(runs, {"q": {"d": 1}}, tmp_path, **kwargs)


def test_format_metrics_table():
    ev = evaluate({"q1": {"a": 1.0}}, {"q1": {"a": 1}, "q2": {"b": 1}}, "ndcg@10,map")
    text = format_metrics_table(ev, per_query=True)
    assert "ndcg@10" in text and "0.5000" in text
    assert "2 judged (1 absent from the run, scored 0)" in text
    assert text.splitlines()[-1].split() == ["q2", "0.0000", "0.0000"]
