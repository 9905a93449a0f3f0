"""Evaluation reports: runs, metrics JSON, a markdown table and a Recall@k plot per system.

Why one writer for all systems: comparisons are only fair when every system
is scored by the same code on the same qrels with the same averaging, and
when the significance test pairs the same queries.  ``write_report`` takes
plain runs (``{system: {qid: {docid: score}}}``), so it works for anything —
the ``twotower eval --index`` mode feeds it the SearchPipeline's runs, tests
feed it synthetic ones.

Output directory::

    runs/<system>.trec     TREC run of each system (trec_eval order)
    metrics.json           settings, per-system means / counts / per-query values,
                           Recall@1..max_k curves, significance vs the baseline
    report.md              table of means (+ p-values) and the settings that matter
    recall_at_k.tsv        the curve values behind the plot
    recall_at_k.png        Recall@k for k = 1..max_k, one line per system
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from twotower.common.atomic import atomic_write_bytes, atomic_write_text
from twotower.eval.io.trec import write_trec_run
from twotower.eval.metrics.names import parse_metrics
from twotower.eval.metrics.retrieval import Qrels, RetrievalEvaluation, Run, evaluate, mean_recall_curve
from twotower.eval.metrics.significance import paired_randomization_test, paired_t_interval, paired_t_test

REPORT_METRICS = ("ndcg@10", "mrr@10", "recall@10", "recall@100", "map", "p@10")
AVERAGING_NOTE = (
    "mean over all judged queries (trec_eval -c): a judged query missing from a run scores 0; "
    "run queries without judgments are skipped"
)
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
# Every name `write_report` writes into its directory (runs/ holds only <system>.trec): a directory holding
# anything else is not an earlier report, and replacing it whole would remove the user's files.
REPORT_NAMES = frozenset({"runs", "metrics.json", "report.md", "recall_at_k.tsv", "recall_at_k.png"})


class ReportResult(NamedTuple):
    out_dir: Path
    evaluations: dict[str, RetrievalEvaluation]
    recall_curves: dict[str, np.ndarray]  # {system: (max_k,)}
    significance: dict[str, dict[str, Any]]
    files: list[Path]


def format_metrics_table(evaluation: RetrievalEvaluation, per_query: bool = False, digits: int = 4) -> str:
    """Readable text table of one evaluation: metric, mean; optionally one row per query."""
    labels = list(evaluation.means)
    width = max(8, *(len(label) for label in labels))
    lines = [f"{'metric':<{width}}  {'mean':>{digits + 3}}"]
    lines += [f"{label:<{width}}  {evaluation.means[label]:>{digits + 3}.{digits}f}" for label in labels]
    lines.append("")
    lines.append(
        f"queries: {evaluation.num_queries} judged ({evaluation.missing_from_run} absent from the run, scored 0); "
        f"{evaluation.skipped_unjudged} run queries without judgments skipped; "
        f"drop_self_hits={'on' if evaluation.drop_self_hits else 'off'}"
    )
    if per_query:
        qwidth = max(5, *(len(q) for q in evaluation.per_query))
        cols = [max(len(label), digits + 2) for label in labels]
        lines += ["", f"{'query':<{qwidth}}  " + "  ".join(f"{lab:>{w}}" for lab, w in zip(labels, cols))]
        for qid, values in evaluation.per_query.items():
            row = "  ".join(f"{values[lab]:>{w}.{digits}f}" for lab, w in zip(labels, cols))
            lines.append(f"{qid:<{qwidth}}  {row}")
    return "\n".join(lines)


def _markdown(
    title: str,
    evaluations: Mapping[str, RetrievalEvaluation],
    significance: Mapping[str, Mapping[str, Any]],
    settings: Mapping[str, Any],
    baseline: str,
) -> str:
    labels = list(next(iter(evaluations.values())).means)
    sig_metric = next(iter(significance.values()))["metric"] if significance else None
    head = ["system", *labels, "queries"]
    if significance:
        head += [f"{sig_metric} − baseline [95% CI]", f"p ({sig_metric}, t-test)", f"p ({sig_metric}, randomization)"]
    lines = [f"# {title}", ""]
    lines += [f"- {key}: {value}" for key, value in settings.items()]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, ev in evaluations.items():
        cells = [name, *(f"{ev.means[lab]:.4f}" for lab in labels), str(ev.num_queries)]
        if significance:
            sig = significance.get(name)
            cells += (
                [f"{sig['mean_difference']:+.4f} [{sig['ci95'][0]:+.4f}, {sig['ci95'][1]:+.4f}]",
                 f"{sig['t_test_p']:.4g}", f"{sig['randomization_p']:.4g}"]
                if sig
                else ["baseline", "baseline", "baseline"]
            )
        lines.append("| " + " | ".join(cells) + " |")
    if significance:
        lines += ["", f"Differences and p-values are paired over queries, against `{baseline}`; the interval is the "
                  "paired t-test's, the p-values two-sided."]
    lines += ["", "![Recall@k](recall_at_k.png)", ""]
    return "\n".join(lines)


def plot_recall_curves(
    curves: Mapping[str, np.ndarray], path: str | os.PathLike[str], title: str = ""
) -> None:
    """Save a PNG of Recall@k (k = 1..len(curve)) per system, atomically, with the Agg canvas.

    The figure is built on ``matplotlib.figure.Figure`` with an explicit Agg
    canvas rather than ``pyplot`` so no global backend or figure state changes.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, curve in curves.items():
        ks = np.arange(1, curve.shape[0] + 1)
        ax.plot(ks, curve, label=name, linewidth=1.6)
    ax.set_xlabel("k")
    ax.set_ylabel("Recall@k")
    ax.set_ylim(0.0, 1.0)
    ax.set_xlim(1, max(c.shape[0] for c in curves.values()))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    atomic_write_bytes(path, buffer.getvalue())


def write_report(
    runs: Mapping[str, Run],
    qrels: Qrels,
    out_dir: str | os.PathLike[str],
    *,
    metrics: str | Sequence[str] = REPORT_METRICS,
    drop_self_hits: bool = False,
    max_k: int = 100,
    baseline: str | None = None,
    significance_metric: str | None = None,
    n_resamples: int = 10_000,
    seed: int = 0,
    title: str = "Retrieval evaluation",
    settings: Mapping[str, Any] | None = None,
) -> ReportResult:
    """Score every system and write runs, ``metrics.json``, ``report.md``, the Recall@k TSV and PNG.

    Args:
        runs: ``{system name: run}``; names become file names, so ``[A-Za-z0-9_.+-]`` only.
        qrels: judgments shared by all systems.
        out_dir: created if missing; files in it are replaced atomically.
        metrics: metric names for the table and JSON.
        drop_self_hits: remove documents whose id equals the query id (stated in the report).
        max_k: last k of the Recall@k curve.
        baseline: system the others are tested against; default the first.
        significance_metric: metric of the paired tests; default the first of ``metrics``.
        n_resamples, seed: randomization test settings.
        title: heading of ``report.md``.
        settings: extra lines for the report and JSON (dataset, split, index...).

    Raises:
        ValueError: no system, an unsafe system name, or an unknown baseline / metric.
    """
    if not runs:
        raise ValueError("no system to report")
    for name in runs:
        if not _SAFE_NAME.match(name):
            raise ValueError(f"system name {name!r} must match {_SAFE_NAME.pattern} (it becomes a file name)")
    specs = parse_metrics(metrics)
    baseline = baseline if baseline is not None else next(iter(runs))
    if baseline not in runs:
        raise ValueError(f"baseline {baseline!r} is not one of the systems {list(runs)}")
    sig_label = significance_metric if significance_metric is not None else specs[0].label
    if sig_label not in [s.label for s in specs]:
        specs = [*specs, *parse_metrics([sig_label])]

    out = Path(out_dir)
    files: list[Path] = []
    evaluations: dict[str, RetrievalEvaluation] = {}
    curves: dict[str, np.ndarray] = {}
    for name, run in runs.items():
        evaluations[name] = evaluate(run, qrels, specs, drop_self_hits=drop_self_hits)
        curves[name] = mean_recall_curve(run, qrels, max_k, drop_self_hits=drop_self_hits)
        path = out / "runs" / f"{name}.trec"
        write_trec_run(run, path, tag=name)
        files.append(path)

    significance: dict[str, dict[str, Any]] = {}
    base_values = evaluations[baseline].column(sig_label)
    for name, ev in evaluations.items():
        if name == baseline or base_values.shape[0] < 2:
            continue
        values = ev.column(sig_label)
        t_test = paired_t_test(values, base_values)
        rand = paired_randomization_test(values, base_values, n_resamples=n_resamples, seed=seed)
        significance[name] = {
            "metric": sig_label,
            "baseline": baseline,
            "mean_difference": t_test.mean_difference,
            "t_statistic": t_test.statistic,
            "ci95": list(paired_t_interval(values, base_values)),
            "t_test_p": t_test.pvalue,
            "randomization_p": rand.pvalue,
            "n_resamples": n_resamples,
            "seed": seed,
        }

    all_settings = {
        "qrels queries": len(qrels),
        "averaging": AVERAGING_NOTE,
        "drop_self_hits": "on (documents whose id equals the query id are removed)"
        if drop_self_hits
        else "off",
        "tie-breaking": "score descending, then document id descending (trec_eval)",
        **(settings or {}),
    }
    payload = {
        "settings": {**all_settings, "drop_self_hits": drop_self_hits},
        "metrics": [s.label for s in specs],
        "systems": {
            name: {
                "means": ev.means,
                "num_queries": ev.num_queries,
                "skipped_unjudged": ev.skipped_unjudged,
                "missing_from_run": ev.missing_from_run,
                "per_query": ev.per_query,
            }
            for name, ev in evaluations.items()
        },
        "recall_at_k": {name: curve.tolist() for name, curve in curves.items()},
        "significance": significance,
    }
    targets = {
        "metrics.json": json.dumps(payload, indent=1, ensure_ascii=False) + "\n",
        "report.md": _markdown(title, evaluations, significance, all_settings, baseline),
        "recall_at_k.tsv": "k\t"
        + "\t".join(curves)
        + "\n"
        + "".join(
            f"{k + 1}\t" + "\t".join(f"{curve[k]:.6f}" for curve in curves.values()) + "\n"
            for k in range(max_k)
        ),
    }
    for filename, text in targets.items():
        atomic_write_text(out / filename, text)
        files.append(out / filename)
    plot_recall_curves(curves, out / "recall_at_k.png", title=title)
    files.append(out / "recall_at_k.png")
    return ReportResult(out, evaluations, curves, significance, files)
