"""twotower train dual|reranker|mine|pairs|demo-reranker: contrastive and reranker training from the shell.

Examples:
    twotower train dual --model MINILM_DIR --data data/beir-scifact --out runs/dual --mine bm25 --time-budget 40m
    twotower train mine --data data/beir-scifact --out negatives.jsonl --retriever dense --model runs/dual/best
    twotower train reranker --model MINILM_DIR --pairs data/beir-scifact --out runs/reranker --negatives negatives.jsonl
    twotower train reranker --model MINILM_DIR --pairs pairs.tsv --loss pointwise --out runs/reranker
    twotower train pairs --corpus corpus.jsonl --method crop --out crops.jsonl      # self-supervised pairs
    torchrun --nproc-per-node 2 -m twotower train dual ...                          # negatives from all ranks
    torchrun --nproc-per-node 2 -m twotower train reranker ...                      # each rank its share of a batch

Each run writes ``OUT/train_log.jsonl``, ``OUT/dev_ndcg.png``, ``OUT/summary.json`` and the
checkpoint chosen on the dev split (carved from train) as ``OUT/best``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import re
import sys

from twotower.cli.checks import (
    encoder_directory,
    input_file,
    max_length_fits,
    model_directory,
    output_file,
    positive,
    reranker_directory,
)
from twotower.cli.help_format import DefaultsHelpFormatter
from twotower.retrieval.training.demo_reranker import train_demo_reranker as _demo_reranker  # stdlib: cheap

TEACHER_HELP = ("dual encoder whose scores the reranker also learns (listwise distillation); an index built from "
                "{corpus} lends its vectors and query encoder (no document is encoded again); "
                "'default' (or 'embedded') = all-MiniLM-L6-v2, the default dense model, as --model default")


RESIDUAL_HELP = ("train the reranker as a correction to the --teacher's scores (the label loss reads their sum; "
                 "no distillation term); dev then chooses the checkpoint on the interpolated ranking")

WINDOW_HELP = ("read each document as windows of N text tokens (its title in front of each) and score it by its "
               "best window; saved with the reranker, so searches read windows too (default: the head of each "
               "document up to --max-length)")

DEV_SEED_HELP = ("carve dev with this seed instead of --seed, so runs that differ only in --seed choose on the "
                 "same queries (and can be averaged: twotower train soup)")

TEACHER_BM25_HELP = ("add BM25's scores, rescaled to the --teacher's spread, to the teacher with weight W "
                     "(0: the dense teacher alone)")


def parse_duration(flag: str, text: str | None) -> float | None:
    """The seconds of a duration flag ('45m', '2h', '1h30m', '90s' or plain seconds); None stays None."""
    if text is None:
        return None
    from twotower.encoder.training.budget import parse_duration as seconds

    try:
        return seconds(text)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected a duration like 45m, 2h, 1h30m, 90s or a number of seconds") from None


def parse_ranks(flag: str, text: str) -> tuple[int, int]:
    """A 1-based inclusive rank window "START-END", refused in the flag's words before any data is read."""
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    if not m:
        raise ValueError(f"{flag} {text!r}: expected START-END, e.g. 10-100")
    start, end = int(m.group(1)), int(m.group(2))
    if not 1 <= start <= end:
        raise ValueError(f"{flag} {text}: ranks count from 1 and START must not exceed END, e.g. 10-100")
    return start, end


# What `train dual` and `train reranker` take when --lr or --mine-ranks is not given (both stay None in `args`, so
# that `--lr 0` is told from no --lr): (learning rate, mining rank window).
# demo-reranker's defaults, for --help: the trainer's own
_DEMO = {name: p.default for name, p in inspect.signature(_demo_reranker).parameters.items()}
DUAL_DEFAULTS = (2e-5, (10, 100))
RERANKER_DEFAULTS = (3e-5, (1, 100))


def _common(p: argparse.ArgumentParser, defaults: tuple[float, tuple[int, int]],
            mine: tuple[str, ...] = ("bm25", "none")) -> None:
    """The flags `train dual` and `train reranker` share; `defaults`: the trainer's `DUAL_DEFAULTS` or
    `RERANKER_DEFAULTS`, for --help."""
    lr, (first, last) = defaults
    p.add_argument("--out", required=True, metavar="DIR", help="run directory (best checkpoint in DIR/best)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run --out already holds, once the new run is complete (it is built in "
                        "DIR.unfinished meanwhile; without --overwrite such an --out is refused)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out exactly from its last saved state (saved after each dev "
                        "evaluation and every --save-every steps), with the run's own settings and files")
    p.add_argument("--save-every", type=int, default=None, metavar="N",
                   help="also save the run's state every N steps, for --resume (default: at each evaluation)")
    p.add_argument("--split", help="qrels split of a BEIR directory to train on (default: train)")
    p.add_argument("--corpus", default=None, metavar="FILE", help="corpus.jsonl resolving document ids in JSONL data")
    p.add_argument("--negatives", default=None, metavar="FILE", help="mined negatives JSONL (twotower train mine)")
    p.add_argument("--mine", choices=list(mine), default="bm25",
                   help="mine negatives before training when --negatives is not given"
                        + (" (dense: the --teacher's ranking)" if "dense" in mine else ""))
    p.add_argument("--mine-ranks", default=None, metavar="A-B",
                   help=f"1-based inclusive rank window --mine draws negatives from (default {first}-{last})")
    p.add_argument("--epochs", type=float, default=1.0,
                   help="passes over the training queries (a fraction is allowed)")
    p.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="train N optimizer steps instead of --epochs (--time-budget may stop it sooner)")
    p.add_argument("--time-budget", default=None, help="stop after this long (e.g. 45m); the LR schedule follows it")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (AdamW; default {lr:.0e})".replace("e-0", "e-"))  # 2e-5, not 2e-05
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of the run spent warming up")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (not on biases and norms)")
    p.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="clip the gradient to this norm before each step (inf: no clipping)")
    p.add_argument("--dev-fraction", type=float, default=0.1, help="share of train queries carved out as dev")
    p.add_argument("--dev-size", type=int, default=None, help="number of dev queries (overrides --dev-fraction)")
    p.add_argument("--dev-by", choices=["query", "document"], default="query",
                   help="carve dev by query, or by document: no dev query's positive is a training query's "
                        "(choose for documents training has not seen)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between dev evaluations (default: an epoch)")
    p.add_argument("--eval-interval", default=None, help="also evaluate after this long (e.g. 10m)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the run's draws: the dev split (unless --dev-seed), batches, random negatives")
    p.add_argument("--dev-seed", type=int, default=None, help=DEV_SEED_HELP)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument("--no-bf16", action="store_true", help="train in float32 even where bf16 is native")
    p.add_argument("--save-last", action="store_true", help="also keep the final weights in DIR/last")
    p.add_argument("--dry-run", action="store_true", help="one step and one evaluation, to check the setup")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def register(subparsers) -> None:
    train = subparsers.add_parser("train", help="train a dual encoder or a reranker; mine negatives",
                                  description=__doc__.splitlines()[0])
    sub = train.add_subparsers(dest="train_command", metavar="KIND")
    train.set_defaults(func=lambda args: (train.print_help(), 2)[1])

    p = sub.add_parser("dual", help="contrastive dual-encoder training (InfoNCE)",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR|default",
                   help='starting HF BERT / sentence-transformers dir, or "default": the embedded all-MiniLM-L6-v2')
    p.add_argument("--data", required=True, metavar="BEIR_DIR|FILE.jsonl",
                   help="training queries: a BEIR directory, or JSONL of {query, pos, neg} (texts, or ids with "
                        "--corpus)")
    _common(p, DUAL_DEFAULTS)
    p.add_argument("--separate-towers", action="store_true", help="untie query and document weights")
    p.add_argument("--pooling", choices=["mean", "cls", "max"], default=None,
                   help="how token states become one vector (default: the model directory's, else mean)")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="L2-normalise the vectors: cosine scores (default: the model directory's setting, else on; "
                        "with --freeze-documents, else off)")
    p.add_argument("--query-prefix", default=None, help="text put before every query (default: the model directory's)")
    p.add_argument("--document-prefix", "--doc-prefix", dest="document_prefix", default=None,
                   help="text put before every document (default: the model directory's)")
    p.add_argument("--query-max-length", type=int,
                   help="query tokens (default 64, or the positions the model was trained on if fewer)")
    p.add_argument("--doc-max-length", type=int,
                   help="document tokens (default 256, or the positions the model was trained on if fewer)")
    p.add_argument("--train-doc-max-length", type=int, default=None, metavar="N",
                   help="document tokens while training, for cheaper steps; dev and the saved model keep "
                        "--doc-max-length (default: --doc-max-length)")
    p.add_argument("--batch-size", type=int, default=32, help="queries per step (per rank under torchrun)")
    p.add_argument("--hard-negatives", type=int, default=1, help="hard negatives per query")
    p.add_argument("--grad-cache-chunk", type=int, default=None, metavar="N",
                   help="GradCache: run the encoder on N texts at a time, so activation memory depends on N, not "
                        "--batch-size (default: the whole batch at once)")
    p.add_argument("--temperature", type=float, default=0.05, help="InfoNCE temperature the scores are divided by")
    p.add_argument("--learn-temperature", action="store_true",
                   help="train the temperature (kept in [0.01, 1]), starting from --temperature")
    p.add_argument("--symmetric", action="store_true", help="add the document->query loss")
    p.add_argument("--dev-pool", type=int, default=None, help="evaluate over dev positives + N documents")
    p.set_defaults(func=run_dual, torchrun=True)

    p = sub.add_parser("reranker", help="cross-encoder reranker training (listwise or pointwise)",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR|default",
                   help="encoder checkpoint (a fresh head), reranker directory (continued), or 'default': "
                        "continue the reranker twotower ships on your labels")
    p.add_argument("--pairs", required=True, metavar="FILE(.tsv|.jsonl)|BEIR_DIR",
                   help="labeled pairs (query, passage, label as TSV or JSONL), a BEIR directory, or JSONL of "
                        "{query, pos, neg}")
    _common(p, RERANKER_DEFAULTS, mine=("bm25", "dense", "none"))
    p.add_argument("--first-stage", default=None, metavar="bm25|dense|RUN",
                   help="what dev reranks, where the checkpoint and the interpolation weight search applies are "
                        "chosen: BM25's ranking, the --teacher's (the default with --teacher: search reranks a "
                        "dense index's), or a TREC run of the dev queries (default: dense with --teacher, else bm25)")
    p.add_argument("--loss", choices=["listwise", "pointwise"], default="listwise",
                   help="listwise: softmax cross-entropy over groups of a positive and negatives; pointwise: "
                        "binary cross-entropy on labeled pairs")
    p.add_argument("--group-size", type=int, default=8, help="listwise: 1 positive + N-1 negatives")
    p.add_argument("--batch-size", type=int, default=4,
                   help="groups (listwise) or pairs (pointwise) per step (per rank under torchrun)")
    p.add_argument("--max-length", type=int, help="tokens per query-document pair (default 256, or the model's "
                                                 "maximum if less)")
    p.add_argument("--dev-rerank-k", type=int, default=None,
                   help="first-stage depth each dev evaluation reranks, where the interpolation weight is chosen "
                        "(default 20: search's --rerank-k default)")
    p.add_argument("--collapse-std", type=float, default=1e-3,
                   help="stop when the standard deviation of dev scores, or of the training logits over the last "
                        "20 steps, falls below this: a collapsed reranker ranks at random (0: never)")
    p.add_argument("--head-pooling", choices=["cls", "mean"], default="cls",
                   help="what a fresh relevance head reads: the [CLS] pooler (loads in transformers and "
                        "sentence-transformers) or the token mean (learns faster from mean-pooling sentence "
                        "encoders; only twotower scores it)")
    p.add_argument("--trainable-layers", type=int, default=None, metavar="N",
                   help="train only the top N encoder layers and the head (default: all); faster steps, and "
                        "the result differs from its base in N layers only")
    p.add_argument("--teacher", default=None, metavar="DIR|INDEX|default",
                   help=TEACHER_HELP.format(corpus="the --pairs corpus"))
    p.add_argument("--distill-weight", type=float, default=None,
                   help="with --teacher: weight of the distillation term (default 1)")
    p.add_argument("--teacher-bm25", type=float, default=0.0, metavar="W", help=TEACHER_BM25_HELP)
    p.add_argument("--residual", action="store_true", help=RESIDUAL_HELP)
    _window_flags(p)
    p.set_defaults(func=run_reranker, torchrun=True)

    p = sub.add_parser("mine", help="mine hard negatives from BM25 or a dense model into JSONL",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--data", required=True, metavar="BEIR_DIR|FILE.jsonl",
                   help="the training queries, as `train dual --data` reads them")
    p.add_argument("--out", required=True, metavar="FILE.jsonl",
                   help="the mined negatives (train dual|reranker --negatives), and the settings in FILE.meta.json")
    p.add_argument("--split", help="qrels split of a BEIR directory to mine for (default: train)")
    p.add_argument("--corpus", default=None, metavar="FILE", help="corpus.jsonl resolving document ids in JSONL data")
    p.add_argument("--retriever", choices=["bm25", "dense"], default="bm25",
                   help="what ranks the candidates: BM25, or the dual encoder --model")
    p.add_argument("--model", default=None, metavar="DIR|default",
                   help='dual encoder for --retriever dense ("default": the embedded all-MiniLM-L6-v2)')
    p.add_argument("--ranks", default="10-100", help="1-based inclusive rank window")
    p.add_argument("--num-negatives", type=int, default=8, metavar="N",
                   help="negatives kept per query, drawn at random from the --ranks window")
    p.add_argument("--margin", type=float, default=None, help="drop candidates scored above positive - margin")
    p.add_argument("--max-ratio", type=float, default=None, help="drop candidates above ratio x positive score")
    p.add_argument("--random", type=int, default=0, help="random negatives added per query")
    p.add_argument("--seed", type=int, default=0, help="seed of the negatives drawn")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_mine)

    p = sub.add_parser("pairs", help="self-supervised pairs from a corpus (cropping / inverse cloze)",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--corpus", required=True, metavar="FILE", help="corpus.jsonl")
    p.add_argument("--method", choices=["crop", "ict"], default="crop",
                   help="crop: two random spans of a document; ict (inverse cloze): a sentence and the rest of "
                        "its document")
    p.add_argument("--out", required=True, metavar="FILE.jsonl",
                   help="the pairs as {query, pos} JSONL (train dual --data)")
    p.add_argument("--pairs-per-document", type=int, default=1, help="crop: pairs drawn per document")
    p.add_argument("--seed", type=int, default=0, help="seed of the spans and sentences drawn")
    p.set_defaults(func=run_pairs)

    p = sub.add_parser("demo-reranker", help="train the small reranker the README demo uses (minutes on a CPU)",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--out", required=True, metavar="DIR",
                   help="run directory (the reranker in DIR/best); an earlier demo run there is reused or redone")
    p.add_argument("--model", default=None, metavar="DIR", help="default: all-MiniLM-L6-v2")
    p.add_argument("--corpus", default=None, metavar="FILE", help="default: the bundled SciFact sample")
    p.add_argument("--claims", default="bundled", metavar="FILE",
                   help="{query, pos: [doc ids]} JSONL over --corpus; 'bundled' = SciFact train claims for the "
                        "bundled sample; 'none' = self-supervised title/text pairs")
    p.add_argument("--titles", type=int, default=None, metavar="N",
                   help=f"with --claims none: documents whose titles become queries (default {_DEMO['titles']})")
    p.add_argument("--steps", type=int, default=None, metavar="N", help=f"optimizer steps (default {_DEMO['steps']})")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N encoder layers (default: all)")
    p.add_argument("--trainable-layers", type=int, default=None, metavar="N",
                   help="train only the top N encoder layers and the head (default: all)")
    p.add_argument("--max-length", type=int, default=None, help=f"tokens per claim/abstract pair (default {_DEMO['max_length']})")
    p.add_argument("--evals", type=int, default=None,
                   help=f"dev evaluations, evenly spaced, the last at the end (default {_DEMO['evals']}; the runs in "
                        "docs/results.md before this flag used 3)")
    p.add_argument("--head-pooling", choices=["cls", "mean"], default=None,
                   help="what the relevance head reads: the [CLS] pooler (default) or the token mean")
    p.add_argument("--lr", type=float, default=None, help=f"learning rate (default {_DEMO['lr']:g})")
    p.add_argument("--teacher", default=None, metavar="DIR|INDEX|default",
                   help=TEACHER_HELP.format(corpus="--corpus"))
    p.add_argument("--distill-weight", type=float, default=None,
                   help=f"with --teacher: weight of the distillation term (default {_DEMO['distill_weight']:g})")
    p.add_argument("--teacher-bm25", type=float, default=0.0, metavar="W", help=TEACHER_BM25_HELP)
    p.add_argument("--residual", action="store_true", help=RESIDUAL_HELP)
    p.add_argument("--mine", choices=["bm25", "dense"], default="bm25",
                   help="labeled claims: mine negatives with BM25 or the --teacher's ranking")
    p.add_argument("--first-stage", choices=["bm25", "dense"], default=None,
                   help="what dev reranks to choose the checkpoint and weight: BM25's or the --teacher's top 20 "
                        "(default: dense with --teacher, else bm25)")
    p.add_argument("--dev-by", choices=["query", "document"], default="query",
                   help="carve dev by claim, or by document: no dev claim's evidence is a training claim's")
    _window_flags(p)
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the run's draws: the dev split (unless --dev-seed), batches, negatives")
    p.add_argument("--dev-seed", type=int, default=None, help=DEV_SEED_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_demo)

    p = sub.add_parser("soup", help="average rerankers trained with different seeds into one, scored on their dev",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="--out directories of reranker runs (or their best/ checkpoints) with the same data, "
                        "start and --dev-seed")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the averaged reranker (use it as --reranker DIR): a new or empty directory, or an earlier "
                        "soup with --overwrite")
    p.add_argument("--overwrite", action="store_true", help="replace the earlier soup --out holds")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_soup)


def _window_flags(p: argparse.ArgumentParser) -> None:
    """--passage-window / --passage-stride / --max-windows: how a reranker reads long documents (`_windows`)."""
    p.add_argument("--passage-window", type=int, default=None, metavar="N", help=WINDOW_HELP)
    p.add_argument("--passage-stride", type=int, default=None, metavar="N",
                   help="tokens between window starts (default: two thirds of --passage-window)")
    p.add_argument("--max-windows", type=int, default=None, metavar="N",
                   help="with --passage-window: score at most N windows of a document per query, those BM25 "
                        "ranks best among its windows (0: every window; default 3)")
    p.add_argument("--window-choice", choices=("model", "bm25"), default="model",
                   help="with --passage-window: the window of a training document each step trains on: the one "
                        "the model scores best (default; scores the kept windows first) or the one BM25 ranks "
                        "best for the query (no extra forward pass, ~40%% less time a step)")


def _check_out(path: str) -> None:
    if os.path.isfile(path):
        raise ValueError(f"--out {path} is a file; give a directory")


def _check_run_out(args) -> None:
    """A training --out that holds an earlier run's checkpoint is refused unless --overwrite: the new run's first
    evaluation would replace the earlier best/ checkpoint, which a mistyped --out (or a Ctrl-C a minute
    later) then loses for good."""
    _check_out(args.out)
    from twotower.common.atomic import recover_replaced_dir, staging_dir
    from twotower.common.paths import working_directory_refusal
    from twotower.retrieval.training.training_run import STATE_DIR, beside_run, beside_run_message

    # only a run that will swap its directory in for --out (--overwrite, or resuming such a run) replaces it:
    # an in-place run, resumed in its own directory beside the user's notes, replaces nothing
    swaps = args.overwrite or (args.resume and os.path.isdir(os.path.join(staging_dir(args.out), STATE_DIR)))
    if swaps and (problem := working_directory_refusal(args.out, f"--out {args.out}", "a run",
                                                        "--out run", overwrite=True)):
        raise ValueError(problem)
    recover_replaced_dir(os.path.join(args.out, "best"))  # a save killed mid-swap left it moved aside
    if swaps and (theirs := beside_run(args.out)):  # the swap would delete them with the earlier run
        raise ValueError(beside_run_message(args.out, theirs))
    # only a checkpoint is worth keeping: a run that stopped on bad input before one leaves just its log
    if os.path.isdir(os.path.join(args.out, "best")) and not (args.overwrite or args.resume):
        raise ValueError(f"--out {args.out} already holds a trained checkpoint ({os.path.join(args.out, 'best')}); "
                         "pass --overwrite to replace it, or give another --out")


def _trained(args, train) -> object:
    """`train()`, and on Ctrl-C the line the command prints says what ``--resume`` would continue from."""
    from twotower.cli import resumable

    def saved_at() -> str | None:
        from twotower.retrieval.training.resume import saved_steps

        steps = saved_steps(args.out)
        return None if steps is None else f"step {steps}"

    return resumable(args, train, saved_at, lambda: os.path.isdir(os.path.join(args.out, "best")))


def _split(split: str | None, flag: str, data: str) -> str:
    """The qrels split to read: `--split` picks one of a BEIR directory's; a file of pairs has none, so there it
    would be ignored."""
    if split is None:
        return "train"
    if os.path.isfile(data):  # a missing path is reported by the reader, naming it
        raise ValueError(f"--split {split} picks a qrels split of a BEIR directory, but {flag} {data} is a file "
                         "(a file of pairs has no splits): drop --split")
    return split


def _data(args) -> tuple[str, str]:
    """(flag, path) of the training data: `--data` (train dual, train mine) or `--pairs` (train reranker)."""
    return ("--data", args.data) if hasattr(args, "data") else ("--pairs", args.pairs)


def _inputs(args) -> None:
    """The training inputs exist, each missing one named by its flag; the readers said "training data not
    found: X" and "mined negatives file not found: X". Checked after the flags and the model, before any data
    is read."""
    flag, data = _data(args)
    corpus, negatives = args.corpus, getattr(args, "negatives", None)
    if not os.path.exists(data):
        raise ValueError(f"{flag} {data}: not found; give a BEIR directory or a .jsonl(.gz) file of "
                         "{query, pos, neg}")
    if corpus:
        input_file("--corpus", corpus, inside="corpus.jsonl")
    if negatives:
        input_file("--negatives", negatives)


def _settings(args, default_ranks: tuple[int, int]) -> dict:
    """The `TrainSettings` (and mining) fields of the flags `_common` adds, as config keywords."""
    if args.mine_ranks and (args.negatives or args.mine == "none"):  # nothing is mined: it would be ignored
        raise ValueError("--mine-ranks sets the ranks --mine draws negatives from, but "
                         + ("--negatives FILE gives them" if args.negatives else "--mine none mines nothing")
                         + ": drop --mine-ranks")
    if args.mine_ranks and getattr(args, "loss", "listwise") == "pointwise":
        raise ValueError("--mine-ranks sets the ranks negatives are mined from, but --loss pointwise trains on the "
                         "labeled pairs alone: drop --mine-ranks")
    data_flag, data = _data(args)
    return dict(
        out=args.out, corpus=args.corpus, negatives=args.negatives, split=_split(args.split, data_flag, data),
        mine=None if (args.negatives or args.mine == "none") else args.mine,
        mine_ranks=parse_ranks("--mine-ranks", args.mine_ranks) if args.mine_ranks else default_ranks,
        epochs=args.epochs, max_steps=args.max_steps, time_budget=parse_duration("--time-budget", args.time_budget),
        warmup=args.warmup, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        bf16=False if args.no_bf16 else "auto", seed=args.seed, dev_fraction=args.dev_fraction,
        dev_size=args.dev_size, dev_by=args.dev_by, dev_seed=args.dev_seed, eval_every=args.eval_every,
        eval_interval_s=parse_duration("--eval-interval", args.eval_interval), save_last=args.save_last,
        progress=not args.no_progress, device=args.device, dry_run=args.dry_run, overwrite=args.overwrite,
        resume=args.resume, save_every=args.save_every,
    )


def run_dual(args) -> int:
    _check_run_out(args)
    from twotower.common.distributed import cleanup, init_distributed
    from twotower.retrieval.training.train_dual import DualTrainConfig, train_dual

    info = init_distributed(args.device)  # joins torchrun's group when WORLD_SIZE > 1 (gloo for --device cpu)
    cfg = DualTrainConfig(
        model=args.model, data=args.data, shared=not args.separate_towers, pooling=args.pooling,
        normalize=args.normalize, query_prefix=args.query_prefix, document_prefix=args.document_prefix,
        query_max_length=args.query_max_length, doc_max_length=args.doc_max_length,
        train_doc_max_length=args.train_doc_max_length, batch_size=args.batch_size,
        hard_negatives=args.hard_negatives, chunk_size=args.grad_cache_chunk, temperature=args.temperature,
        learn_temperature=args.learn_temperature, symmetric=args.symmetric,
        lr=DUAL_DEFAULTS[0] if args.lr is None else args.lr,  # --lr 0 is kept, not replaced by the default
        dev_pool=args.dev_pool, **_settings(args, default_ranks=DUAL_DEFAULTS[1]),
    )
    args.model = encoder_directory("--model", args.model, dual=True)  # after the flags: their errors come first
    cfg = dataclasses.replace(cfg, model=args.model)
    for flag, value in (("--query-max-length", args.query_max_length), ("--doc-max-length", args.doc_max_length),
                        ("--train-doc-max-length", args.train_doc_max_length)):
        max_length_fits(flag, value, args.model)
    _inputs(args)
    res = _trained(args, lambda: train_dual(cfg))
    cleanup(info)  # success path only: a barrier after one rank failed would just hang
    if not info.is_main:  # the result is rank 0's: the other ranks neither evaluate nor save
        return 0
    print(json.dumps({"best": res.best_dir, "best_step": res.best_step, "best_dev_ndcg@10": round(res.best_score, 4),
                      "initial_dev_ndcg@10": res.initial_score, "steps": res.steps, "skipped": res.skipped}))
    return 0


def _teacher(flag: str | None, args) -> str | None:
    """--teacher: a directory, or 'default' / 'embedded' (the installed all-MiniLM-L6-v2, as `--model default`
    elsewhere); dense mining and a dense dev first stage rank with it."""
    flag = "embedded" if flag == "default" else flag
    dense = [f for f, v in (("--mine dense", args.mine), ("--first-stage dense", args.first_stage)) if v == "dense"]
    if dense and flag is None:
        raise ValueError(f"{' and '.join(dense)} rank with the teacher: add --teacher DIR (or --teacher default)")
    from twotower.retrieval.training.train_reranker import teacher_dir

    if flag not in (None, "embedded") and not os.path.isdir(flag):
        raise ValueError(f"--teacher {flag}: not a directory (give a dual-encoder directory or 'default')")
    if flag not in (None, "embedded") and not os.path.isfile(os.path.join(flag, "manifest.json")):  # not an index
        model_directory("--teacher", flag, dual=True)
    return teacher_dir(flag)


def _teacher_bm25(args) -> float:
    if args.teacher_bm25 < 0:
        raise ValueError(f"--teacher-bm25 {args.teacher_bm25:g}: give 0 or more")
    if args.teacher_bm25 > 0 and args.teacher is None:
        raise ValueError("--teacher-bm25 adds BM25 to the teacher's scores: add --teacher DIR (or --teacher embedded)")
    return args.teacher_bm25


def _titles(args) -> int | None:
    if args.titles is None:
        return None
    if args.claims.lower() != "none":
        raise ValueError("--titles sets how many title/text pairs --claims none makes; add --claims none")
    if args.titles < 1:
        raise ValueError(f"--titles {args.titles}: give 1 or more")
    return args.titles


def _residual(args) -> bool:
    if args.residual and args.teacher is None:
        raise ValueError("--residual trains a correction to the teacher's scores: add --teacher DIR (or --teacher "
                         "embedded)")
    if args.residual and getattr(args, "loss", "listwise") != "listwise":
        raise ValueError("--residual corrects the teacher's listwise scores: use --loss listwise")
    return args.residual


def _windows(args) -> tuple[int | None, int | None, int | None]:
    """--passage-window / --passage-stride / --max-windows (0: None, every window), checked before any data is
    read."""
    window, stride = args.passage_window, args.passage_stride
    if args.max_windows is not None and window is None:  # it was ignored
        raise ValueError("--max-windows sets how many windows of a document are scored: add --passage-window N")
    max_windows = 3 if args.max_windows is None else args.max_windows
    if max_windows < 0:
        raise ValueError(f"--max-windows {max_windows}: give 0 (every window) or more")
    if stride is not None and window is None:
        raise ValueError("--passage-stride sets the step between windows: add --passage-window N")
    if args.window_choice != "model" and window is None:
        raise ValueError(f"--window-choice {args.window_choice} picks a window of each document: add "
                         "--passage-window N")
    if window is not None and window < 1:
        raise ValueError(f"--passage-window {window}: give a positive number of tokens")
    if stride is not None and not 1 <= stride <= window:
        raise ValueError(f"--passage-stride {stride}: give 1 to --passage-window ({window})")
    return window, stride, max_windows or None


def _distill_weight(args) -> float:
    """--distill-weight, which only a run with a teacher uses (default 1)."""
    if args.distill_weight is None:
        return 1.0
    if args.teacher is None:  # it was ignored
        raise ValueError("--distill-weight weighs the distillation from the teacher: add --teacher DIR (or --teacher "
                         "embedded)")
    if getattr(args, "residual", False):  # so was this
        raise ValueError("--distill-weight weighs the distillation term, which --residual training does not have "
                         "(its label loss reads teacher + reranker): give one of them")
    return args.distill_weight


def run_reranker(args) -> int:
    _check_run_out(args)
    from twotower.common.distributed import cleanup, init_distributed
    from twotower.retrieval.rerank import DEFAULT_RERANK_K
    from twotower.retrieval.training.train_reranker import RerankerTrainConfig, train_reranker

    window, stride, keep = _windows(args)
    cfg = RerankerTrainConfig(
        model=args.model, pairs=args.pairs, first_stage=args.first_stage, loss=args.loss,
        group_size=args.group_size, batch_size=args.batch_size,
        max_length=RerankerTrainConfig.max_length if args.max_length is None else args.max_length,
        lr=RERANKER_DEFAULTS[0] if args.lr is None else args.lr,
        dev_rerank_k=DEFAULT_RERANK_K if args.dev_rerank_k is None else args.dev_rerank_k,
        collapse_std=args.collapse_std, head_pooling=args.head_pooling,
        trainable_layers=args.trainable_layers, teacher=_teacher(args.teacher, args),
        distill_weight=_distill_weight(args),
        teacher_bm25=_teacher_bm25(args), residual=_residual(args), passage_window=window,
        passage_stride=stride, max_windows=keep, window_choice=args.window_choice,
        **_settings(args, default_ranks=RERANKER_DEFAULTS[1]),
    )
    reranker_directory("--model", args.model, head=False)  # an encoder gets a fresh head
    max_length_fits("--max-length", args.max_length, _base_dir(args.model))
    _inputs(args)
    info = init_distributed(args.device)  # joins torchrun's group when WORLD_SIZE > 1 (gloo for --device cpu)
    res = _trained(args, lambda: train_reranker(cfg))
    cleanup(info)  # success path only: a barrier after one rank failed would just hang
    if not info.is_main:  # the result is rank 0's: the other ranks neither evaluate nor save
        return 0
    print(json.dumps({"best": res.best_dir, "best_step": res.best_step, "best_dev_ndcg@10": round(res.best_score, 4),
                      "first_stage": cfg.first_stage, "first_stage_dev_ndcg@10": round(res.first_stage_score, 4),
                      "steps": res.steps, "stopped_by": res.stopped_by, "skipped": res.skipped}))
    return 0 if not res.stopped_by.startswith("collapse") else 1


def run_mine(args) -> int:
    from dataclasses import asdict

    from twotower.retrieval.training.mining import (
        DenseRetriever,
        MiningConfig,
        bm25_retriever,
        mine_hard_negatives,
        write_mined,
    )
    from twotower.retrieval.training.training_data import read_training

    start, end = parse_ranks("--ranks", args.ranks)
    for flag, value in (("--num-negatives", args.num_negatives), ("--random", args.random)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if args.max_ratio is not None and not 0 < args.max_ratio < math.inf:
        raise ValueError(f"--max-ratio must be a number > 0, got {args.max_ratio:g}")
    if args.margin is not None and not math.isfinite(args.margin):
        raise ValueError(f"--margin must be a number, got {args.margin:g}")
    output_file("--out", args.out, "negatives.jsonl", inputs=(("--data", args.data), ("--corpus", args.corpus)))
    if args.num_negatives == 0 and args.random == 0:  # wrote every query with no negative at all
        raise ValueError("--num-negatives 0 and --random 0 leave nothing to mine: give either 1 or more")
    if args.retriever == "dense":
        if not args.model:
            raise ValueError("--retriever dense needs --model DIR (a dual encoder, or default: all-MiniLM-L6-v2)")
        args.model = encoder_directory("--model", args.model, dual=True)
    elif args.model:  # BM25 mined, and the model was named in the output's settings as if it had
        raise ValueError("--model is the dense retriever's: add --retriever dense, or leave --model out")
    cfg = MiningConfig(rank_start=start, rank_end=end, num_negatives=args.num_negatives, margin=args.margin,
                       max_ratio=args.max_ratio, num_random=args.random, seed=args.seed)
    _inputs(args)
    args.split = _split(args.split, "--data", args.data)
    data = read_training(args.data, split=args.split, corpus_path=args.corpus)
    score_docs = None
    if args.retriever == "dense":
        from twotower.retrieval.dual_encoder import DualEncoder

        dense = DenseRetriever(DualEncoder.from_pretrained(args.model), data.corpus, progress=not args.no_progress)
        retrieve, score_docs = dense, dense.score_docs
    else:
        retrieve = bm25_retriever(data.corpus)
    mined, stats = mine_hard_negatives(data.examples, retrieve, list(data.corpus), cfg, score_docs=score_docs,
                                       progress=not args.no_progress)
    write_mined(args.out, mined, {"data": args.data, "split": args.split, "retriever": args.retriever,
                                  "model": args.model, **asdict(cfg), "stats": stats.as_dict(),
                                  "skipped": data.skipped.as_dict()})
    print(json.dumps({"out": args.out, **stats.as_dict(), "skipped": data.skipped.as_dict()}))
    return 0


def run_pairs(args) -> int:
    from twotower.retrieval.training.self_supervised import (
        independent_crops,
        inverse_cloze,
        max_crops,
        write_pairs_jsonl,
    )
    from twotower.retrieval.training.training_data import read_corpus

    positive("--pairs-per-document", args.pairs_per_document)
    output_file("--out", args.out, "pairs.jsonl", inputs=(("--corpus", args.corpus),))
    if args.method == "ict" and args.pairs_per_document != 1:
        raise ValueError("--pairs-per-document applies to --method crop; ict makes one pair per document")
    input_file("--corpus", args.corpus, inside="corpus.jsonl")  # a directory was "corpus file not found"
    corpus = read_corpus(args.corpus)
    most, words = max_crops(corpus)
    if args.method == "crop" and most and args.pairs_per_document > most:  # 1e11 ran without end
        raise ValueError(f"--pairs-per-document {args.pairs_per_document}: the longest document of --corpus "
                         f"{args.corpus} ({words} words) can be cropped {most} distinct ways, and more pairs a "
                         f"document would only repeat queries; give at most {most}")
    if args.method == "crop":
        data = independent_crops(corpus, pairs_per_document=args.pairs_per_document, seed=args.seed)
    else:
        data = inverse_cloze(corpus, seed=args.seed)
    n = write_pairs_jsonl(args.out, data)
    print(json.dumps({"out": args.out, "pairs": n, "skipped": data.skipped.as_dict()}))
    return 0


def run_soup(args) -> int:
    _check_out(args.out)
    from twotower.retrieval.training.soup import soup_rerankers

    res = soup_rerankers(args.runs, args.out, progress=not args.no_progress, overwrite=args.overwrite)
    print(json.dumps({"reranker": res.directory, "dev_ndcg@10": round(res.dev_ndcg10, 4),
                      "interpolated_dev_ndcg@10": round(res.interpolated_ndcg10, 4), "alpha": res.alpha,
                      "alphas_by_first_stage": res.alphas_by_first_stage,
                      "first_stage_dev_ndcg@10": round(res.first_stage_ndcg10, 4),
                      "ingredients": [{k: i[k] for k in ("checkpoint", "seed", "step", "dev_ndcg@10",
                                                         "interpolated_dev_ndcg@10")} for i in res.ingredients]}))
    return 0


def _base_dir(model: str | None) -> str:
    """The directory whose config.json holds the model's positions: `model`, or the embedded all-MiniLM-L6-v2
    (the default model, and the base of the shipped reranker)."""
    from twotower.retrieval import default_reranker

    return default_reranker.base_model_dir() if model in (None, default_reranker.NAME) else model


def run_demo(args) -> int:
    _check_out(args.out)
    max_length_fits("--max-length", args.max_length, _base_dir(args.model))

    window, stride, keep = _windows(args)
    kw = {k: v for k, v in (("steps", args.steps), ("layers", args.layers), ("lr", args.lr),
                            ("trainable_layers", args.trainable_layers), ("max_length", args.max_length),
                            ("head_pooling", args.head_pooling), ("teacher", _teacher(args.teacher, args)),
                            ("evals", args.evals), ("teacher_bm25", _teacher_bm25(args) or None),
                            ("residual", _residual(args) or None), ("titles", _titles(args)),
                            ("dev_by", None if args.dev_by == "query" else args.dev_by),
                            ("dev_seed", args.dev_seed),
                            ("passage_window", window), ("passage_stride", stride))
          if v is not None}
    if args.passage_window is not None:
        kw.update(max_windows=keep, window_choice=args.window_choice)  # max_windows None: every window
    if args.teacher is not None or args.mine != "bm25" or args.first_stage is not None:
        kw.update(distill_weight=_distill_weight(args), mine=args.mine, first_stage=args.first_stage)
    elif args.distill_weight is not None:
        _distill_weight(args)  # refused without a teacher
    claims = None if args.claims.lower() == "none" else args.claims
    from twotower.retrieval.training.demo_reranker import NoCheckpointError

    try:
        path = _demo_reranker(args.out, model=args.model, corpus=args.corpus, claims=claims, seed=args.seed,
                                   progress=not args.no_progress, **kw)
    except NoCheckpointError as e:  # as `train reranker` ends a collapsed run: status 1, no traceback
        print(f"twotower train demo-reranker: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"reranker": path}))
    return 0
