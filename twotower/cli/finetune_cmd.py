"""`twotower finetune classify|tag|qa` and `twotower predict classify|tag|qa`.

finetune: train a task head on any BERT-family model directory, keep the best
dev checkpoint in --out (several --seeds report mean ± std); prints dev (and
--test) scores.  predict: run a fine-tuned directory over a file, write one
JSON line per input; when the input carries gold labels, scores go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from twotower.cli.checks import (
    BATCH_HELP,
    encoder_directory,
    input_file,
    model_directory,
    output_file,
    positive,
)
from twotower.cli.help_format import DefaultsHelpFormatter

TASKS = ("classify", "tag", "qa")
TASK_HELP = "classify: a label per text or text pair; tag: BIO entity tags per word; qa: answer spans in a context"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "finetune", help="fine-tune a classification, tagging or QA head",
        description="Fine-tune a task head on a BERT-family model; the best dev checkpoint goes to --out.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("task", choices=TASKS, help=TASK_HELP)
    p.add_argument("--model", required=True, metavar="DIR|default",
                   help="BERT-family model directory (HF layout), or 'default' for the embedded all-MiniLM-L6-v2")
    p.add_argument("--train", required=True, help="training file (.tsv/.jsonl, CoNLL, SQuAD .json; any of them .gz)")
    dev = p.add_mutually_exclusive_group(required=True)
    dev.add_argument("--dev", help="dev file: picks the best epoch (and the QA no-answer threshold)")
    dev.add_argument("--dev-fraction", type=float,
                     help="carve dev from train instead (seeded; classify: per label, keeping at least one example "
                          "of each label in train; QA: by context)")
    p.add_argument("--labels", metavar="FILE|A,B,C",
                   help="classify and tag: the label set, in id order: a file with one label a line, or "
                        "comma-separated labels (default: the labels of --train and --dev, integers by value, "
                        "others sorted; tagging: O first)")
    p.add_argument("--test", help="optional test file, scored with every seed's best checkpoint")
    p.add_argument("--out", required=True,
                   help="output directory for the best checkpoint and report: new, empty, or an earlier run "
                        "with --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the earlier run --out holds, once the new run is complete (without it, such an "
                        "--out is refused)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out (or the run replacing it, in OUT.unfinished) exactly from its "
                        "last saved state (saved after each dev evaluation and every --save-every steps), with "
                        "the run's own settings and files")
    p.add_argument("--save-every", type=int, metavar="N",
                   help="also save the run's state every N steps of a seed, for --resume (default: at each "
                        "evaluation)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training set (per seed)")
    p.add_argument("--batch-size", type=int, default=32, help="training examples per step")
    p.add_argument("--lr", type=float, help="default 5e-5, or 1e-3 with --freeze-encoder")
    p.add_argument("--warmup", type=float, default=0.1, help="warmup fraction of all steps (then linear decay)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--max-length", type=int,
                   help="tokens per input (QA and tag: per window; longer inputs are read in overlapping windows); "
                        "default 128 (QA: 384), or the model's maximum if less")
    p.add_argument("--freeze-encoder", action="store_true", help="train only the head on cached encoder features")
    p.add_argument("--pooling", choices=("cls", "mean"),
                   help="classify: [CLS] pooler (default) or the mean of token states (no pooler; such a model "
                        "predicts correctly only in twotower: transformers reads [CLS] through a random pooler)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1,2")
    p.add_argument("--evals-per-epoch", type=int, default=1,
                   help="dev evaluations per epoch (each may keep the best checkpoint)")
    p.add_argument("--max-train", type=int, help="subsample the training set to this many examples")
    p.add_argument("--max-steps", type=int, help="stop each seed after this many steps (dry run)")
    p.add_argument("--doc-stride", type=int,
                   help="QA and tag: token overlap between the windows a long context or sentence is read in "
                        "(default: half the text a window holds, at most 128)")
    p.add_argument("--max-query-length", type=int,
                   help="QA: question tokens kept (default: a quarter of --max-length, at most 64)")
    p.add_argument("--max-answer-length", type=int, help="QA: longest answer span in tokens (default 30)")
    _common(p, "cuda if available")
    p.set_defaults(func=run_finetune)

    q = subparsers.add_parser(
        "predict", help="predict with a fine-tuned classification, tagging or QA model",
        description="Predict with a fine-tuned model: one JSON line per input; gold labels, if every input has "
                    "one, are scored.", formatter_class=DefaultsHelpFormatter)
    q.add_argument("task", choices=TASKS, help=TASK_HELP)
    q.add_argument("--model", required=True, help="directory written by `twotower finetune`")
    q.add_argument("--input", required=True,
                   help="file to predict on (gold labels are scored when every input has one; inputs without "
                        "one are predicted all the same)")
    q.add_argument("--out", help="write JSON lines here instead of stdout")
    q.add_argument("--batch-size", type=int, default=None, help=BATCH_HELP)
    _common(q, "cpu")
    q.set_defaults(func=run_predict)


def _common(p: argparse.ArgumentParser, device: str) -> None:
    p.add_argument("--text-column", help="TSV/JSONL text column (default: text/sentence/sentence1/question)")
    p.add_argument("--label-column",
                   help="TSV/JSONL label column (default: 'label', else the only column whose name starts with "
                        "'label'; a file with several, such as TREC's label_coarse and label_fine, needs this flag)")
    p.add_argument("--pair-column", help="TSV/JSONL second-text column for pair tasks")
    p.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                   help="bfloat16 autocast; auto: where the device supports it")
    p.add_argument("--device", help=f"cpu, cuda, cuda:1 ... (default: {device})")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


# Flags that only some tasks read (dest, flag, tasks): given for another task they were ignored.
_TASK_FLAGS = (("pooling", "--pooling", ("classify",)), ("labels", "--labels", ("classify", "tag")),
               ("text_column", "--text-column", ("classify",)),
               ("label_column", "--label-column", ("classify",)), ("pair_column", "--pair-column", ("classify",)),
               ("doc_stride", "--doc-stride", ("qa", "tag")), ("max_query_length", "--max-query-length", ("qa",)),
               ("max_answer_length", "--max-answer-length", ("qa",)))


def _refuse_other_tasks_flags(args: argparse.Namespace) -> None:
    """A flag of another task is an error: `finetune tag --text-column words` read the CoNLL file
    as usual and said nothing (tagging and QA files have fixed layouts)."""
    from twotower.cli import CLIError

    given = [(flag, tasks) for dest, flag, tasks in _TASK_FLAGS
             if args.task not in tasks and getattr(args, dest, None) is not None]
    if not given:
        return
    groups: dict[tuple[str, ...], list[str]] = {}
    for flag, tasks in given:
        groups.setdefault(tasks, []).append(flag)
    parts = [f"{', '.join(flags)} {'' if k else ('applies ' if len(flags) == 1 else 'apply ')}to "
             f"{' and '.join(sorted(tasks))} only" for k, (tasks, flags) in enumerate(groups.items())]
    raise CLIError(f"{', '.join(parts)}, not {args.task}: leave {'it' if len(given) == 1 else 'them'} out")


def _read(task: str, path: str, args: argparse.Namespace, need_labels: bool) -> list:
    from twotower.eval.tasks import read_qa_examples, read_tag_examples, read_text_examples

    if task == "classify":
        return read_text_examples(path, args.text_column, args.label_column, args.pair_column, need_labels)
    if task == "tag":
        return read_tag_examples(path, need_labels)
    return read_qa_examples(path)


def _read_split(flag: str, path: str, args: argparse.Namespace, need_labels: bool) -> list:
    """The examples of the file a flag names; none at all is refused naming the flag and the file.

    Why: a dev file holding only a header stopped the run with "fine-tuning needs training and dev examples
    (got 300 and 0)", naming neither.
    """
    from twotower.cli import CLIError

    examples = _read(args.task, path, args, need_labels)
    if not examples:
        raise CLIError(f"{flag} {path}: no examples in it (a header alone, blank lines, or an empty list)")
    return examples


def _labels(value: str | None) -> list[str] | None:
    """--labels: a file with one label a line, or comma-separated labels (each once: `finetune` checks)."""
    from twotower.cli import CLIError

    if value is None:
        return None
    if os.path.isfile(value):
        from twotower.common.lines import numbered_lines

        labels = [line.strip() for _, line in numbered_lines(value) if line.strip()]
    elif "," not in value and (os.sep in value or value.endswith((".txt", ".tsv", ".csv", ".json", ".jsonl"))):
        # a mistyped file name became the one label 'labels.txt', and the first train line was blamed
        raise CLIError(f"--labels {value}: no such file (give a file of labels, one a line, or A,B,C)")
    else:
        labels = [label.strip() for label in value.split(",") if label.strip()]
    if not labels:
        raise CLIError(f"--labels {value}: no labels")
    return labels


def _bf16(value: str):
    return {"auto": "auto", "on": True, "off": False}[value]




def _check_out(args: argparse.Namespace, model_dir: str) -> None:
    """--out before anything loads: a new or empty directory, or an earlier run with --overwrite.

    Why: a run replaced whatever --out was: a directory of the user's files (deleted), a file (left as
    FILE.old-PID), the --model directory itself, an earlier run at its first evaluation.
    """
    from twotower.cli import CLIError
    from twotower.common.atomic import staging_dir
    from twotower.common.paths import (
        beside_earlier_refusal,
        foreign_entries,
        not_ours_refusal,
        working_directory_refusal,
    )
    from twotower.encoder.finetuning.finetune import (
        REPORT_NAME,
        RUN_NAMES,
        STATE_DIR,
        out_dir_state,
        run_finished,
    )
    from twotower.encoder.training.same_run import locate_state

    out = args.out
    # a run swaps its directory in whole (--overwrite, or resuming a run built in OUT.unfinished); resumed in
    # its own directory it replaces nothing
    swaps = not args.resume or os.path.isdir(os.path.join(staging_dir(out), STATE_DIR))
    if swaps and (problem := working_directory_refusal(out, f"--out {out}", "a run", "--out model",
                                                        overwrite=True)):
        raise CLIError(problem)
    if args.resume:  # the run's own directory: there must be a state to continue from (what else: in its words)
        from twotower.encoder.finetuning.finetune import find_state

        find_state(out)
        return
    state = out_dir_state(out, model_dir)
    if state == "file":
        raise CLIError(f"--out {out}: a file; give a directory (a new one, or an empty one)")
    if state == "model":
        raise CLIError(f"--out {out}: the --model directory itself; give another directory for the fine-tuned "
                       "model")
    if state == "other":
        raise CLIError(not_ours_refusal(f"--out {out}", sorted(os.listdir(out)), "a fine-tuning run"))
    if state == "mixed":  # --overwrite would delete them with the earlier run
        raise CLIError(beside_earlier_refusal(f"--out {out}", "an earlier fine-tuning run",
                                              foreign_entries(out, RUN_NAMES)))
    if state == "run" and not args.overwrite:
        what = "an unfinished fine-tuning run" if run_finished(out) is False else "an earlier fine-tuning run"
        stopped = locate_state(out, STATE_DIR)
        resume = f" (or --resume to continue the run stopped in {os.path.dirname(stopped)})" if stopped else ""
        raise CLIError(f"--out {out}: holds {what} ({REPORT_NAME}); pass --overwrite to replace it once the new "
                       f"run is complete{resume}, or give another --out")
    if state == "run" and out_dir_state(staging_dir(out)) not in ("free", "run"):
        raise CLIError(f"--out {out}: the new run is built in {staging_dir(out)} until it is complete, and "
                       "something else is there; move it away")


def _seeds(text: str) -> tuple[int, ...]:
    """--seeds: comma-separated integers, each once, each from 0 to MAX_SEED (checked before any model loads)."""
    from twotower.cli import CLIError
    from twotower.encoder.finetuning.finetune import MAX_SEED

    try:
        seeds = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise CLIError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise CLIError("--seeds is empty")
    if len(set(seeds)) < len(seeds):  # a repeated seed trains the same run again and counts it twice in the mean
        raise CLIError(f"--seeds {text}: each seed at most once")
    bad = next((s for s in seeds if not 0 <= s <= MAX_SEED), None)
    if bad is not None:  # -1 failed in numpy after the model had loaded
        raise CLIError(f"--seeds {text}: seed {bad} is out of range; give seeds from 0 to {MAX_SEED}")
    return seeds


def _check_windows(args: argparse.Namespace, model_dir: str) -> None:
    """QA and tagging windows before anything loads: the overlap must be smaller than the text a window holds.
    It failed after loading, in Python names ("max_length=128 leaves 116 context tokens ... doc_stride=128")."""
    from twotower.cli import CLIError
    from twotower.encoder.finetuning.finetune import qa_window, resolved_max_length, tag_window

    if args.task == "tag":
        max_length = resolved_max_length(args.max_length, model_dir, "tag")
        stride, room = tag_window(max_length, args.doc_stride)
        if room > stride:
            return
        given = "" if args.max_length is not None else " (the default for this model)"
        raise CLIError(f"--doc-stride {stride}: a window of --max-length {max_length}{given} holds {room} tokens "
                       f"of a sentence besides [CLS] and [SEP]; the overlap must be smaller: give --doc-stride "
                       f"{room // 2}, or a larger --max-length")
    if args.task != "qa":
        return
    max_length = resolved_max_length(args.max_length, model_dir, "qa")
    stride, query, room = qa_window(max_length, args.doc_stride, args.max_query_length)
    if room > stride:
        return
    given = "" if args.max_length is not None else " (the default for this model)"
    if room < 2:
        raise CLIError(f"--max-length {max_length}{given} leaves {max(room, 0)} context tokens after a question of "
                       f"up to --max-query-length {query} tokens and 3 special tokens; give a larger --max-length "
                       "or a smaller --max-query-length")
    raise CLIError(f"--doc-stride {stride}: a window of --max-length {max_length}{given} holds {room} context tokens "
                   f"after a question of up to --max-query-length {query} tokens and 3 special tokens; the overlap "
                   f"must be smaller: give --doc-stride {room // 2}, or a larger --max-length")


def _trained(args: argparse.Namespace, train):
    """`train()`, and on Ctrl-C the line the command prints says what ``--resume`` would continue from."""
    from twotower.cli import resumable
    from twotower.encoder.finetuning.finetune import out_dir_state, saved_position

    return resumable(args, train, lambda: saved_position(args.out),
                     lambda: out_dir_state(args.out) == "run" and not args.resume)


def run_finetune(args: argparse.Namespace) -> int:
    from twotower.cli import CLIError
    from twotower.cli.checks import max_length_fits

    positive("--threads", args.threads)
    positive("--save-every", args.save_every)
    _refuse_other_tasks_flags(args)
    seeds = _seeds(args.seeds)
    model_dir = encoder_directory("--model", args.model)
    _check_out(args, model_dir)
    for flag in ("--train", "--dev", "--test"):
        path = getattr(args, flag[2:])
        if path is not None:
            input_file(flag, path)
    max_length_fits("--max-length", args.max_length, model_dir)
    _check_windows(args, model_dir)
    labels = _labels(args.labels)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from twotower.encoder.finetuning.finetune import FinetuneConfig, finetune
    from twotower.eval.tasks import METRICS

    metric_fn, metric = METRICS[args.task]
    qa = {name: getattr(args, name) for name in ("doc_stride", "max_query_length", "max_answer_length")
          if getattr(args, name) is not None}  # the config's defaults otherwise
    cfg = FinetuneConfig(  # its own checks (--epochs 0 ...) before any file is read
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
        warmup=args.warmup, freeze_encoder=args.freeze_encoder, max_length=args.max_length, **qa,
        seeds=seeds, evals_per_epoch=args.evals_per_epoch, max_train_examples=args.max_train,
        max_steps=args.max_steps, metric=metric, bf16=_bf16(args.bf16), device=args.device,
        progress=not args.no_progress, pooling=args.pooling, save_every=args.save_every,
    )
    train = _read_split("--train", args.train, args, True)
    if args.dev:
        dev = _read_split("--dev", args.dev, args, True)
    else:
        from dataclasses import replace

        from twotower.encoder.finetuning.task_examples import carve_dev

        try:
            train, dev = carve_dev(args.task, train, args.dev_fraction)
        except ValueError as exc:
            raise CLIError(f"--dev-fraction {args.dev_fraction}: {exc}") from None
        # a problem found in a dev example names its --train line and where the example went
        dev = [replace(ex, source=f"{ex.source} (dev split of --dev-fraction)") for ex in dev]
    test = _read_split("--test", args.test, args, True) if args.test else None
    report = _trained(args, lambda: finetune(args.task, model_dir, train, dev, args.out, cfg, test=test,
                                             labels=labels, metric_fn=metric_fn, overwrite=args.overwrite,
                                             resume=args.resume))
    n = len(report.seeds)
    for split in ("dev", "test"):
        for name, (mean, std) in report.summary(split).items():
            print(f"{split} {name}: {mean:.4f} ± {std:.4f} ({n} seed{'s' if n > 1 else ''})")
    best = next(s for s in report.seeds if s.seed == report.best_seed)
    print(f"checkpoint: {args.out} (seed {best.seed}, epoch {best.best_epoch:g}; report in finetune_report.json)")
    for note in report.notes:  # also in the report's "notes"
        print(f"note: {note}", file=sys.stderr)
    return 0


def _as_json(task: str, ex, pred) -> dict:
    if task == "classify":
        return {"text": ex.text, **({"pair": ex.pair} if ex.pair is not None else {}), "label": pred.label,
                "score": round(pred.score, 6), "probs": {k: round(v, 6) for k, v in pred.probs.items()}}
    if task == "tag":
        return {"tokens": ex.words, "tags": pred.tags,
                "entities": [{"type": t, "start": s, "end": e, "text": x} for t, s, e, x in pred.entities]}
    return {"id": pred.id, "answer": pred.answer, "start": pred.start if not pred.no_answer else None,
            "end": pred.end if not pred.no_answer else None, "no_answer": pred.no_answer,
            "score": round(pred.score, 6), "null_score": round(pred.null_score, 6)}


def _gold(task: str, examples: list) -> tuple[bool, str | None]:
    """(score the predictions?, the note when they are not scored although some inputs carry gold).

    One rule for every format: an input without a label (a JSONL record without one, a blank TSV cell) is
    predicted all the same; the file is scored only when every input has one. A TSV with one blank cell was
    refused while a JSONL with one missing label skipped scoring without a word.
    """
    if task == "qa":  # a question without answers is gold too: unanswerable (SQuAD v2)
        return any(ex.answers for ex in examples), None
    missing = [ex for ex in examples if (ex.label if task == "classify" else ex.tags) is None]
    if not missing:
        return True, None
    if len(missing) == len(examples):
        return False, None
    what = "label" if task == "classify" else "tags"
    return False, (f"not scored: {len(missing)} of {len(examples)} inputs have no {what} (first: "
                   f"{missing[0].source}); every input needs one to be scored")


def run_predict(args: argparse.Namespace) -> int:
    from twotower.cli import CLIError

    positive("--batch-size", args.batch_size)
    positive("--threads", args.threads)
    input_file("--input", args.input)
    output_file("--out", args.out, "predictions.jsonl")
    model_directory("--model", args.model)  # it said "model directory not found: X", naming no flag
    _refuse_other_tasks_flags(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from twotower.encoder.finetuning.finetune import REPORT_NAME, run_finished
    from twotower.encoder.finetuning.task_model import TaskModel
    from twotower.eval.tasks import METRICS

    if run_finished(args.model) is False:
        print(f"note: --model {args.model} is the best checkpoint of a fine-tuning run that did not finish "
              f"(its {REPORT_NAME} says so)", file=sys.stderr)

    model = TaskModel.from_pretrained(args.model, device=args.device or "cpu")
    if model.info.head != args.task:
        raise CLIError(f"{args.model} holds a {model.info.head!r} head, not {args.task!r}")
    examples = _read_split("--input", args.input, args, need_labels=False)
    if args.task == "classify":
        unknown = sorted({ex.label for ex in examples if ex.label is not None} - set(model.info.labels))
        if unknown:
            bad = next(ex for ex in examples if ex.label in unknown)
            raise CLIError(f"{bad.source}: label {bad.label!r} is not in the model's label map {model.info.labels}")
    if args.task == "classify" and model.info.pairs:
        lone = sum(ex.pair is None for ex in examples)
        if lone:  # it predicted silently, on inputs unlike any it was trained on
            print(f"warning: --model {args.model} was trained on text pairs, but {lone} of the {len(examples)} "
                  "inputs have no second text (--pair-column); their predictions are unreliable", file=sys.stderr)
    notes: list[str] = []
    preds = model.predict(examples, batch_size=args.batch_size, bf16=_bf16(args.bf16),
                          progress=not args.no_progress, notes=notes)
    scored, unscored = _gold(args.task, examples)
    for note in [*notes, *([unscored] if unscored else [])]:
        print(f"note: {note}", file=sys.stderr)
    lines = "".join(json.dumps(_as_json(args.task, ex, p), ensure_ascii=False) + "\n" for ex, p in zip(examples, preds))
    if args.out:
        from twotower.common.atomic import atomic_write_text

        atomic_write_text(args.out, lines)
    else:
        sys.stdout.write(lines)
    if scored:
        metric_fn, _ = METRICS[args.task]
        scores = metric_fn(preds, examples)
        print(" ".join(f"{k}={v:.4f}" for k, v in scores.items()), file=sys.stderr)
        if args.task == "classify":
            from twotower.eval.metrics import classification_report

            print(classification_report([ex.label for ex in examples], [p.label for p in preds],
                                        labels=model.info.labels).format(), file=sys.stderr)
    return 0
