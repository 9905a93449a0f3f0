"""twotower answer: retrieve, rerank, then read answer spans from the top passages.

The reader is a QA model from twotower finetune qa; its "no answer"
threshold (chosen on dev) decides when a passage holds no answer, and when
none does the command says so instead of printing the highest-scoring guess.
--classifier DIR adds a label from a classification head to each hit read.
"""  # plain text, not reStructuredText: it is `twotower answer --help`'s description

from __future__ import annotations

import argparse
import json
import sys

from twotower.cli import CLIError
from twotower.cli.checks import (
    BM25_HELP,
    argument_text_problem,
    error_prefix,
    filter_option,
    first_stage_flags,
    index_directory,
    model_directory,
    positive,
    refuse_reranker_with_no_rerank,
    reranker_directory,
)
from twotower.cli.help_format import DefaultsRawDescriptionHelpFormatter


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("answer", help="answer a question from an index with a QA reader",
                              description=__doc__, formatter_class=DefaultsRawDescriptionHelpFormatter)
    p.add_argument("questions", nargs="+", metavar="QUESTION", help="question text(s)")
    p.add_argument("--index", required=True, help="index directory built by `twotower index build`")
    p.add_argument("--reader", required=True, help="QA model directory from `twotower finetune qa`")
    p.add_argument("--reranker", help='cross-encoder directory, or "default" for the reranker twotower ships '
                                           "(default: the index's reranker, if any)")
    p.add_argument("--no-rerank", action="store_true",
                   help="first-stage ranking only: no reranker, not even the index's")
    p.add_argument("--hybrid", action="store_true", help="fuse dense and BM25 recall")
    p.add_argument("--bm25", action="store_true", help=BM25_HELP)
    p.add_argument("--filter", metavar="EXPR",
                   help="read only documents whose metadata matches, e.g. 'lang == \"en\"' (as in `twotower search`)")
    p.add_argument("-k", "--passages", type=int, default=5, metavar="N", help="passages read per question")
    p.add_argument("--recall-k", type=int, help="first-stage candidates (default 100, or -k when larger)")
    p.add_argument("--answers", type=int, default=3, metavar="N", help="answers shown per question")
    p.add_argument("--classifier", help="classification model directory: label each passage read")
    p.add_argument("--retrieval-weight", type=float, default=0.0,
                   help="rank answers by span score + this * passage score (BERTserini; choose on dev)")
    p.add_argument("--json", action="store_true", help="print JSON: one {question, answers, hits} per question")
    p.add_argument("--device", default="cpu", help="where the reader and reranker run: cpu, cuda, cuda:1 ...")
    p.set_defaults(func=run_answer)


def run_answer(args: argparse.Namespace) -> int:
    positive("--passages", args.passages)
    positive("--answers", args.answers)
    from twotower.retrieval.rerank import recall_depth  # numpy only: search's and eval's rule

    args.recall_k = recall_depth(args.recall_k, args.passages)  # `-k 200` alone was refused
    if args.recall_k < args.passages:  # as search and eval say it, before the models load
        raise CLIError(f"--recall-k ({args.recall_k}) must be at least -k ({args.passages})")
    if not 0 <= args.retrieval_weight < float("inf"):  # NaN fails too: it ranked every answer by NaN
        raise CLIError(f"--retrieval-weight must be a number >= 0, got {args.retrieval_weight}")
    refuse_reranker_with_no_rerank(args.reranker, args.no_rerank)
    for i, q in enumerate(args.questions, 1):
        problem = argument_text_problem(q, f"question {i}")
        if problem:
            raise CLIError(problem)
    for flag, path in (("--reader", args.reader), ("--classifier", args.classifier)):
        if path:
            model_directory(flag, path)
    if args.reranker:
        reranker_directory("--reranker", args.reranker)
    flt = filter_option(args.filter, "answer")
    index_directory("--index", args.index)
    first_stage_flags(args.hybrid, args.bm25, args.index)
    from twotower.encoder.finetuning.task_model import TaskModel
    from twotower.indexing.filters import FilterError
    from twotower.retrieval.pipeline import SearchPipeline

    def task_model(flag: str, path: str) -> TaskModel:
        try:
            return TaskModel.from_pretrained(path, device=args.device)
        except ValueError as e:  # an encoder without a task head: the message named the path, not the flag
            raise CLIError(f"{flag}: {e}") from None

    reader = task_model("--reader", args.reader)
    if reader.info.head != "qa":
        raise CLIError(f"{args.reader} holds a {reader.info.head!r} head; --reader needs a QA model")
    classifier = task_model("--classifier", args.classifier) if args.classifier else None
    if classifier is not None and classifier.info.head != "classify":
        raise CLIError(f"{args.classifier} holds a {classifier.info.head!r} head; --classifier needs 'classify'")
    with SearchPipeline.load(args.index, reranker=args.reranker, use_default_reranker=not args.no_rerank,
                             device=args.device) as pipe:
        try:
            results = pipe.answer(args.questions, reader, k=args.passages, recall_k=args.recall_k,
                                  rerank=not args.no_rerank, hybrid=args.hybrid, bm25=args.bm25,
                                  max_answers=args.answers,
                                  retrieval_weight=args.retrieval_weight, classifier=classifier, filter=flt)
        except FilterError as e:  # a field no document of the index has
            raise CLIError(str(e.renamed("--filter", indent=len(error_prefix("answer"))))) from None
    if args.json:
        out = [{"question": r.question, "answers": [a.to_dict() for a in r.answers],
                "hits": [{"id": h.id, "rank": h.rank, "score": h.score,
                          **({"label": {"label": h.label, "score": h.label_score}} if classifier else {})}
                         for h in r.hits]}
               for r in results]
        json.dump(out, sys.stdout, ensure_ascii=False, indent=1)
        sys.stdout.write("\n")
        return 0
    for r in results:
        print(f"Q: {r.question}")
        for a in r.answers:
            if a.no_answer:
                print("  no answer in the top passages")
            else:
                print(f"  {a.text!r}  passage {a.passage_id} (rank {a.passage_rank}) chars {a.start}-{a.end}"
                      f"  score {a.score:.3f}")
        if classifier is not None:
            for h in r.hits:
                print(f"    hit {h.rank} {h.id}: {h.label} ({h.label_score:.3f})" if h.label is not None
                      else f"    hit {h.rank} {h.id}: -")
    return 0
