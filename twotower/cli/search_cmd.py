"""twotower search: query an index — a table for a person, JSON for programs, a TREC run for evaluation.

Recall takes the top --recall-k documents by dense similarity (with
--hybrid: dense and BM25 fused by reciprocal rank, k=60; with --bm25:
by BM25 alone, the query encoder not run); a cross-encoder
(--reranker DIR, or the index's default) reranks them and the top -k
are shown.  --queries FILE reads BEIR queries.jsonl ({_id, text}) or a
TSV of qid<TAB>text; --run FILE writes "qid Q0 docid rank score tag".
"""  # plain text, not reStructuredText: it is `twotower search --help`'s description

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from twotower.cli import CLIError
from twotower.cli.checks import (
    BATCH_HELP,
    BM25_HELP,
    argument_text_problem,
    error_prefix,
    filter_option,
    first_stage_flags,
    index_directory,
    input_file,
    model_directory,
    output_file,
    positive,
    refuse_reranker_with_no_rerank,
    reranker_directory,
    searchable_queries,
)
from twotower.cli.help_format import DefaultsRawDescriptionHelpFormatter
from twotower.cli.rerank_weight import print_weight_origin

QUERY_BATCH = 256


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("search", help="search an index (table, --json, or a TREC --run)",
                              description=__doc__, formatter_class=DefaultsRawDescriptionHelpFormatter)
    p.add_argument("queries", nargs="*", metavar="QUERY", help="query text(s)")
    p.add_argument("--index", required=True, help="index directory built by `twotower index build`")
    p.add_argument("--model", help="query encoder directory if the index's model moved (must be the same model)")
    p.add_argument("--reranker", help='cross-encoder directory, or "default" for the reranker twotower ships '
                                           "(default: the index's reranker, if any)")
    p.add_argument("-k", "--k", type=int, default=10, metavar="N", help="hits per query")
    p.add_argument("--recall-k", type=int, help="first-stage candidates (default 100, or -k when larger)")
    p.add_argument("--rerank-k", type=int, default=None, metavar="N",
                   help="how many of the first stage's top candidates the cross-encoder scores; the rest follow "
                        "in first-stage order (default 20, at most --recall-k)")
    p.add_argument("--hybrid", action="store_true", help="fuse dense and BM25 recall (index built with --bm25)")
    p.add_argument("--bm25", action="store_true", help=BM25_HELP)
    p.add_argument("--fusion", choices=["rrf", "minmax", "zscore"],
                   help="with --hybrid: reciprocal-rank fusion (default, k=60) or a normalised score sum")
    p.add_argument("--rerank", action="store_true",
                   help="rerank with the index's reranker, or with the reranker twotower ships (a delta over the "
                        "default all-MiniLM-L6-v2, trained on SciFact claims) when the index has none; same as "
                        "--reranker default then")
    p.add_argument("--no-rerank", action="store_true", help="first-stage results only")
    p.add_argument("--aggregate", choices=["max", "sum", "first"],
                   help="index built with --passages: a document scores its best passage (max, default), the sum "
                        "of its passages' scores, or its first passage's")
    p.add_argument("--filter", metavar="EXPR",
                   help="only documents whose metadata matches, e.g. 'lang == \"en\" and year >= 2010' "
                        "(==, !=, <, <=, >, >=, in [...], and, or, not; see the filter language in the docs)")
    p.add_argument("--rerank-alpha", type=float, default=None, metavar="A",
                   help="final = A * z(rerank) + (1 - A) * z(first stage) per query; default: the weight chosen "
                        "on dev and stored with the reranker, else 1 (pure reranking)")
    p.add_argument("--json", action="store_true", help="print a JSON list: one {query, hits} object per query")
    p.add_argument("--queries", dest="queries_file", metavar="FILE",
                   help="queries.jsonl ({_id, text}) or .tsv (qid<TAB>text)")
    p.add_argument("--run", help="write a TREC run file (qid Q0 docid rank score tag)")
    p.add_argument("--tag", help="run tag for --run (default twotower)")
    p.add_argument("--batch-size", type=int, help=BATCH_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_search)


ERROR_PREFIX = error_prefix("search")  # how twotower.cli.main prints a CLIError (the caret lines up under it)


def read_queries(path: str) -> list[tuple[int, str, str]]:
    """(line, qid, text) of BEIR queries.jsonl or a qid<TAB>text file, every query searchable
    (`searchable_queries`: eval's readers; errors name file and line)."""
    input_file("--queries", path, inside="queries.jsonl")
    from twotower.common.errors import DataError

    queries = searchable_queries(path)
    if not queries:
        raise DataError(path, None, "no queries")
    return queries


def _table(query: str, hits: list, reranked: bool, width: int = 100) -> str:
    """One query's hits as labeled columns: final score, and when reranked the first stage's rank and
    score next to the cross-encoder's raw score (``-`` below the reranked depth)."""
    lines = [f"query: {query}"]
    if not hits:
        return lines[0] + "\n  (no results)"
    if reranked:
        lines.append(f"{'rank':>4}  {'final':>8}  {'first stage':>12}  {'reranker':>8}  id")
    else:
        lines.append(f"{'rank':>4}  {'score':>8}  id")
    for h in hits:
        extra = ""
        if reranked:
            cross = "-" if h.rerank_score is None else f"{h.rerank_score:.3f}"
            extra = f"  {f'#{h.first_stage_rank} {h.first_stage_score:.3f}':>12}  {cross:>8}"
        lines.append(f"{h.rank:>4}  {h.score:>8.3f}{extra}  {h.id}")
        text = h.text[h.passage["start"]:h.passage["end"]] if h.passage and h.text else h.text  # the best passage
        body = f"{h.title} — {text}" if h.title else text
        lines.append(textwrap.shorten(body, width=width - 6, placeholder=" ...").join(["      ", ""]))
    return "\n".join(lines)


def run_search(args: argparse.Namespace) -> int:
    positive("-k", args.k)
    positive("--batch-size", args.batch_size)
    from twotower.retrieval.rerank import recall_depth  # numpy only: the pipeline's and the service's rule

    args.recall_k = recall_depth(args.recall_k, args.k)  # `-k 1000` alone was refused (--recall-k 100 < -k)
    if args.recall_k < args.k:
        raise CLIError(f"--recall-k ({args.recall_k}) must be at least -k ({args.k})")
    if args.rerank_k is not None and not 1 <= args.rerank_k <= args.recall_k:
        raise CLIError(f"--rerank-k ({args.rerank_k}) must be between 1 and --recall-k ({args.recall_k})")
    if args.rerank_alpha is not None and not 0.0 <= args.rerank_alpha <= 1.0:  # NaN fails too
        raise CLIError(f"--rerank-alpha must be between 0 and 1, got {args.rerank_alpha}")
    # flags that shape reranking, the way --hybrid's fusion and --run's tag shape theirs: each needs its mode
    rerank_flags = [flag for flag, value in (("--rerank-k", args.rerank_k), ("--rerank-alpha", args.rerank_alpha))
                    if value is not None]
    if rerank_flags and args.no_rerank:
        raise CLIError(f"{' and '.join(rerank_flags)} {'set' if len(rerank_flags) > 1 else 'sets'} how the reranker "
                       "reranks, but --no-rerank turns reranking off; give one of them")
    if args.fusion is not None and not args.hybrid:
        raise CLIError("--fusion sets how --hybrid fuses dense and BM25 recall: "
                       + ("--bm25 recalls by BM25 alone and fuses nothing; leave --fusion out" if args.bm25 else
                          "add --hybrid, or leave it out"))
    if args.model and args.bm25:
        raise CLIError("--model names the query encoder, which --bm25 recall does not run: leave --model out")
    if args.tag is not None and not args.run:
        raise CLIError("--tag names the run that --run writes: add --run FILE, or leave it out")
    if args.tag is not None:  # before the search: `--tag ""` became "twotower", and "my tag" failed after it
        from twotower.eval.io.trec import check_trec_token

        try:
            check_trec_token("--tag", args.tag)
        except ValueError as e:
            raise CLIError(str(e)) from None
    if args.json and args.run:
        raise CLIError("--run writes the results to a file and prints no hits: give --json or --run, not both")
    output_file("--run", args.run, "run.trec", inputs=(("--queries", args.queries_file),))  # it replaced them
    if args.rerank and args.no_rerank:
        raise CLIError("give --rerank or --no-rerank, not both")
    refuse_reranker_with_no_rerank(args.reranker, args.no_rerank)
    flt = filter_option(args.filter, "search")
    if args.queries_file and args.queries:
        raise CLIError("give queries as arguments or with --queries FILE, not both")
    if args.queries_file:
        lines = read_queries(args.queries_file)  # a query that cannot be searched is FILE:LINE: query 'id' ...
        items = [(qid, text) for _, qid, text in lines]
        if args.run:  # found only when the run was written, naming no file
            from twotower.eval.io.trec import check_trec_token

            for line, qid, _ in lines:
                try:
                    check_trec_token("query id", qid)
                except ValueError as e:
                    raise CLIError(f"--queries {args.queries_file}:{line}: {e} (--run)") from None
    elif args.queries:
        items = [(f"q{i}", q) for i, q in enumerate(args.queries, 1)]
        for i, (_, text) in enumerate(items, 1):  # "query q1 is empty" named an id nobody gave: they are numbered
            if problem := argument_text_problem(text, f"QUERY {i}" if len(items) > 1 else "QUERY"):
                raise CLIError(problem)
    else:
        raise CLIError("give at least one QUERY, or --queries FILE")
    index_directory("--index", args.index)
    if args.model:
        model_directory("--model", args.model, dual=True)
    if args.reranker:
        reranker_directory("--reranker", args.reranker)
    first_stage_flags(args.hybrid, args.bm25, args.index)
    from tqdm.auto import tqdm

    from twotower.indexing.filters import FilterError
    from twotower.retrieval.pipeline import SearchPipeline
    from twotower.retrieval.rerank import rerank_depth

    pipe = SearchPipeline.load(args.index, args.model, reranker=args.reranker, use_default_reranker=not args.no_rerank,
                               fallback_reranker="default" if args.rerank else None)  # --rerank: the index's, else ours
    with pipe:
        if rerank_flags and pipe.reranker is None:
            raise CLIError(f"{' and '.join(rerank_flags)}: the index {args.index} has no default reranker and no "
                           "--reranker DIR was given, so nothing reranks; give --rerank, --reranker DIR or drop "
                           f"{' and '.join(rerank_flags)}")
        if args.aggregate is not None and pipe.passages is None:
            raise CLIError(f"--aggregate: the index {args.index} stores documents whole (built without --passages), "
                           "so there are no passage scores to combine; leave it out")
        reranked = pipe.reranker is not None and not args.no_rerank
        switches = {"hybrid": args.hybrid, "bm25": args.bm25}
        skipped = reranked and pipe.rerank_alpha(args.rerank_alpha, **switches) == 0.0  # the pipeline skips the cross-encoder
        reranked = reranked and not skipped
        weight = pipe.rerank_alpha(args.rerank_alpha, **switches) if reranked else None
        chosen = "--rerank-alpha" if args.rerank_alpha is not None else (
            f"chosen on dev over {pipe.rerank_alpha_chosen_over(**switches) or 'an unrecorded first stage'}")
        if pipe.reranker is not None and not args.no_rerank and args.rerank_alpha is None:
            print_weight_origin(pipe, args.hybrid, args.bm25)
        recall = min(args.recall_k, len(pipe))  # the first stage cannot return more than the index holds
        results = []
        show = not args.no_progress and len(items) > QUERY_BATCH
        for s in tqdm(range(0, len(items), QUERY_BATCH), desc="search", unit="batch", disable=not show):
            batch = [text for _, text in items[s:s + QUERY_BATCH]]
            try:
                results += pipe.search(batch, k=args.k, recall_k=args.recall_k, rerank=not args.no_rerank,
                                       hybrid=args.hybrid, bm25=args.bm25, fusion=args.fusion,
                                       batch_size=args.batch_size,
                                       rerank_alpha=args.rerank_alpha, rerank_k=args.rerank_k, filter=flt,
                                       aggregate=args.aggregate)
            except FilterError as e:  # a field no document of the index has
                raise CLIError(str(e.renamed("--filter", indent=len(ERROR_PREFIX)))) from None
    if args.run:
        from twotower.eval.io import write_trec_run

        run = {qid: {h.id: h.score for h in hits} for (qid, _), hits in zip(items, results)}
        write_trec_run(run, args.run, tag="twotower" if args.tag is None else args.tag)
        lines = sum(len(scores) for scores in run.values())
        print(f"wrote {lines:,} line{'s' * (lines != 1)} for {len(items):,} quer{'y' if len(items) == 1 else 'ies'} "
              f"to {args.run}", file=sys.stderr)
        return 0
    if args.json:
        print(json.dumps([{"qid": qid, "query": text, "hits": [h.to_dict() for h in hits]}
                          for (qid, text), hits in zip(items, results)], ensure_ascii=False))
        return 0
    mode = "hybrid (dense + BM25, " + (args.fusion or "rrf") + ")" if args.hybrid else "BM25" if args.bm25 else "dense"
    if skipped and args.rerank_alpha is not None:  # the user's 0, not the reranker's stored weight
        note = "recall only: --rerank-alpha 0 gives the reranker no weight, so it was not run"
    elif skipped:
        note = ("recall only: the reranker's interpolation weight is 0 (it did not beat the first stage on dev), "
                "so it was not run; --rerank-alpha overrides")
    elif reranked:
        depth = min(rerank_depth(args.rerank_k, args.recall_k), recall)
        # the weight the final score applies, which the table's columns do not show
        note = f"top {depth} reranked by the cross-encoder, weight {weight:g} ({chosen})"
    else:
        note = "recall only (no reranker)"
    print(f"# {mode} recall of {recall}, {note}")
    for (_, text), hits in zip(items, results):
        print(_table(text, hits, reranked))
        print()
    return 0
