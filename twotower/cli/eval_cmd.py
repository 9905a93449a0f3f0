"""twotower eval: score a run against qrels, or search a BEIR split and write a comparison report.

Two modes:

* --run RUN --qrels QRELS: trec_eval-exact metrics of an existing TREC run.
  Qrels may be BEIR TSV (3 columns, header) or TREC (4 columns); the format
  is detected.  Prints a table, or with --json one object
  {<metric as typed>: mean, ..., "num_queries", "skipped_unjudged",
  "missing_from_run", "drop_self_hits", "per_query": {qid: {metric: value}}}.
  --out DIR also writes the full report (runs, metrics.json, report.md, Recall@k plot).
* --index IDX --dataset BEIR_DIR --split test --out DIR: search the index
  with the split's queries (dense recall), plus --bm25, --hybrid and/or
  --reranker DIR systems, and write one report comparing them
  (significance against the first system).  A reranked system is added
  only for --reranker; an index's default reranker is not loaded.  It
  reranks the hybrid's candidates with --hybrid, else BM25's with --bm25,
  else the dense ones.

Means are over every judged query, as trec_eval -c computes them.
"""  # plain text, not reStructuredText: it is `twotower eval --help`'s description

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twotower.cli import CLIError
from twotower.cli.checks import (
    first_stage_flags,
    index_directory,
    input_file,
    parent_is_a_file,
    positive,
    reranker_directory,
    searchable_queries,
)
from twotower.cli.help_format import DefaultsRawDescriptionHelpFormatter
from twotower.cli.rerank_weight import print_weight_origin
from twotower.common.paths import (
    beside_earlier_refusal,
    foreign_entries,
    not_ours_refusal,
    working_directory_refusal,
)

if TYPE_CHECKING:
    from twotower.eval.report import ReportResult

DEFAULT_METRICS = "ndcg@10,mrr@10,recall@100,map"
REPORT_METRICS = (
    "ndcg@10,mrr@10,recall@10,recall@100,map,p@10"  # for --help only; eval.report holds the default
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``eval`` sub-command."""
    p = subparsers.add_parser(
        "eval",
        help="score a run against qrels, or search a BEIR split and write a report",
        description=__doc__,
        formatter_class=DefaultsRawDescriptionHelpFormatter,
    )
    scored = p.add_argument_group("score an existing run")
    scored.add_argument("--run", help="TREC run file: qid Q0 docid rank score tag")
    scored.add_argument(
        "--qrels", help="qrels: BEIR TSV (query-id corpus-id score) or TREC (qid 0 docid rel)"
    )
    searched = p.add_argument_group("search a BEIR split with an index and report")
    searched.add_argument("--index", help="index directory built by `twotower index build`")
    searched.add_argument("--dataset", help="BEIR directory (corpus.jsonl, queries.jsonl, qrels/)")
    searched.add_argument("--split", help="qrels split to evaluate (default: test)")
    searched.add_argument("--reranker", help='cross-encoder directory, or "default" (the reranker twotower ships): '
                                             'adds a reranked system')
    searched.add_argument("--hybrid", action="store_true", help="add a hybrid (dense + BM25) system")
    searched.add_argument("--bm25", action="store_true", help="add a BM25 system (index built with --bm25)")
    searched.add_argument("--rerank-k", type=int, default=None, metavar="N",
                          help="with --reranker: candidates the cross-encoder scores (default 20, as search)")
    searched.add_argument("--rerank-alpha", type=float, default=None, metavar="A",
                          help="with --reranker: final = A * z(rerank) + (1 - A) * z(first stage); default: the "
                               "weight stored with the reranker for this first stage")
    searched.add_argument("-k", "--k", type=int, metavar="N", help="documents kept per query (default 100)")
    searched.add_argument(
        "--recall-k", type=int, default=None, help="first-stage depth (default: max(k, 100))"
    )
    searched.add_argument("--batch-size", type=int, help="queries per search call (default 64)")
    p.add_argument(
        "--metrics",
        default=None,
        help=f"comma-separated, e.g. ndcg@10,mrr@10,recall@100,p@5,map,map@100,rprec "
        f"(default {DEFAULT_METRICS}; report default {REPORT_METRICS})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--per-query", action="store_true", help="also print one row per query")
    p.add_argument(
        "--drop-self-hits", action="store_true", help="drop retrieved documents whose id equals the query id"
    )
    p.add_argument("--out", help="report directory (runs, metrics.json, report.md, recall_at_k.png)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_eval)


# The flags of the --index mode (dest, flag): a scored run was made elsewhere, so with --run they
# would be ignored; they default to None so that "given" can be told from "left at its default".
_SEARCH_FLAGS = (("dataset", "--dataset"), ("split", "--split"), ("reranker", "--reranker"),
                 ("hybrid", "--hybrid"), ("bm25", "--bm25"), ("rerank_k", "--rerank-k"), ("rerank_alpha", "--rerank-alpha"),
                 ("k", "-k"), ("recall_k", "--recall-k"), ("batch_size", "--batch-size"))


def _earlier_report(out: str) -> tuple[bool, list[str]]:
    """Whether directory `out` holds an earlier report, and its entries that no report writes (``runs/NAME``
    for one inside ``runs/``; every entry when it holds no report).

    An earlier report is marked by a metrics.json that parses and lists its systems, and a ``runs/`` holding
    the ``.trec`` file of each of them.
    Why: a directory holding a report.md of the user's notes beside their code was taken for an earlier
    report and replaced whole, the code with it; so were the user's notes and their own runs/*.trec. Only
    what `write_report` writes (and the temporaries of its atomic writes) may go with an earlier report.
    """
    from twotower.eval.report import REPORT_NAMES

    names = sorted(os.listdir(out))
    try:
        with open(os.path.join(out, "metrics.json"), encoding="utf-8") as f:
            systems = json.load(f)["systems"]
        runs = {f"{name}.trec" for name in systems} if isinstance(systems, dict) else set()
    except (OSError, ValueError, KeyError, TypeError):  # no report's metrics.json: nothing here is a report's
        return False, names
    runs_dir = os.path.join(out, "runs")
    if not runs or os.path.islink(runs_dir) or not os.path.isdir(runs_dir) or not runs <= set(os.listdir(runs_dir)):
        return False, names
    return True, foreign_entries(out, REPORT_NAMES) + [f"runs/{n}" for n in foreign_entries(runs_dir, runs)]


def _refuse_not_a_report(out: str) -> None:
    """Refuse an --out directory that is not an earlier report (or one the user added files to), which the new
    report would replace whole; called before the search and again just before the swap (the search may take
    long, and files may be put there meanwhile)."""
    if not os.path.isdir(out):
        return
    is_report, foreign = _earlier_report(out)
    if foreign and is_report:
        raise CLIError(beside_earlier_refusal(f"--out {out}", "an earlier report", foreign,
                                              replaced="the new report would replace whole"))
    if foreign:  # the new report would replace it whole
        raise CLIError(not_ours_refusal(f"--out {out}", foreign, "an earlier report"))


def _report_out(args: argparse.Namespace) -> None:
    """--out before any work: a new or empty directory, or an earlier report, which the new one replaces whole.

    Why: a file there was a traceback (after the whole search in --index mode); the index directory, or a
    directory of other files, took the report's files beside its own; an input run under ``OUT/runs/`` was
    rewritten with another tag; and an earlier report's runs that this one does not write stayed beside it.
    The current directory (or one above it) is refused: the swap that replaces it would leave the shell in
    the removed directory, where the report is not to be seen.
    """
    out = args.out
    if out is None:
        return
    if os.path.exists(out) and not os.path.isdir(out):
        raise CLIError(f"--out {out}: a file; give a directory for the report (a new one, or an earlier report)")
    parent_is_a_file("--out", out)
    here = os.path.realpath(out)
    if problem := working_directory_refusal(out, f"--out {out}", "the report", "--out report"):
        raise CLIError(problem)
    for flag, given in (("--index", args.index), ("--dataset", args.dataset), ("--run", args.run),
                        ("--qrels", args.qrels)):
        there = os.path.realpath(given) if given else None
        if there and flag == "--index" and (here == there or here.startswith(there + os.sep)):  # the index's files
            raise CLIError(f"--out {out}: inside {flag} {given}; write the report elsewhere")
        if there and there.startswith(here + os.sep):
            raise CLIError(f"--out {out}: holds the input {flag} {given}, which the report would replace; write "
                           "the report elsewhere")
    _refuse_not_a_report(out)


def _write_report_into(out: str, write: Callable[[str], ReportResult]) -> ReportResult:
    """``write(directory)`` into a staging directory beside `out`, then swapped in whole (an earlier report's
    files that this one does not write do not linger beside it, and a failure leaves `out` as it was)."""
    from twotower.common.atomic import atomic_replace_dir

    staging = f"{os.path.abspath(out).rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        result = write(staging)
        _refuse_not_a_report(out)  # checked before the work began; the user may have put files there since
        atomic_replace_dir(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result._replace(out_dir=Path(out), files=[Path(out) / f.relative_to(staging) for f in result.files])


def run_eval(args: argparse.Namespace) -> int:
    """Dispatch on the mode; bad combinations of flags are CLIErrors (exit 2)."""
    if args.run and args.index:
        raise CLIError("give either --run (score a run) or --index (search and report), not both")
    if args.run:
        if not args.qrels:
            raise CLIError("--run needs --qrels")
        given = [flag for dest, flag in _SEARCH_FLAGS  # `is`: -k 0 or --rerank-alpha 0 is given too (0 == False)
                 if getattr(args, dest) is not None and getattr(args, dest) is not False]
        if given:
            raise CLIError(f"{', '.join(given)} {'sets' if len(given) == 1 else 'set'} how --index searches; "
                           "--run scores a run that is already made: leave "
                           f"{'it' if len(given) == 1 else 'them'} out, or search with --index IDX --dataset DIR")
        return _score_run(args)
    if args.index:
        if args.qrels:
            raise CLIError("--qrels goes with --run; with --index the judgments are --dataset's "
                           "qrels/<--split>.tsv")
        missing = [flag for flag, value in (("--dataset", args.dataset), ("--out", args.out)) if not value]
        if missing:
            raise CLIError(f"--index needs {' and '.join(missing)}: it searches --dataset's queries and writes a "
                           "report (metrics, confidence intervals, the runs) to --out DIR")
        args.split = "test" if args.split is None else args.split
        args.k = 100 if args.k is None else args.k
        args.batch_size = 64 if args.batch_size is None else args.batch_size
        return _search_and_report(args)
    raise CLIError("nothing to do: give --run RUN --qrels QRELS, or --index IDX --dataset DIR --out DIR")


def _metrics(text: str | None, default: str) -> list:
    """``--metrics`` parsed, its errors naming the flag; an empty value is an error, not the default."""
    from twotower.eval.metrics import parse_metrics

    try:
        return parse_metrics(default if text is None else text)
    except ValueError as e:
        raise CLIError(f"--metrics: {e}") from None


# The report's settings key of `_shallow_cutoffs`'s note: one in both modes, for whoever reads metrics.json.
SHALLOW_NOTE = "cutoffs deeper than the run"


def _shallow_cutoffs(specs: list, runs: dict, deeper: str, k: int | None = None) -> str | None:
    """Say (stderr, once) when a metric's cutoff is deeper than the runs' deepest list, and return the note
    for the report (under `SHALLOW_NOTE`); None when every cutoff fits. `deeper`: how to make the run deeper,
    in the user's flags. `k`: the ``-k`` the runs were searched with (--index mode): only cutoffs beyond it
    are said, since a shorter list there is the whole index, which no flag makes deeper.

    Why: trec_eval's numbers are kept (they are right for the run as it is), but a run searched with
    ``-k 10`` reported a recall@100 that is recall@10, and nothing said so; and a 6-document index searched
    with the default ``-k 100`` was told "-k 100 scores them in full".
    """
    depth = max((len(docs) for run in runs.values() for docs in run.values()), default=0)
    shallow = [s for s in specs if s.k is not None and s.k > max(depth, k or 0)]
    if not shallow:
        return None
    deepest = max(s.k for s in shallow)
    note = (f"{', '.join(s.label for s in shallow)} cut deeper than the deepest list of the run{'s' * (len(runs) > 1)} "
            f"({depth} document{'s' * (depth != 1)}): {'they count' if len(shallow) > 1 else 'it counts'} only "
            f"those; {deeper.format(k=deepest)}")
    print(f"twotower eval: warning: {note}", file=sys.stderr)
    return note


def _score_run(args: argparse.Namespace) -> int:
    from twotower.eval.io import read_qrels, read_trec_run
    from twotower.eval.metrics import evaluate
    from twotower.eval.report import format_metrics_table, write_report

    specs = _metrics(args.metrics, DEFAULT_METRICS)
    input_file("--run", args.run)  # a directory was "no such file"
    input_file("--qrels", args.qrels, inside=os.path.join("qrels", "test.tsv"))
    _report_out(args)
    qrels = read_qrels(args.qrels)
    if not qrels:  # evaluate said "the qrels hold no query", naming no file
        raise CLIError(f"--qrels {args.qrels}: no judgments (a header alone, or only blank lines)")
    run = read_trec_run(args.run)
    if not run:  # every judged query scored 0 without a word
        raise CLIError(f"--run {args.run}: no results (the file is empty)")
    result = evaluate(run, qrels, specs, drop_self_hits=args.drop_self_hits)
    shallow = _shallow_cutoffs(specs, {"run": run}, "search deeper to score them in full (twotower search -k {k})")
    if args.out:
        # the system's name is the run's file name as a file name may be: `_x.txt` and `ü.txt` were refused
        name = "".join(ch if (ch.isascii() and ch.isalnum()) or ch in "_.+-" else "_" for ch in Path(args.run).stem)
        name = name.lstrip("_.+-") or "run"
        _write_report_into(args.out, lambda out: write_report(
            {name: run},
            qrels,
            out,
            metrics=[s.label for s in specs],
            drop_self_hits=args.drop_self_hits,
            settings={"run": args.run, "qrels": args.qrels,
                      **({SHALLOW_NOTE: shallow} if shallow else {})},
        ))
    if args.json:
        payload: dict = dict(result.means)
        payload.update(
            num_queries=result.num_queries,
            skipped_unjudged=result.skipped_unjudged,
            missing_from_run=result.missing_from_run,
            drop_self_hits=result.drop_self_hits,
            per_query=result.per_query,
        )
        print(json.dumps(payload))
    else:
        print(format_metrics_table(result, per_query=args.per_query))
    return 0


def _warn_unreachable(args: argparse.Namespace, pipeline, qrels: dict, queries: dict) -> str | None:
    """Say when relevant documents of the split are not in the index: their queries cannot score them, and the
    scores came out low without a word (an index built from another corpus, or from part of this one).
    Returns the warning, for the report (it was on stderr only), or None."""
    judged = sorted({d for q in queries for d, rel in qrels.get(q, {}).items() if rel > 0})
    if not judged:
        return None
    present = pipeline.contains(judged)
    missing = [d for d, here in zip(judged, present) if not here]
    if not missing:
        return None
    lost = set(missing)
    hit = sum(any(d in lost and rel > 0 for d, rel in qrels.get(q, {}).items()) for q in queries)
    shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
    warning = (f"{len(missing):,} of the {len(judged):,} relevant documents of --split {args.split} are not in "
               f"--index {args.index} ({shown}); {hit:,} quer{'y' if hit == 1 else 'ies'} cannot reach them. Was "
               f"the index built from {os.path.join(args.dataset, 'corpus.jsonl')}?")
    print(f"twotower eval: warning: {warning}", file=sys.stderr)
    return warning


def _index_record(args: argparse.Namespace, pipeline) -> dict[str, Any]:
    """What the report records of the index searched, from its manifest (`SearchPipeline.info`): its absolute
    path, generation and document count, the encoder's model and fingerprint, and the fusion of --hybrid.

    Why: a report said only the path as typed, so which index, which commit of it and which encoder made
    the numbers could not be told afterwards (an index grows, and is rebuilt with other models in place).
    """
    from twotower.retrieval.fusion import DEFAULT_FUSION, RRF_K
    from twotower.retrieval.manifest import pipeline_block

    info = pipeline.info()
    encoder = pipeline_block(info["extra"], os.path.join(args.index, "manifest.json"))["encoder"]
    model = encoder.get("model") or {}
    record: dict[str, Any] = {
        "index": os.path.abspath(args.index),
        "index generation": info["generation"],
        "index documents": info["documents"],
        "encoder model": model.get("package") or model.get("path") or "(given at build time, not recorded)",
        "encoder fingerprint": encoder["fingerprint"],
    }
    if args.hybrid:  # the fusion `SearchPipeline.search` applies when none is given
        record["fusion"] = (f"{DEFAULT_FUSION} (reciprocal-rank fusion of dense and BM25, k={RRF_K})"
                            if DEFAULT_FUSION == "rrf" else DEFAULT_FUSION)
    return record


def _search_and_report(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from twotower.eval.io import load_beir
    from twotower.eval.report import REPORT_METRICS as report_metrics
    from twotower.eval.report import format_metrics_table, write_report
    from twotower.retrieval.rerank import recall_depth

    positive("-k", args.k)
    positive("--batch-size", args.batch_size)
    recall_k = recall_depth(args.recall_k, args.k)
    if recall_k < args.k:
        raise CLIError(f"--recall-k ({recall_k}) must be at least -k ({args.k})")
    if (args.rerank_k is not None or args.rerank_alpha is not None) and not args.reranker:
        flag = "--rerank-k" if args.rerank_k is not None else "--rerank-alpha"
        raise CLIError(f"{flag} sets how the reranked system reranks: add --reranker DIR (or --reranker default)")
    if args.rerank_k is not None and not 1 <= args.rerank_k <= recall_k:
        raise CLIError(f"--rerank-k ({args.rerank_k}) must be between 1 and --recall-k ({recall_k})")
    if args.rerank_alpha is not None and not 0.0 <= args.rerank_alpha <= 1.0:  # NaN fails too
        raise CLIError(f"--rerank-alpha must be between 0 and 1, got {args.rerank_alpha}")
    specs = _metrics(args.metrics, ",".join(report_metrics))
    dataset = load_beir(args.dataset, args.split, corpus=False)
    queries = dataset.split_queries()
    # the split's queries must be searchable: FILE:LINE: query '7' is empty (the search said "query 0 is empty");
    # the file is read again, for its line numbers, only when one is not
    from twotower.common.lines import query_problem

    if any(query_problem(text, "") for text in queries.values()):
        searchable_queries(os.path.join(args.dataset, "queries.jsonl"), only=queries)
    index_directory("--index", args.index)
    _report_out(args)  # before the search: a bad --out failed after it
    if args.reranker:
        reranker_directory("--reranker", args.reranker)
    first_stage_flags(args.hybrid, args.bm25, args.index, exclusive=False)  # both: two systems
    from twotower.retrieval.interpolation import first_stage_switches
    from twotower.retrieval.pipeline import SearchPipeline
    from twotower.retrieval.rerank import rerank_depth

    # rerank only when asked: a cross-encoder pass is slow, so the index's default reranker is not loaded
    pipeline = SearchPipeline.load(args.index, reranker=args.reranker, use_default_reranker=False)
    unreachable = _warn_unreachable(args, pipeline, dataset.qrels, queries)
    index_record = _index_record(args, pipeline)
    systems: list[tuple[str, bool, str]] = [("dense", False, "dense")]  # (name, rerank, first stage)
    if args.bm25:
        systems.append(("bm25", False, "bm25"))
    if args.hybrid:
        systems.append(("hybrid", False, "hybrid"))
    # the reranked system reranks the strongest first stage asked for: the hybrid, else BM25, else dense
    reranked_over = "hybrid" if args.hybrid else "bm25" if args.bm25 else "dense"
    if args.reranker:
        systems.append(("rerank" if reranked_over == "dense" else f"{reranked_over}+rerank", True, reranked_over))
    over = first_stage_switches(reranked_over)

    qids, texts = list(queries), list(queries.values())
    runs: dict[str, dict[str, dict[str, float]]] = {}
    weight: dict = {}
    if args.reranker:  # the weight the reranked system applies, and the first stage it was chosen over
        weight = {"rerank_k": rerank_depth(args.rerank_k, recall_k),
                  "rerank_alpha": pipeline.rerank_alpha(args.rerank_alpha, **over),
                  "rerank_alpha_chosen_over": "--rerank-alpha" if args.rerank_alpha is not None
                  else pipeline.rerank_alpha_chosen_over(**over)}
        if args.rerank_alpha is None:
            print_weight_origin(pipeline, **over)
    with pipeline:
        for name, rerank, stage in systems:
            run: dict[str, dict[str, float]] = {}
            starts = range(0, len(texts), args.batch_size)
            for start in tqdm(
                starts, desc=f"eval {name}", unit="batch", disable=args.no_progress, file=sys.stderr
            ):
                batch = texts[start : start + args.batch_size]
                results = pipeline.search(batch, k=args.k, recall_k=recall_k, rerank=rerank,
                                          **first_stage_switches(stage),
                                          rerank_k=args.rerank_k if rerank else None,
                                          rerank_alpha=args.rerank_alpha if rerank else None,
                                          fetch_documents=False, progress=False)
                for qid, hits in zip(qids[start : start + args.batch_size], results):
                    # trec_eval re-sorts by score (ties by id): the run keeps scores, not ranks
                    run[qid] = {hit.id: float(hit.score) for hit in hits}
            runs[name] = run

    shallow = _shallow_cutoffs(specs, runs, "-k {k} scores them in full", k=args.k)
    report = _write_report_into(args.out, lambda out: write_report(
        runs,
        dataset.qrels,
        out,
        metrics=[s.label for s in specs],
        drop_self_hits=args.drop_self_hits,
        max_k=100,
        title=f"{Path(args.dataset).name} ({args.split})",
        settings={
            "dataset": args.dataset,
            "split": args.split,
            **index_record,
            "reranker": args.reranker or "none",
            "k": args.k,
            "recall_k": recall_k,
            **weight,
            **({SHALLOW_NOTE: shallow} if shallow else {}),
            **({"relevant documents not in --index": unreachable} if unreachable else {}),
        },
    ))
    if args.json:
        print(json.dumps({name: ev.means for name, ev in report.evaluations.items()}))
    else:
        for name, ev in report.evaluations.items():
            print(f"== {name}")
            print(format_metrics_table(ev, per_query=args.per_query))
        print(f"report written to {report.out_dir}")
    return 0
