"""One fine-tuning loop for classification, tagging and QA; full fine-tuning or a frozen encoder.

The story of a run: featurize train / dev (/ test) once; with a frozen
encoder, also run the encoder once over every row and cache its outputs,
because the encoder never changes and each epoch then costs only the head
(that cache is what makes frozen runs cheap, and it is shared by all seeds).
Then for each seed: start from the same encoder weights and a freshly drawn
head, train with AdamW, warmup then linear decay over the whole run, bf16
autocast where supported; evaluate on dev after every epoch (or more often)
and keep the best state.  The best checkpoint over all seeds and epochs is
written to ``out_dir`` as soon as it appears, with ``finetune_report.json``
beside it: per-seed dev (and test) scores and their mean and standard
deviation, since one seed's number says little about a method.  The report's
``finished`` is false until every seed is done, so a killed run does not look
complete.  ``out_dir`` must be new, empty, or (with ``overwrite``) an earlier
run; an earlier run is replaced only once the new one is complete (the new one
is built in ``<out_dir>.unfinished`` meanwhile), so a mistyped ``out_dir`` or a
Ctrl-C never costs the checkpoint that was there.

For QA the "no answer" threshold is re-chosen on dev at every evaluation and
saved with the checkpoint.

Stopping and resuming: the run saves its state in ``<work>/trainer_state/``
(`twotower.encoder.training.train_state`: tensors in safetensors, the rest in
JSON, swapped in whole) after each dev evaluation and every ``save_every``
steps, and removes it when it finishes; ``resume=True`` continues from it
exactly, bit for bit on a CPU (tests/encoder/finetuning/test_resume.py),
because it restores:

* which seed, and its step, epoch and batch within the epoch;
* the weights trained (the whole model, or with a frozen encoder only the head)
  and AdamW's moments, and the torch generators that draw dropout;
* the batches: each seed's numpy generator is seeded the same way at every
  start, so the resumed run draws again the batch orders of the epochs done and
  of the current one, and skips the batches trained before the save;
* the training losses since the last evaluation, the seed's best weights (kept
  in memory for its ``test`` scores: ``best.safetensors`` in the state), its
  best dev score and the run's, and the report so far.

A state saved at an evaluation that found the run's best checkpoint goes into
the directory with that checkpoint (`TaskModel.save`'s ``also``), so the two
always belong to the same moment.  A resume is checked before any model or
data work (`twotower.encoder.training.same_run`): the same settings, task,
model directory and label map (each difference named by its flag, with the
run's value) and the same examples (the SHA-256 of each split as given, its
``source`` aside: an edited file, other columns or another ``--dev-fraction``
differ; a moved copy does not).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from twotower.common.atomic import (
    atomic_replace_dir,
    atomic_write_text,
    refuse_swap_over_theirs,
    staging_dir,
    sweep_temporaries,
)
from twotower.common.device import autocast, default_device, resolve_bf16
from twotower.common.errors import DataError, check_at_least, check_setting
from twotower.common.malloc import retain_freed_memory_for
from twotower.common.paths import beside_earlier_refusal, foreign_entries, not_ours_refusal, path_argument
from twotower.encoder.core.checkpoint import CONFIG_NAME, WEIGHTS_NAME
from twotower.encoder.core.tokenizer import TOKENIZER_FILES
from twotower.encoder.finetuning.qa_decode import choose_null_threshold
from twotower.encoder.finetuning.task_examples import build_label_map, check_bio_labels, where
from twotower.encoder.finetuning.task_model import TaskModel, batch_order, model_inputs, read_config, run_rows
from twotower.encoder.finetuning.tasks import Featurized, TaskInfo, get_task
from twotower.encoder.finetuning.windows import qa_window, tag_window
from twotower.encoder.training.optim import check_optimizer_settings, lr_factor, make_optimizer, set_lr
from twotower.encoder.training.same_run import (
    check_same_run,
    locate_state,
    plain,
    read_saved_identity,
    real_paths,
)
from twotower.encoder.training.train_state import (
    TrainState,
    load_train_state,
    read_train_user,
    restore_train_state,
    save_train_state,
)

logger = logging.getLogger(__name__)

REPORT_NAME = "finetune_report.json"
STATE_DIR = "trainer_state"  # a run under way's resumable state (see the module docstring)
BEST_NAME = "best"  # the state's best.safetensors: the current seed's best weights
# Every name a run writes into its directory (`TaskModel.save`: the model, its tokenizer, the report, the
# training state): --overwrite replaces a directory holding only these, never one holding a user's file.
RUN_NAMES = frozenset({REPORT_NAME, STATE_DIR, CONFIG_NAME, WEIGHTS_NAME, *TOKENIZER_FILES})
# Settings that change how a run is watched or where it computes, not what it computes: a resume may differ.
UNCHECKED = ("progress", "save_every", "device", "bf16")
# The flag of a setting whose name is not the flag's (`--` + the name with dashes otherwise).
FLAGS = {"max_train_examples": "--max-train", "head": "the task", "labels": "--labels (the label map)"}
# How examples become model rows and splits, saved with a run's identity. 2: a lone text is encoded apart from
# pairs, a tag word with no token is read as [UNK], --dev-fraction is stratified by label, integer labels are
# ordered by value. A run started under another reading would resume on other rows: refused, saying why.
READING = 2
SPLIT_FLAGS = {"train": "--train", "dev": "--dev", "test": "--test"}
MetricFn = Callable[[Sequence[Any], Sequence[Any]], dict[str, float]]


DEFAULT_MAX_LENGTH = 128  # tokens per input unless --max-length says otherwise
# QA: tokens per window, as HF's run_qa (max_seq_length 384, doc_stride 128, max_query_length 64). 128 left
# 128 - 64 - 3 = 61 context tokens, fewer than the old default overlap of 128: `finetune qa` never ran.
DEFAULT_QA_MAX_LENGTH = 384
MAX_SEED = 2**32 - 1  # numpy's and torch's seeds; a negative one failed after the model had loaded

@dataclass
class FinetuneConfig:
    """Hyper-parameters of a fine-tuning run. Defaults follow BERT's recipe (Devlin et al. 2019, A.3)."""

    epochs: int = 3
    batch_size: int = 32
    lr: float | None = None  # None: 5e-5 for full fine-tuning, 1e-3 for a frozen encoder (only a linear layer learns)
    weight_decay: float = 0.01
    warmup: float = 0.1  # fraction of all steps
    freeze_encoder: bool = False
    max_length: int | None = None  # None: DEFAULT_MAX_LENGTH, or the model's positions if fewer; a given value must fit
    doc_stride: int | None = None  # QA, tag: window overlap; None: half a window's context room, at most 128
    max_query_length: int | None = None  # QA: question tokens kept; None: a quarter of max_length, at most 64
    max_answer_length: int = 30  # QA
    dropout: float | None = None  # head dropout; None: the config's hidden dropout
    pooling: str | None = None  # classify: "cls" (pooler on [CLS], the default) or "mean" (encoder.heads)
    grad_clip: float = 1.0
    seeds: tuple[int, ...] = (0,)
    evals_per_epoch: int = 1
    max_train_examples: int | None = None  # subsample train (always the same subset: seed 0)
    max_steps: int | None = None  # stop after this many steps per seed (dry runs)
    metric: str | None = None  # dev metric selecting the best epoch; None: the task's main metric
    bf16: bool | str = "auto"
    device: str | None = None
    eval_batch_size: int = 128
    progress: bool = True
    save_every: int | None = None  # also save the run's state every this many steps of a seed (for resume)

    def __post_init__(self) -> None:
        """Refuse settings that crash late or train something else, naming the field and the flag
        (``epochs=0`` stopped in a StopIteration, ``batch_size=0`` divided by zero, ``max_train_examples=0``
        meant no cap, ``max_length=0`` trained on empty inputs)."""
        check_at_least(self, 1, {"epochs": "--epochs", "batch_size": "--batch-size", "eval_batch_size": None,
                                 "evals_per_epoch": "--evals-per-epoch", "doc_stride": "--doc-stride",
                                 "max_query_length": "--max-query-length", "max_answer_length": "--max-answer-length",
                                 "max_steps": "--max-steps", "max_train_examples": "--max-train",
                                 "save_every": "--save-every"})
        # [CLS], one token, [SEP]: below that every input was cut to nothing and the head learned chance
        check_at_least(self, 3, {"max_length": "--max-length"})
        check_optimizer_settings(self.lr, self.warmup, self.weight_decay)
        check_setting(len(self.seeds) > 0, "seeds", self.seeds, "--seeds", "give at least one seed")
        for seed in self.seeds:
            check_setting(isinstance(seed, int) and 0 <= seed <= MAX_SEED, "seeds", self.seeds, "--seeds",
                          f"each seed must be an integer from 0 to {MAX_SEED}")
        check_setting(math.isfinite(self.grad_clip) and self.grad_clip >= 0, "grad_clip", self.grad_clip, None,
                      "give a norm >= 0 (0: off)")

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else (1e-3 if self.freeze_encoder else 5e-5)


@dataclass
class SeedResult:
    seed: int
    best_epoch: float = 0.0
    dev: dict[str, float] = field(default_factory=dict)
    test: dict[str, float] = field(default_factory=dict)
    null_threshold: float | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    train_seconds: float = 0.0


@dataclass
class FinetuneReport:
    head: str
    metric: str
    config: dict[str, Any]
    counts: dict[str, int]
    seeds: list[SeedResult] = field(default_factory=list)
    best_seed: int | None = None
    feature_seconds: float = 0.0
    out_dir: str = ""
    finished: bool = False  # true once every seed is done; a killed run's report says false
    # what the user should know about the run's data and model, one sentence each: labels never trained on,
    # inputs cut at max_length, words read as [UNK], a mean-pooled head transformers cannot read
    notes: list[str] = field(default_factory=list)

    def summary(self, split: str) -> dict[str, tuple[float, float]]:
        """{metric: (mean, sample std)} over seeds for "dev" or "test"."""
        rows = [getattr(s, split) for s in self.seeds if getattr(s, split)]
        if not rows:
            return {}
        out = {}
        for k in rows[0]:
            v = np.array([r[k] for r in rows], dtype=np.float64)
            out[k] = (float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["dev_summary"] = {k: {"mean": m, "std": s} for k, (m, s) in self.summary("dev").items()}
        d["test_summary"] = {k: {"mean": m, "std": s} for k, (m, s) in self.summary("test").items()}
        return d


def _frozen_batch(feats: list[torch.Tensor], idx: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cached encoder outputs of rows ``idx`` -> (B, H) or zero-padded (B, T, H) plus its (B, T) mask."""
    rows = [feats[i] for i in idx]
    if rows[0].dim() == 1:
        return torch.stack(rows), None
    T = max(r.shape[0] for r in rows)
    out = rows[0].new_zeros(len(rows), T, rows[0].shape[1])
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for j, r in enumerate(rows):
        out[j, :r.shape[0]] = r
        mask[j, :r.shape[0]] = 1
    return out, mask


class _Split:
    """Examples of one split with their model rows and (frozen runs) cached encoder outputs."""

    def __init__(self, examples: Sequence, feats: Featurized) -> None:
        self.examples, self.feats = examples, feats
        self.cache: list[torch.Tensor] | None = None


def resolved_max_length(given: int | None, model_dir: str, head: str = "classify") -> int:
    """The tokens per input: `given`, or the head's default (DEFAULT_MAX_LENGTH, DEFAULT_QA_MAX_LENGTH) capped
    by the model's positions.

    A given value above the positions is refused here, before featurizing; it failed at the first input longer
    than the positions ("sequence length 704 exceeds max_position_embeddings=512"), naming no flag.
    """
    positions = read_config(model_dir)[0].max_position_embeddings
    if given is None:
        return min(DEFAULT_QA_MAX_LENGTH if head == "qa" else DEFAULT_MAX_LENGTH, positions)
    if given > positions:
        raise ValueError(f"max_length={given}: the model in {model_dir} reads at most {positions} tokens "
                         "(--max-length)")
    return given


def out_dir_state(out_dir: str, model_dir: str | None = None) -> str:
    """What is at a run's output directory: "free" (nothing, or an empty directory), "run" (an earlier run: it
    holds finetune_report.json and nothing but what a run writes), "mixed" (an earlier run and files of the
    user's), "model" (the very directory being fine-tuned), "file" or "other" (a directory holding anything
    else).

    Why: a run replaced whatever was at ``out_dir`` (a directory of the user's files, a file, the model itself),
    and --overwrite deleted a user's files that sat beside an earlier run's report.
    """
    if not os.path.lexists(out_dir):
        return "free"
    if not os.path.isdir(out_dir):
        return "file"
    if model_dir is not None and os.path.isdir(model_dir) and os.path.samefile(out_dir, model_dir):
        return "model"
    names = os.listdir(out_dir)
    if not names:
        return "free"
    if REPORT_NAME not in names:
        return "other"
    return "mixed" if foreign_entries(out_dir, RUN_NAMES) else "run"


def run_finished(out_dir: str) -> bool | None:
    """Whether the run in `out_dir` finished, from its report's ``finished``; None when it does not say
    (no readable report, or one written before the field existed)."""
    try:
        with open(os.path.join(out_dir, REPORT_NAME), encoding="utf-8") as f:
            finished = json.load(f).get("finished")
    except (OSError, ValueError, AttributeError):
        return None
    return finished if isinstance(finished, bool) else None


def _work_dir(out_dir: str, model_dir: str, overwrite: bool) -> str:
    """The directory the run writes into: `out_dir` itself when it is free, else (an earlier run, with
    `overwrite`) its staging directory, swapped in at the end. Anything else at `out_dir` is refused."""
    state = out_dir_state(out_dir, model_dir)
    if state == "free":
        return out_dir
    if state == "file":
        raise ValueError(f"out_dir={out_dir!r} is a file; give a directory (--out)")
    if state == "model":
        raise ValueError(f"out_dir={out_dir!r} is the model directory being fine-tuned; give another (--out)")
    if state == "other":
        raise ValueError(not_ours_refusal(f"out_dir={out_dir!r}", sorted(os.listdir(out_dir)), "a fine-tuning run"))
    if state == "mixed":  # replacing the run would delete them with it
        raise ValueError(beside_earlier_refusal(f"out_dir={out_dir!r}", "an earlier fine-tuning run",
                                                foreign_entries(out_dir, RUN_NAMES),
                                                replaced="overwrite=True (--overwrite) would remove with it",
                                                another="another directory (--out)"))
    if not overwrite:
        stopped = locate_state(out_dir, STATE_DIR)
        also = (f" (or resume=True to continue the run stopped in {os.path.dirname(stopped)}: --resume)"
                if stopped else "")
        raise ValueError(f"out_dir={out_dir!r} holds an earlier fine-tuning run; pass overwrite=True to replace "
                         f"it once this run is complete (--overwrite){also}")
    work = staging_dir(out_dir)
    if out_dir_state(work) not in ("free", "run"):  # "run": what an interrupted replacing run left: ours to reuse
        raise ValueError(f"{work} is in the way: a run replacing {out_dir} is built there; move it away")
    return work


def find_state(out_dir: str) -> str:
    """The state directory ``resume`` continues from: that of a run replacing an earlier one
    (``OUT.unfinished``) or of the run in `out_dir`. Refused, saying why and what to run instead, when there
    is none."""
    state = locate_state(out_dir, STATE_DIR)
    if state is not None:
        if os.path.dirname(state) == staging_dir(out_dir):  # its swap is still to come: not over files added since
            refuse_swap_over_theirs(staging_dir(out_dir), out_dir, RUN_NAMES)
        return state
    if run_finished(out_dir):
        raise ValueError(f"--resume: the run in {out_dir} finished ({REPORT_NAME} says so); nothing is left to "
                         f"continue. To train further, start a new run from its checkpoint: --model {out_dir}")
    again = "with --overwrite instead of --resume" if out_dir_state(out_dir) == "run" else "without --resume"
    raise ValueError(f"--resume: no training state in {out_dir} ({STATE_DIR}/ missing): a run saves one at each "
                     f"dev evaluation (and every --save-every steps); start the run again {again}")


def saved_position(out_dir: str) -> str | None:
    """Where the run in `out_dir` last saved its state, in words ("step 7 of seed 1 (2 of 2 seeds)"); None:
    none saved, or unreadable. What an interrupted command tells the user ``--resume`` would continue from."""
    try:
        user = read_train_user(find_state(out_dir))
        seeds = user["run"]["settings"]["seeds"]
        return f"step {int(user['step'])} of seed {int(user['seed'])} ({int(user['seed_index']) + 1} of {len(seeds)} seeds)"
    except (ValueError, FileNotFoundError, KeyError, TypeError):
        return None


def examples_sha256(examples: Sequence) -> str:
    """A fingerprint of a split's examples as training reads them: each example's fields but its ``source``
    (where it was read: a moved copy of a file is still the same data)."""
    h = hashlib.sha256()
    for ex in examples:
        fields = {k: v for k, v in asdict(ex).items() if k != "source"}
        h.update(json.dumps([type(ex).__name__, fields], sort_keys=True, ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


# Settings that name a model directory: compared by the directory they name (`same_run.same_path`).
PATH_FIELDS = ("model",)


def run_identity(head: str, model_dir: str, cfg: FinetuneConfig, label_map: list[str], data: dict[str, Sequence],
                 compute: dict) -> dict:
    """What a resume must match (`twotower.encoder.training.same_run.check_same_run`): the settings, task,
    model directory and label map, and the examples of each split (`examples_sha256`); and where the run
    computed (`compute`: device kind and bf16), which may differ with a warning."""
    settings = {k: v for k, v in plain(asdict(cfg)).items() if k not in UNCHECKED}
    settings |= {"head": head, "model": model_dir, "labels": list(label_map), "reading": READING}
    inputs = {f"{SPLIT_FLAGS[name]} data": examples_sha256(examples) for name, examples in data.items() if examples}
    return {"settings": settings, "inputs": inputs, "compute": compute, "real_paths": real_paths(settings, PATH_FIELDS)}


def _label_map(head: str, labels: Sequence[str] | None, train: Sequence, dev: Sequence,
               test: Sequence | None) -> tuple[list[str], list[str]]:
    """The label map of a run, and notes on labels the model never trains on.

    Without `labels`, built from the train and dev labels (`build_label_map`): a label only in dev (a rare
    class, or a dev file from elsewhere) stopped the run naming its line as "not in the label map", and a dev
    split carved by --dev-fraction named a line of the train file. Such a label is in the map, so the model
    can predict it, but it has no training example: noted, counted. A given `labels` (--labels) is the map
    in its order; a train or dev label outside it is refused. A test label outside the map is scored as a
    miss and noted: the test set is not allowed to shape the model.
    """
    if head == "qa":
        if labels is not None:  # it was ignored without a word
            raise ValueError("labels= (--labels) is for classify and tag; a QA head predicts spans")
        return [], []
    task = get_task(head)
    word = "tag" if head == "tag" else "label"
    if labels is not None:
        label_map = list(labels)
        odd = next((label for label in label_map if not isinstance(label, str)), None)
        if odd is not None:  # labels=[0, 1] matched no example ("'0' is not in the label map")
            raise TypeError(f"labels={label_map}: labels are strings, as read from the files (got {odd!r})")
        repeated = sorted(label for label, n in Counter(label_map).items() if n > 1)
        if not label_map or repeated:
            raise ValueError(f"labels={label_map}: give each {word} once, at least one (--labels)"
                             + (f"; repeated: {repeated}" if repeated else ""))
        known = set(label_map)
        for name, examples in (("train", train), ("dev", dev)):
            for i, ex in enumerate(examples):
                bad = next((label for label in task.labels_of([ex]) if label not in known), None)
                if bad is not None:
                    raise ValueError(f"{where(ex, i)}: {word} {bad!r} of the {name} examples is not in the "
                                     f"label map given (labels=, --labels): {label_map}")
    else:
        label_map = build_label_map([*task.labels_of(train), *task.labels_of(dev)])
    notes = []
    trained = set(task.labels_of(train))
    untrained = [label for label in label_map if label not in trained]
    if untrained:
        n = len(untrained)
        notes.append(f"{n} {word}{'s' * (n > 1)} of the label map {'have' if n > 1 else 'has'} no training "
                     f"example (the model can predict {'them' if n > 1 else 'it'} but never learned "
                     f"{'them' if n > 1 else 'it'}): {', '.join(map(repr, untrained[:10]))}"
                     + (f" and {n - 10} more" if n > 10 else ""))
    if test:
        known = set(label_map)
        unknown = [label for label in task.labels_of(test) if label not in known]
        if unknown:
            kinds = list(dict.fromkeys(unknown))
            notes.append(f"test: {len(unknown)} {word}{'s' * (len(unknown) > 1)} outside the label map, scored as "
                         f"misses: {', '.join(map(repr, kinds[:10]))}" + (f" and {len(kinds) - 10} more"
                                                                          if len(kinds) > 10 else ""))
    return label_map, notes


def finetune(
    head: str,
    model_dir: str,
    train: Sequence,
    dev: Sequence,
    out_dir: str,
    config: FinetuneConfig | None = None,
    test: Sequence | None = None,
    labels: Sequence[str] | None = None,
    metric_fn: MetricFn | None = None,
    overwrite: bool = False,
    resume: bool = False,
) -> FinetuneReport:
    """Fine-tune ``head`` ("classify", "tag" or "qa") on the encoder in ``model_dir``; best checkpoint -> ``out_dir``.

    Args:
        train, dev, test: TextExample / TagExample / QAExample lists (see encoder.task_examples).
        labels: the label map, in id order; default: the train and dev labels, integers by value, others
            sorted (`build_label_map`). A label with no training example is noted in the report's ``notes``.
            With `labels` given, train / dev labels outside it are an error naming the example's source; test
            labels outside the map are scored as misses, with a note.
        metric_fn: ``(predictions, examples) -> {name: value}`` for dev and test
            (e.g. SQuAD EM/F1 from eval.metrics); default the task's own scores.
        overwrite: replace the earlier run ``out_dir`` holds, once this one is complete (without it such an
            ``out_dir`` is refused). A file, the model directory, or a directory of other files is always refused.
        resume: continue the run in ``out_dir`` (or the run replacing it, in ``<out_dir>.unfinished``) exactly
            from its last saved state, with the run's own settings and examples (see the module docstring).
    """
    cfg = config or FinetuneConfig()
    task = get_task(head)
    # a pathlib.Path (get_model_path() returns one) reached the run's JSON state and failed at its first save
    model_dir, out_dir = path_argument(model_dir, "model_dir"), path_argument(out_dir, "out_dir")
    if not train or not dev:
        raise ValueError(f"fine-tuning needs training and dev examples (got {len(train)} train and {len(dev)} dev "
                         "examples)")
    state_dir = find_state(out_dir) if resume else None
    work = os.path.dirname(state_dir) if state_dir else _work_dir(out_dir, model_dir, overwrite)
    data = {"train": train, "dev": dev, "test": test}
    if cfg.max_train_examples and len(train) > cfg.max_train_examples:
        keep = np.sort(np.random.default_rng(0).choice(len(train), cfg.max_train_examples, replace=False))
        train = [train[i] for i in keep]
    if test:  # read below without targets (`_label_map`), so their presence is checked here
        task.check(test, None, True)
    label_map, notes = _label_map(head, labels, train, dev, test)
    if head == "tag":
        check_bio_labels(label_map, [*train, *dev])
    if head == "classify" and cfg.pooling == "mean":
        notes.append("a mean-pooled classifier (--pooling mean) predicts correctly only when loaded by twotower "
                     "(`twotower predict`, TaskModel.from_pretrained): transformers' BertForSequenceClassification "
                     "ignores `classifier_pooling` in config.json, reads [CLS] through a pooler it initialises "
                     "at random, and predicts other labels")
    max_length = resolved_max_length(cfg.max_length, model_dir, head)
    doc_stride, max_query_length, room = qa_window(max_length, cfg.doc_stride, cfg.max_query_length)
    if head == "qa":
        check_setting(room > doc_stride, "doc_stride", doc_stride, "--doc-stride",
                      f"a window of max_length={max_length} tokens holds {room} context tokens after a question "
                      f"of up to max_query_length={max_query_length} tokens; the overlap must be smaller "
                      "(--max-length, --max-query-length)")
    if head == "tag":  # a sentence longer than max_length is read (and trained on) in overlapping windows
        doc_stride, room = tag_window(max_length, cfg.doc_stride)
        check_setting(room > doc_stride, "doc_stride", doc_stride, "--doc-stride",
                      f"a window of max_length={max_length} tokens holds {room} tokens of a sentence after [CLS] "
                      "and before [SEP]; the overlap must be smaller (--max-length)")
    info = TaskInfo(head, label_map, max_length, doc_stride, max_query_length, cfg.max_answer_length,
                    pairs=head == "classify" and any(getattr(ex, "pair", None) is not None for ex in train))
    device = torch.device(cfg.device) if cfg.device else default_device()
    bf16 = resolve_bf16(cfg.bf16, device)
    identity = run_identity(head, model_dir, cfg, label_map, data, {"device": device.type, "bf16": bf16})
    if state_dir:  # before any model or data work: a resume never trains another run under this one's report
        _, saved_identity = read_saved_identity(state_dir)
        if saved_identity["settings"].get("reading") != READING:
            raise ValueError(f"cannot resume {work}: the run was started by an earlier twotower, which read the "
                             "examples into other rows (how lone texts beside pairs, tag words without a token, "
                             "--dev-fraction and integer labels are read changed); start the run again without "
                             "--resume")
        check_same_run(saved_identity, identity, work, FLAGS,
                       f"the 'config' of {os.path.join(work, REPORT_NAME)} lists them", "--device / --bf16",
                       paths=PATH_FIELDS)
    retain_freed_memory_for(device)  # reuse freed activation memory across steps (common/malloc.py)
    metric = cfg.metric or task.main_metric
    score = metric_fn or task.score

    tm = TaskModel.from_encoder(model_dir, info, device, cfg.dropout, seed=cfg.seeds[0], pooling=cfg.pooling)
    t0 = time.perf_counter()
    splits = {"train": _Split(train, tm.featurize(train, with_targets=True)),
              "dev": _Split(dev, tm.featurize(dev, with_targets=True))}
    if test:  # without targets: a test label outside the label map is scored as a miss (`_label_map`)
        splits["test"] = _Split(test, tm.featurize(test, with_targets=False))
    notes += [f"{name}: {note}" for name, sp in splits.items() for note in task.notes(sp.feats, tm.info)]
    if cfg.freeze_encoder:
        for name, sp in splits.items():
            sp.cache = run_rows(tm.model, sp.feats, tm.tokenizer.pad_id, device, cfg.eval_batch_size, bf16,
                                stage="encode", progress=cfg.progress, desc=f"features {name}")
    resolved = ({"max_length": max_length}  # the values used, defaults resolved
                | ({"doc_stride": doc_stride, "max_query_length": max_query_length} if head == "qa" else {})
                | ({"doc_stride": doc_stride} if head == "tag" else {}))
    report = FinetuneReport(head, metric, {**asdict(cfg), **resolved, "learning_rate": cfg.learning_rate,
                                           "bf16": bf16},
                            {k: len(sp.examples) for k, sp in splits.items()} | {"train_rows": len(splits["train"].feats)},
                            feature_seconds=time.perf_counter() - t0, out_dir=out_dir, notes=notes)
    base_state = {k: v.detach().clone() for k, v in tm.model.state_dict().items()}
    best_overall, start, saved = -math.inf, 0, None
    if state_dir:
        saved = load_train_state(state_dir, map_location=device, extra=(BEST_NAME,))
        start, best_overall = _resumed_report(saved.user, report, state_dir)
    else:  # a stopped replacing run's state in the staging directory is not this run's
        shutil.rmtree(os.path.join(work, STATE_DIR), ignore_errors=True)
    run = _Run(work, identity)
    # what a kill mid-save left: a state's copy in the run's directory, a checkpoint's beside it
    sweep_temporaries(work)
    sweep_temporaries(os.path.dirname(os.path.abspath(work)), of=os.path.basename(os.path.abspath(work)))
    for index, seed in enumerate(cfg.seeds):
        if index < start:  # done before the saved state: its results are in the report
            continue
        tm.model.load_state_dict(base_state)
        tm.model.reset_head(seed)
        result, best_state, dev_best = _train_seed(tm, task, splits, cfg, index, device, bf16, metric, score,
                                                   report, best_overall, run, saved if index == start else None)
        best_overall = max(best_overall, dev_best)
        if "test" in splits:
            tm.model.load_state_dict(best_state)
            tm.info.null_threshold = result.null_threshold
            result.test = score(_predict(tm, task, splits["test"], cfg, device, bf16), splits["test"].examples)
        _write_report(report, work)
    report.finished = True
    _write_report(report, work)
    done = work
    if work != out_dir and os.path.isfile(os.path.join(work, CONFIG_NAME)):
        refuse_swap_over_theirs(work, out_dir, RUN_NAMES)  # files the user put there during the run stay
        atomic_replace_dir(work, out_dir)  # the earlier run goes only now that this one is complete
        done = out_dir
    # last: a kill before this leaves a finished report beside the state, whose resume ends the run again
    shutil.rmtree(os.path.join(done, STATE_DIR), ignore_errors=True)
    return report


@dataclass
class _Run:
    """Where a run saves its state: `work` (its directory; a resume's is the state's parent) and `identity`
    (`run_identity`, saved with the state)."""

    work: str
    identity: dict

    @property
    def state_dir(self) -> str:
        return os.path.join(self.work, STATE_DIR)


def _resumed_report(user: dict, report: FinetuneReport, state_dir: str) -> tuple[int, float]:
    """Put the saved report's seeds into `report`; returns (the index of the seed the state is in, the best dev
    score of the run so far). A state without them is damaged."""
    try:
        report.seeds = [SeedResult(**seed) for seed in user["seeds"]]
        report.best_seed = user["best_seed"]
        index, best_overall = int(user["seed_index"]), float(user["best_overall"])
        if not 0 <= index < len(report.seeds):
            raise ValueError("seed_index")
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(os.path.join(state_dir, "state.json"), None, f"damaged: its report or position has no "
                        f"usable {exc}; start the run again without --resume") from None
    return index, best_overall


def _train_seed(tm: TaskModel, task, splits: dict[str, _Split], cfg: FinetuneConfig, index: int,
                device: torch.device, bf16: bool, metric: str, score: MetricFn, report: FinetuneReport,
                best_overall: float, run: _Run, saved: TrainState | None = None) -> tuple[SeedResult, dict, float]:
    """Train seed ``cfg.seeds[index]`` (continuing from `saved`, a state saved in it, when given); returns its
    result, its best weights and its best dev score."""
    seed = cfg.seeds[index]
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model, train = tm.model, splits["train"]
    frozen = cfg.freeze_encoder
    for p in model.bert.parameters():
        p.requires_grad_(not frozen)
    trainable = [m for n, m in model.named_children() if n != "bert"] if frozen else [model]
    opt = make_optimizer(torch.nn.ModuleList(trainable), cfg.learning_rate, cfg.weight_decay)
    # what the state saves and restores: the modules trained (a frozen encoder is the seed's start, always),
    # under the model's own names
    trained = torch.nn.ModuleDict({n: m for n, m in model.named_children() if n != "bert"}) if frozen else model
    lengths = train.feats.lengths()
    steps_per_epoch = math.ceil(len(lengths) / cfg.batch_size)
    total = cfg.epochs * steps_per_epoch
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    eval_at = {min(steps_per_epoch, round(steps_per_epoch * (k + 1) / cfg.evals_per_epoch))
               for k in range(cfg.evals_per_epoch)}
    best, best_state, step, losses = -math.inf, {}, 0, []
    best_step = -1  # the step best_state was taken at: a state saved then holds the weights once, not twice
    start_epoch, start_batch, seconds = 0, 0, 0.0
    if saved is None:
        result = SeedResult(seed)
        report.seeds.append(result)  # live: a report written mid-run shows this seed's history so far
    else:
        result = report.seeds[index]
        step, start_epoch, start_batch, losses, best, best_state, seconds = _restore_seed(saved, run.state_dir,
                                                                                         model, trained, opt)
    t0 = time.perf_counter()

    def save_state(epoch: int, batch: int, checkpoint: bool) -> None:
        """Save the run's state; with the run's best checkpoint (`checkpoint`), inside its directory."""
        # saved at the evaluation that set the seed's best, the best weights are the weights the state holds:
        # a flag, not a second copy of the model (`_restore_seed` takes them from the weights)
        best_is_current = best_step == step
        user = {"seed_index": index, "seed": seed, "step": step, "epoch": epoch, "batch": batch, "losses": losses,
                "best": best, "best_is_current": best_is_current, "best_overall": best_overall,
                "seconds": seconds + time.perf_counter() - t0,
                "seeds": [asdict(s) for s in report.seeds], "best_seed": report.best_seed, "run": run.identity}
        own = trained.state_dict()
        best_weights = {n: best_state[n] for n in own} if best_state and not best_is_current else {}

        def write(directory: str) -> None:
            save_train_state(os.path.join(directory, STATE_DIR), own, opt, user, extra={BEST_NAME: best_weights})

        if checkpoint:
            # the report goes in with the checkpoint: a directory swapped in without it was a checkpoint no
            # later run could tell from a user's model
            tm.save(run.work, extra_files={REPORT_NAME: _report_text(report)}, also=write)
        else:
            _write_report(report, run.work)  # first: a directory holding a state is a run's
            write(run.work)

    for epoch in range(cfg.epochs):
        if step >= total:
            break
        # drawn for every epoch, those a resumed run trained before its state too: its next batch is the one
        # the uninterrupted run drew
        batches = batch_order(lengths, cfg.batch_size, rng)
        if epoch < start_epoch:
            continue
        skip = start_batch if epoch == start_epoch else 0  # trained before the state was saved
        model.train()
        if frozen:
            model.bert.eval()
        bar = tqdm(batches[skip:], desc=f"seed {seed} epoch {epoch + 1}", disable=not cfg.progress, leave=False)
        for k, idx in enumerate(bar, start=skip + 1):
            set_lr(opt, cfg.learning_rate, lr_factor(step / max(1, total), cfg.warmup))
            batch = task.batch_targets(train.feats, idx)
            if frozen:
                x, mask = _frozen_batch(train.cache, idx)  # type: ignore[arg-type]
                batch["attention_mask"] = mask
                logits = model.head(x.to(device))
            else:
                inputs = model_inputs(train.feats, idx, tm.tokenizer.pad_id, device)
                batch["attention_mask"] = inputs["attention_mask"]
                with autocast(device, bf16):
                    logits = model(**inputs)
            loss = task.loss(logits, {k2: v.to(device) if v is not None else None for k2, v in batch.items()})
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")
            step += 1
            done = step >= total
            if k in eval_at or done:
                dev_scores, threshold = _evaluate(tm, task, splits["dev"], cfg, device, bf16, score)
                row = {"epoch": round(epoch + k / steps_per_epoch, 3), "step": step,
                       "train_loss": float(np.mean(losses)), **dev_scores}
                result.history.append(row)
                losses = []
                logger.info("seed %d %s", seed, row)
                if metric not in dev_scores:
                    raise ValueError(f"metric {metric!r} not among dev scores {sorted(dev_scores)}")
                checkpoint = False
                if dev_scores[metric] > best:
                    best = dev_scores[metric]
                    best_state = {n: v.detach().clone() for n, v in model.state_dict().items()}
                    best_step = step
                    result.best_epoch, result.dev, result.null_threshold = row["epoch"], dev_scores, threshold
                    if best > best_overall:  # the best checkpoint of the whole run so far: keep it on disk
                        best_overall = best
                        tm.info.null_threshold = threshold
                        report.best_seed = seed
                        checkpoint = True
                save_state(epoch, k, checkpoint)
                model.train()
                if frozen:
                    model.bert.eval()
            elif cfg.save_every and step % cfg.save_every == 0:
                save_state(epoch, k, False)
            if done:
                break
    result.train_seconds = seconds + time.perf_counter() - t0
    for p in model.bert.parameters():
        p.requires_grad_(True)
    return result, best_state, best


def _restore_seed(saved: TrainState, state_dir: str, model: torch.nn.Module, trained: torch.nn.Module,
                  opt: torch.optim.Optimizer) -> tuple[int, int, int, list[float], float, dict, float]:
    """Load a seed's saved state: the weights trained, AdamW's moments and the generators into `trained`, `opt`
    and torch; returns (step, epoch, batches of that epoch done, losses since the last evaluation, best dev
    score, best weights (the whole model's), seconds trained)."""
    restore_train_state(saved, state_dir, trained, opt)
    user, best_weights = saved.user, saved.extra[BEST_NAME]
    own = model.state_dict()
    if not set(best_weights) <= set(own):
        raise DataError(os.path.join(state_dir, f"{BEST_NAME}.safetensors"), None, "damaged: it holds tensors "
                        "the model has not; start the run again without --resume")
    # a frozen encoder's part of the best weights is the seed's start, as it is now; a state saved at the
    # evaluation that set the best holds them once, as the weights it restored (`best_is_current`)
    current = user.get("best_is_current") is True
    best_state = {n: v.detach().clone() for n, v in own.items()} | best_weights if best_weights or current else {}
    try:
        position = (int(user["step"]), int(user["epoch"]), int(user["batch"]), [float(x) for x in user["losses"]],
                    float(user["best"]))
        seconds = float(user["seconds"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(os.path.join(state_dir, "state.json"), None, f"damaged: its training position has no "
                        f"usable {exc}; start the run again without --resume") from None
    return (*position, best_state, seconds)


def _predict(tm: TaskModel, task, split: _Split, cfg: FinetuneConfig, device: torch.device, bf16: bool) -> list:
    """Predictions for a split: through the head only when its encoder outputs are cached."""
    if split.cache is None:
        outputs = [o.numpy() for o in run_rows(tm.model, split.feats, tm.tokenizer.pad_id, device,
                                               cfg.eval_batch_size, bf16)]
    else:
        tm.model.eval()
        outputs: list[np.ndarray] = [None] * len(split.feats)  # type: ignore[list-item]
        with torch.no_grad():
            for idx in batch_order(split.feats.lengths(), cfg.eval_batch_size):
                x, _ = _frozen_batch(split.cache, idx)
                y = tm.model.head(x.to(device)).float().cpu()
                for j, i in enumerate(idx):
                    outputs[i] = (y[j] if y.dim() == 2 else y[j, :split.cache[i].shape[0]]).numpy()
    return task.decode(split.examples, split.feats, outputs, tm.info)


def _evaluate(tm: TaskModel, task, dev: _Split, cfg: FinetuneConfig, device: torch.device, bf16: bool,
              score: MetricFn) -> tuple[dict[str, float], float | None]:
    """Dev scores; for QA with the "no answer" threshold re-chosen on these predictions."""
    tm.info.null_threshold = None
    preds = _predict(tm, task, dev, cfg, device, bf16)
    threshold = None
    if task.head == "qa":
        threshold = choose_null_threshold(preds, dev.examples)
        for p in preds:
            p.no_answer = p.start < 0 or (threshold is not None and p.score_diff > threshold)
    return {k: float(v) for k, v in score(preds, dev.examples).items()}, threshold


def _report_text(report: FinetuneReport) -> str:
    return json.dumps(report.to_dict(), indent=2) + "\n"


def _write_report(report: FinetuneReport, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_text(os.path.join(out_dir, REPORT_NAME), _report_text(report))

