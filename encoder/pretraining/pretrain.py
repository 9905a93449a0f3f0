"""MLM (+ optional NSP) pretraining from scratch, as one loop that reads top to bottom.

    tokenizer -> config -> output dir rules (refuse a foreign run; a resume must be this run) -> tokenized
    corpus (cached) -> packed rows -> model, AdamW -> (resume: read the state) -> output dir written ->
    DDP -> loop { lr from budget progress; accumulate micro-batches under bf16 autocast; clip; step; log;
    validate; checkpoint } -> final validation, checkpoint, plot

Nothing is written to the output directory until every input has been read and checked, so a start that
fails on bad input (a malformed corpus, a damaged ``--init-from``) leaves an earlier run there as it was,
``--overwrite`` or not. A run that replaces what ``--out`` holds (``--overwrite``) is built in
``OUT.unfinished`` and swapped into ``--out`` only once its budget is spent (`run_dir`): one stopped on the
way, or paused with ``--max-steps``, leaves the earlier run whole, and ``--resume`` continues it there.

The schedule is keyed to the budget (tokens, steps or wall-clock seconds), so
warmup and decay end exactly when the budget runs out.  Checkpoints are the HF
layout at the top of the output directory (`BertForMaskedLM.from_pretrained(out)`
loads it) plus ``trainer_state/`` (`twotower.encoder.training.train_state`) that `resume=True`
continues from exactly.  ``run.json`` records the run's settings and a fingerprint of its text (the
SHA-256 of every corpus and validation file, and the tokenizer's), so a resume with other settings or
other text is refused, naming the flags, instead of continuing as another run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field

import torch

from twotower.common.atomic import (
    commit_staged_run,
    left_by_a_stopped_run,
    recover_replaced_dir,
    refuse_swap_over_theirs,
    staging_dir,
    sweep_temporaries,
)
from twotower.common.device import autocast, resolve_bf16, training_device
from twotower.common.distributed import (
    DistInfo,
    all_reduce_sum,
    barrier,
    cleanup,
    init_distributed,
    stopped_anywhere,
)
from twotower.common.errors import DataError, check_at_least, check_setting
from twotower.common.malloc import retain_freed_memory_for
from twotower.common.paths import beside_earlier_refusal, foreign_entries, not_ours_refusal
from twotower.encoder.core.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    load_into,
    read_weights,
    save_pretrained,
    split_prefix,
)
from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.tokenizer import TOKENIZER_FILES, Tokenizer
from twotower.encoder.pretraining.corpus import check_corpus_files, corpus_key, tokenize_corpus
from twotower.encoder.pretraining.masking import MaskingSpec, TokenSpace
from twotower.encoder.pretraining.mlm import BertForPreTraining
from twotower.encoder.pretraining.pretrain_data import (
    MIN_SAMPLE,
    BatchMaker,
    NSPRows,
    PackedRows,
    PretrainBatch,
    RowOrder,
    validation_batches,
)
from twotower.encoder.training.budget import Budget, Clock
from twotower.encoder.training.optim import check_optimizer_settings, lr_factor, make_optimizer, set_lr
from twotower.encoder.training.run_log import RunLog, plot_curves
from twotower.encoder.training.train_state import (
    load_train_state,
    read_train_user,
    restore_train_state,
    save_train_state,
)

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
STATE_DIR = "trainer_state"
# Every name a run writes into its directory (`start_out_dir`, `write_checkpoint`, the end of `_pretrain`,
# `commit_staged_run`): --overwrite replaces a directory holding only these, never one holding a user's file.
RUN_NAMES = frozenset({RUN_FILE, STATE_DIR, "log.jsonl", "log.jsonl.previous", "curve.png", "summary.json",
                       CONFIG_NAME, WEIGHTS_NAME, *TOKENIZER_FILES})
# Arguments that change what a step computes (or, valid_rows, what the log's validation scores mean):
# resuming with another value would not be "the same run". Each is the flag --<name with dashes>.
_RUN_SHAPE = ("seq_len", "batch_size", "grad_accum", "nsp", "wwm", "mask_rate", "num_masks", "static_masks",
              "seed", "lr", "warmup", "decay", "weight_decay", "clip", "valid_rows")
# Config fields set by a flag other than the architecture's (--size, --config or --init-from): config key -> flag.
_CONFIG_FLAGS = {"vocab_size": "--tokenizer", "pad_token_id": "--tokenizer", "hidden_dropout_prob": "--dropout",
                 "attention_probs_dropout_prob": "--dropout"}
# When a run first saves the state --resume continues from (said when there is none yet).
FIRST_SAVE = "every --ckpt-every-minutes (or --ckpt-every-steps) and when --max-steps pauses it"
# What to do when the run cannot be resumed from what --out holds ({out}: the run directory).
_START_AGAIN = ("start the run again with --overwrite, or continue from its exported weights as a new run "
                "(--init-from {out} --tokenizer {out} --out NEW_DIR: a fresh optimizer and schedule)")


@dataclass
class PretrainArgs:
    corpus: list[str]
    tokenizer: str
    out: str
    size: str = "mini"
    config: str | None = None  # EncoderConfig JSON; overrides size
    init_from: str | None = None  # start from this checkpoint's weights and config (continued pretraining)
    budget: str | None = None  # wall clock, e.g. "30m"
    tokens: str | None = None  # e.g. "20M"
    steps: int | None = None
    seq_len: int = 128
    batch_size: int = 64
    grad_accum: int = 1
    lr: float = 5e-4
    warmup: float = 0.06
    decay: str = "linear"
    weight_decay: float = 0.01
    clip: float = 1.0
    dropout: float | None = None  # overrides both dropout probabilities of the config
    wwm: bool = False
    nsp: bool = False
    mask_rate: float = 0.15
    num_masks: int | None = None
    static_masks: int = 0  # > 0: static masking with this many pre-drawn copies per row
    valid: list[str] = field(default_factory=list)
    valid_rows: int = 512
    evals: int = 10  # validations spread evenly over the budget (plus one at the end)
    eval_every_steps: int | None = None
    ckpt_every_minutes: float = 10.0
    ckpt_every_steps: int | None = None
    log_every: int = 10
    max_steps: int | None = None  # stop early without changing the schedule (dry runs, tests)
    bf16: bool | str = "auto"
    device: str | None = None
    seed: int = 0
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    cache_dir: str | None = None
    dump_replicas: str | None = None  # test hook: every rank writes its final parameters here

    def __post_init__(self) -> None:
        """Refuse settings that crash mid-run or train something else, naming the field and the flag
        (``log_every=0`` divided by zero at the first step; a zero interval meant "never" or "every step"
        depending on the field; a negative rate failed in torch's words; the batch, sequence and masking
        settings were checked later, each in a library's words)."""
        check_optimizer_settings(self.lr, self.warmup, self.weight_decay)
        check_setting(math.isfinite(self.clip) and self.clip >= 0, "clip", self.clip, "--clip",
                      "give a gradient norm >= 0 (0: off)")
        check_setting(self.ckpt_every_minutes >= 0, "ckpt_every_minutes", self.ckpt_every_minutes,
                      "--ckpt-every-minutes", "give minutes >= 0 (0: every step)")
        check_at_least(self, 1, {"log_every": "--log-every", "valid_rows": "--valid-rows",
                                 "eval_every_steps": "--eval-every-steps", "ckpt_every_steps": "--ckpt-every-steps",
                                 "max_steps": "--max-steps", "batch_size": "--batch-size", "grad_accum": "--grad-accum",
                                 "num_masks": "--num-masks"})
        check_at_least(self, MIN_SAMPLE + 1, {"seq_len": "--seq-len"})  # a row holds [CLS] a token [SEP] at least
        check_setting(self.evals >= 0, "evals", self.evals, "--evals", "give 0 (only at the end) or more")
        check_setting(0 < self.mask_rate < 1, "mask_rate", self.mask_rate, "--mask-rate", "give a fraction in (0, 1)")
        check_setting(self.dropout is None or 0 <= self.dropout < 1, "dropout", self.dropout, "--dropout",
                      "give a probability in [0, 1)")  # -0.1 failed in torch's words, after the corpus was read
        check_setting(self.static_masks >= 0, "static_masks", self.static_masks, "--static-masks",
                      "give 0 (dynamic masking) or more")


# ---- setup -----------------------------------------------------------------------------------------------
def load_tokenizer(directory: str) -> Tokenizer:
    if os.path.isfile(directory):  # a corpus given by mistake was "tokenizer directory not found"
        raise ValueError(f"--tokenizer {directory}: a file, not a tokenizer directory (give the directory "
                         "`twotower tokenizer train --out` wrote, or a checkpoint's)")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"tokenizer directory not found: {directory}")
    try:
        return Tokenizer.from_pretrained(directory)
    except ValueError as exc:
        raise ValueError(f"tokenizer {directory}: {exc}") from exc


def resolve_config(args: PretrainArgs, tokenizer: Tokenizer) -> EncoderConfig:
    if args.init_from:
        if args.config:
            raise ValueError("--init-from takes the architecture from the checkpoint; drop --config")
        path = os.path.join(args.init_from, CONFIG_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--init-from: no {CONFIG_NAME} in {args.init_from}")
        config = EncoderConfig.load(path)
        if config.vocab_size != tokenizer.vocab_size:
            raise ValueError(f"--init-from {args.init_from}: vocab_size={config.vocab_size} but the tokenizer "
                             f"{args.tokenizer} has {tokenizer.vocab_size} tokens; use the checkpoint's tokenizer")
        own = _checkpoint_tokenizer(args.init_from)
        # the same size is not the same vocabulary: each embedding row belongs to the checkpoint's token
        if own is not None and own.fingerprint() != tokenizer.fingerprint():
            raise ValueError(f"--tokenizer {args.tokenizer} is not the tokenizer of --init-from {args.init_from} "
                             f"(the same {tokenizer.vocab_size} tokens in size, but other tokens or another "
                             f"normalisation): its embeddings belong to its own tokens; pass --tokenizer "
                             f"{args.init_from}")
    elif args.config:
        config = EncoderConfig.load(args.config)
        if config.vocab_size != tokenizer.vocab_size:
            raise ValueError(f"{args.config}: vocab_size={config.vocab_size} but the tokenizer has "
                             f"{tokenizer.vocab_size} tokens")
    else:
        config = EncoderConfig.named(args.size, tokenizer.vocab_size)
    config.pad_token_id = tokenizer.pad_id
    if args.dropout is not None:
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = float(args.dropout)
    if args.seq_len > config.max_position_embeddings:
        raise ValueError(f"seq_len={args.seq_len}: the model reads at most {config.max_position_embeddings} positions "
                         "(--seq-len)")
    if config.type_vocab_size < 2 and args.nsp:  # an IndexError inside the embeddings, after run.json was written
        raise ValueError(f"--nsp reads sentence pairs as two segments, but {args.config or args.init_from} has one "
                         "segment embedding (type_vocab_size 1); drop --nsp, or start from a model with type_vocab_size 2")
    return config


def _checkpoint_tokenizer(directory: str) -> Tokenizer | None:
    """The tokenizer a checkpoint directory holds (None: it holds none)."""
    if not any(os.path.isfile(os.path.join(directory, n)) for n in ("tokenizer.json", "vocab.txt")):
        return None
    return Tokenizer.from_pretrained(directory)


def trained_positions(args: PretrainArgs, config: EncoderConfig) -> int:
    """The positions this run's weights have learned, saved as the tokenizer's ``model_max_length`` so that every
    reader (ours, transformers, sentence-transformers) truncates to them by default: --seq-len, or the
    --init-from checkpoint's own length where longer, never more than the model's position table.

    Why: the tokenizer kept 512 whatever was trained, so a model of 96 positions crashed in transformers and one
    trained on rows of 64 tokens embedded up to 512, reading position embeddings that never learned anything.
    """
    trained = args.seq_len
    if args.init_from:
        recorded = _recorded_positions(args.init_from)
        if recorded is not None:
            trained = max(trained, recorded)
        elif (own := _checkpoint_tokenizer(args.init_from)) is not None:
            trained = max(trained, own.model_max_length)
    return min(trained, config.max_position_embeddings)


def _recorded_positions(directory: str) -> int | None:
    """The positions an earlier pretraining run in ``directory`` trained, from its ``run.json``: the
    ``positions`` it recorded, or, for a run from before they were recorded (whose tokenizer says 512 whatever
    it trained), its ``--seq-len``. None where ``directory`` holds no readable run.json (another checkpoint)."""
    try:
        with open(os.path.join(directory, RUN_FILE), encoding="utf-8") as f:
            record = json.load(f)
        positions = record.get("positions", record["args"]["seq_len"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return positions if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0 else None


def run_dir(args: PretrainArgs) -> str:
    """Where this run writes: ``--out``, or ``OUT.unfinished`` for a run that replaces what ``--out`` holds
    (``--overwrite``), swapped in once its budget is spent (`finish_out_dir`). A resume continues where the
    run's state is: in ``OUT.unfinished`` when a replacing run left one there.

    Why: ``--overwrite`` removed the earlier run (perhaps hours of pretraining) when the new one started, so a
    new run stopped by a crash, a Ctrl-C or a mistyped flag left neither; `twotower train` and `finetune`
    already built a replacing run apart.
    """
    staged = staging_dir(args.out)
    if args.resume:
        recover_replaced_dir(os.path.join(staged, STATE_DIR))  # a save killed mid-swap: put the last state back
        return resume_dir(args.out)
    holds = os.path.isdir(args.out) and bool(os.listdir(args.out))
    return staged if args.overwrite and holds else args.out


def resume_dir(out: str) -> str:
    """Where the run ``--resume`` continues is: ``OUT.unfinished`` when a run replacing ``--out`` saved a state
    there, else ``--out``."""
    staged = staging_dir(out)
    return staged if os.path.isdir(os.path.join(staged, STATE_DIR)) else out


def _saved_user(work: str) -> dict | None:
    """The scalars of the training state saved in `work` (None: none, or unreadable), read without putting
    back a state a killed swap moved aside: a refusal and a Ctrl-C line change no files."""
    try:
        return read_train_user(os.path.join(work, STATE_DIR), recover=False)
    except (OSError, DataError):
        return None


def saved_step(work: str) -> int | None:
    """The step of the training state saved in `work` (None: none, or unreadable): what ``--resume`` would
    continue from, as an interrupted run and a refusal say."""
    try:
        return int((_saved_user(work) or {})["step"])
    except (KeyError, TypeError, ValueError):
        return None


def _finished(work: str, budget: Budget) -> bool:
    """Whether the state saved in `work` has spent `budget` (a resume would train nothing)."""
    user = _saved_user(work)
    try:
        return user is not None and budget.progress(user["tokens"], user["step"], user["elapsed"]) >= 1.0
    except (KeyError, TypeError, ValueError):
        return False


def finish_out_dir(args: PretrainArgs, work: str, info: DistInfo) -> str:
    """Swap a replacing run whose budget is spent into ``--out`` (the earlier run's log is kept as
    ``log.jsonl.previous``); returns where the run is now."""
    if work == args.out:
        return work
    # rank 0 decides and every rank hears it (`stopped_anywhere`): ranks that looked at --out themselves
    # looked at other moments (rank 0 writes the checkpoint first), and one refusing alone hung the others
    error = None
    if info.is_main:
        try:
            commit_staged_run(work, args.out, "log.jsonl", RUN_NAMES)  # refuses files of the user's first
        except Exception as exc:  # noqa: BLE001 - re-raised by stopped_anywhere on this rank
            error = exc
    stopped_anywhere(error, info, "rank 0")
    return args.out


def check_out_dir(args: PretrainArgs, work: str, config: EncoderConfig, budget: Budget, tokenizer: Tokenizer,
                  corpus_paths: list[str], valid_paths: list[str], info: DistInfo, compute: dict) -> None:
    """Refuse to write into another run unless resuming it or told to overwrite; writes nothing (a resume
    only puts back a training state that a kill left moved aside, `recover_replaced_dir`).

    A resume must be the same run: the same settings (`_RUN_SHAPE`, the budget, the config), the same
    number of processes, the same text (the files' SHA-256) and tokenizer. Anything else is refused naming
    each flag, since continuing would silently train another run under the first one's log and schedule.
    `work` is where the run writes (`run_dir`): the run a resume continues is there.
    Another precision or device (`compute`, from `_compute_record`) is allowed, with a warning: a run may
    move to another machine, but its later steps will not equal those of an uninterrupted run.
    """
    out = work if args.resume else args.out
    run_file = os.path.join(out, RUN_FILE)
    if args.resume:
        recover_replaced_dir(os.path.join(out, STATE_DIR))  # a save killed mid-swap: put the last state back
        if not os.path.isfile(os.path.join(out, STATE_DIR, "state.json")):
            again = "with --overwrite instead of --resume" if os.path.isfile(run_file) else "without --resume"
            raise FileNotFoundError(f"--resume: no training state in {out} ({STATE_DIR}/ missing): a run saves one "
                                    f"{FIRST_SAVE}; start the run again {again}")
        if out != args.out:  # a replacing run: its swap is still to come, not over files added meanwhile
            refuse_swap_over_theirs(out, args.out, RUN_NAMES)
        saved = read_run_record(run_file, out)
        differ = _settings_differ(saved, args, config, budget, info)
        if "data" in saved:
            now = _data_record(corpus_key(corpus_paths, tokenizer)[1],
                               corpus_key(valid_paths, tokenizer)[1] if valid_paths else [], tokenizer)
            for flag, text in _data_differs(saved["data"], now, args).items():
                differ.setdefault(flag, text)  # --tokenizer: its vocabulary may have said so already
        elif info.is_main:  # a run.json written before text fingerprints were recorded (every rank checks: said once)
            logger.warning("%s has no fingerprint of the run's text: resuming without checking --corpus, --valid "
                           "and --tokenizer", run_file)
        ran = saved.get("compute")
        if ran is not None and ran != compute and info.is_main:
            logger.warning("resuming %s %s; the run trained %s (--no-bf16 / --device): the steps from here are "
                           "computed differently, so the result will not equal an uninterrupted run",
                           out, _compute_shown(compute), _compute_shown(ran))
        if differ:
            budget_note = ""
            if "budget" in differ:
                budget_note = (" A budget other than the run's would change the learning-rate schedule mid-run; "
                               "to stop early and resume later, give the run's budget and --max-steps N; to "
                               f"train longer, start a new run with --init-from {out} --tokenizer {out} --out NEW_DIR.")
            raise ValueError(f"cannot resume {out}: this command differs from the run it continues: "
                             f"{'; '.join(differ.values())}. Give the run's own settings (they are in {run_file})."
                             + budget_note)
        # it trained 0 steps, logged a second final validation, rewrote the weights; but a replacing run whose
        # swap into --out was stopped (OUT.unfinished) finishes it by resuming
        if out == args.out and _finished(out, budget):
            raise ValueError(f"--resume: the run in {out} finished (its budget is spent); nothing is left to "
                             f"continue. To train longer, start a new run from its weights: --init-from {out} "
                             f"--tokenizer {out} --out NEW_DIR")
        return
    if os.path.lexists(out) and not os.path.isdir(out):  # it was a FileExistsError traceback
        raise ValueError(f"--out {out}: a file; give a directory for the run (a new or empty one)")
    names = sorted(os.listdir(out)) if os.path.isdir(out) else []
    # --overwrite replaces a whole directory: only one holding nothing but a run's files (a corpus kept there,
    # notes, another tool's output are the user's, and --overwrite removed them with the earlier run)
    # (a tokenizer directory holds some of a run's names, but without run.json it is no run)
    is_run = os.path.isfile(run_file)
    foreign = foreign_entries(out, RUN_NAMES) if is_run else names
    if foreign and is_run:
        raise ValueError(beside_earlier_refusal(f"--out {out}", "an earlier pretraining run", foreign))
    if foreign:
        raise ValueError(not_ours_refusal(f"--out {out}", foreign, "a pretraining run"))
    if names and not args.overwrite:
        stopped = resume_dir(out)
        resume = (f", or --resume to continue it from step {step} (saved in {stopped})"
                  if (step := saved_step(stopped)) is not None and not _finished(stopped, budget) else "")
        raise ValueError(f"output directory {out} holds another training run; pass --overwrite to replace it once "
                         f"the new run's budget is spent{resume}, or give another --out")
    if work != out and os.path.lexists(work) and not left_by_a_stopped_run(work, RUN_FILE):
        raise ValueError(f"{work} is in the way: a run replacing {out} is built there; move it away")


def read_run_record(run_file: str, out: str) -> dict:
    """The run's ``run.json`` (args, config, world_size, data); a damaged one is a `DataError` naming it."""
    remedy = "put back the run.json this run wrote, or " + _START_AGAIN.format(out=out)
    try:
        with open(run_file, encoding="utf-8") as f:
            saved = json.load(f)
    except FileNotFoundError:
        raise DataError(run_file, None, f"missing: it holds the run's settings; {remedy}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(run_file, None, f"damaged: not JSON ({' '.join(str(exc).split())}); {remedy}") from None
    if not (isinstance(saved, dict) and isinstance(saved.get("args"), dict) and isinstance(saved.get("config"), dict)):
        raise DataError(run_file, None, f"damaged: not the 'args' and 'config' objects of a run; {remedy}")
    try:
        EncoderConfig.from_dict(saved["config"], source=run_file)
    except (ValueError, TypeError) as exc:
        raise DataError(run_file, None, f"damaged: its config cannot be read ({exc}); {remedy}") from None
    return saved


def _shown(flag: str, value: object) -> str:
    """A setting as the command line gives it: ``--clip 0.5``, ``--nsp``, ``no --nsp``."""
    if value is None or value is False:
        return f"no {flag}"
    return flag if value is True else f"{flag} {value}"


def _budget_flag(args: dict) -> str:
    """The budget flag a run was given: ``--steps 400``, ``--tokens 20M`` or ``--budget 30m``."""
    for name in ("steps", "tokens", "budget"):
        if args.get(name) is not None:
            return f"--{name} {args[name]}"
    return "no budget"


def _settings_differ(saved: dict, args: PretrainArgs, config: EncoderConfig, budget: Budget,
                     info: DistInfo) -> dict[str, str]:
    """What this command sets otherwise than the run in `saved` did: flag (or "budget", "architecture") ->
    ``FLAG VALUE (the run: ...)``, in the order the message lists them."""
    before = saved["args"]
    differ = {flag: f"{_shown(flag, getattr(args, k))} (the run: {_shown(flag, before.get(k))})"
              for k in _RUN_SHAPE if before.get(k) != getattr(args, k)
              for flag in ["--" + k.replace("_", "-")]}
    try:
        same_budget = Budget.parse(before.get("budget"), before.get("tokens"), before.get("steps")) == budget
    except ValueError:
        same_budget = False
    if not same_budget:
        differ["budget"] = f"{_budget_flag(asdict(args))} (the run: {_budget_flag(before)})"
    keys = EncoderConfig.from_dict(saved["config"]).diff(config)
    arch = sorted(k for k in keys if k not in _CONFIG_FLAGS)
    if arch:
        ran = (_shown("--config", before.get("config")) if before.get("config") else
               _shown("--init-from", before.get("init_from")) if before.get("init_from") else
               _shown("--size", before.get("size")))
        now = (_shown("--config", args.config) if args.config else
               _shown("--init-from", args.init_from) if args.init_from else _shown("--size", args.size))
        differ["architecture"] = f"{now} (the run: {ran}; the architectures differ in {', '.join(arch)})"
    if any(_CONFIG_FLAGS[k] == "--dropout" for k in keys if k in _CONFIG_FLAGS):
        differ["--dropout"] = (f"{_shown('--dropout', args.dropout)} (the run: "
                               f"{_shown('--dropout', before.get('dropout'))})")
    if any(_CONFIG_FLAGS[k] == "--tokenizer" for k in keys if k in _CONFIG_FLAGS):
        differ["--tokenizer"] = (f"--tokenizer {args.tokenizer} (not the run's: its vocabulary has "
                                 f"{config.vocab_size} tokens, the run's {saved['config'].get('vocab_size')})")
    if saved.get("world_size", 1) != info.world_size:
        differ["world_size"] = (f"{info.world_size} process(es) (the run: {saved.get('world_size', 1)}; torchrun "
                                "--nproc_per_node)")
    return differ


def _data_record(corpus_files: list[dict], valid_files: list[dict], tokenizer: Tokenizer) -> dict:
    """The fingerprint of a run's text as ``run.json`` keeps it: each file's SHA-256 and size, in order (not
    its path: a corpus moved elsewhere is still the same text), and the tokenizer's fingerprint."""
    return {"corpus": [{"sha256": f["sha256"], "size": f["size"]} for f in corpus_files],
            "valid": [{"sha256": f["sha256"], "size": f["size"]} for f in valid_files],
            "tokenizer": tokenizer.fingerprint()}


def _data_differs(saved: dict, now: dict, args: PretrainArgs) -> dict[str, str]:
    """The text flags whose files (or tokenizer) are not those the run in `saved` was started with."""
    differ = {}
    if saved.get("corpus") != now["corpus"]:
        differ["--corpus"] = f"--corpus {' '.join(args.corpus)} (not the text the run was started on)"
    if saved.get("valid") != now["valid"]:
        differ["--valid"] = (f"--valid {' '.join(args.valid)} (not the run's validation text)" if args.valid else
                             "no --valid (the run was started with validation text)")
    if saved.get("tokenizer") != now["tokenizer"]:
        differ["--tokenizer"] = f"--tokenizer {args.tokenizer} (not the tokenizer the run was started with)"
    return differ


def _compute_record(bf16: bool, device: torch.device) -> dict:
    """How a run computes its steps, as ``run.json`` keeps it: the precision and the kind of device."""
    return {"bf16": bool(bf16), "device": device.type}


def _compute_shown(compute: dict) -> str:
    return f"in {'bf16' if compute.get('bf16') else 'fp32'} on {compute.get('device')}"


def start_out_dir(args: PretrainArgs, work: str, config: EncoderConfig, data: dict, info: DistInfo,
                  compute: dict, positions: int) -> None:
    """Write a new run's ``run.json`` into `work` (`run_dir`): ``--out``, empty or new, or the staging directory
    of a run replacing what ``--out`` holds, where what a stopped replacing run left is removed first.

    Called once every input has been read and checked.
    """
    out = work
    barrier(info)
    if info.is_main:
        if os.path.isdir(out) and os.listdir(out):  # only ever a stopped replacing run's (`check_out_dir`)
            shutil.rmtree(out)
        os.makedirs(out, exist_ok=True)
        from twotower.common.atomic import atomic_write_text

        record = {"args": asdict(args), "config": config.to_dict(), "world_size": info.world_size, "data": data,
                  "compute": compute, "positions": positions}
        atomic_write_text(os.path.join(out, RUN_FILE), json.dumps(record, indent=2) + "\n")
    barrier(info)


def build_rows(paths: list[str], tokenizer: Tokenizer, args: PretrainArgs, info: DistInfo,
               seed: int) -> PackedRows | NSPRows:
    """Tokenize once (rank 0 first, the others then read the cache) and pack. The rows' ``corpus.meta``
    holds the files' fingerprints (`twotower.encoder.pretraining.corpus.corpus_key`)."""
    if info.is_main:
        corpus = tokenize_corpus(paths, tokenizer, args.cache_dir, progress=args.progress)
    barrier(info)
    if not info.is_main:
        corpus = tokenize_corpus(paths, tokenizer, args.cache_dir, progress=False)
    if corpus.meta.get("replaced_bytes"):
        logger.warning("%d non-UTF-8 bytes replaced in %s", corpus.meta["replaced_bytes"], paths)
    if args.nsp:
        return NSPRows(corpus, args.seq_len, tokenizer, seed=seed)
    return PackedRows(corpus, args.seq_len, tokenizer)


# ---- the steps -------------------------------------------------------------------------------------------
def run_model(model, batch: PretrainBatch, device: torch.device, bf16: bool):
    with autocast(device, bf16):
        return model(**batch.model_inputs())


@torch.no_grad()
def evaluate(model, batches: list[PretrainBatch], device: torch.device, bf16: bool, info: DistInfo) -> dict:
    """Validation MLM accuracy and perplexity (exp of the mean target cross-entropy) over the fixed set."""
    was_training = model.training
    model.eval()
    loss_sum = correct = count = 0.0
    for batch in batches[info.rank::info.world_size]:
        out = run_model(model, batch.to(device), device, bf16)
        loss_sum += out.mlm_loss.item() * out.mlm_count
        correct += out.mlm_correct.item()
        count += out.mlm_count
    loss_sum, correct, count = all_reduce_sum([loss_sum, correct, count], info, device)
    model.train(was_training)
    mean = loss_sum / max(count, 1)
    return {"mlm_accuracy": correct / max(count, 1), "mlm_loss": mean, "perplexity": math.exp(min(mean, 50.0)),
            "targets": int(count)}


def load_initial_weights(model: BertForPreTraining, directory: str) -> None:
    """Continued (domain- or task-adaptive) pretraining: copy a checkpoint's weights into `model`.

    An MLM checkpoint (ours or HF `BertForMaskedLM` / `BertForPreTraining`) supplies encoder and MLM head;
    a bare encoder (e.g. a sentence-transformers model) supplies the encoder and the head starts fresh.
    Heads the new run does not have (a pooler, an NSP classifier) are dropped; the optimizer, schedule and
    data order start fresh, as for any new run.
    """
    enc, rest = split_prefix(read_weights(directory))  # a bare encoder has no ``bert.`` prefix: same result
    state = {f"bert.{k}": v for k, v in enc.items()}
    state.update({k: v for k, v in rest.items() if not k.startswith("cls.predictions.decoder")})  # tied
    own = model.state_dict()
    state = {k: v for k, v in state.items() if k in own or not k.startswith(("bert.pooler.", "cls.seq_relationship."))}
    has_head = any(k.startswith("cls.predictions.") for k in state)
    if not has_head:
        logger.info("%s has no MLM head; it starts fresh", directory)
    fresh = ("cls.",) if not has_head else ()
    if model.nsp and not any(k.startswith(("bert.pooler.", "cls.seq_relationship.")) for k in state):
        fresh += ("bert.pooler.", "cls.seq_relationship.")
    load_into(model, state, source=os.path.join(directory, WEIGHTS_NAME), allow_missing=fresh)


def resume_state(args: PretrainArgs, work: str, model: BertForPreTraining, optimizer: torch.optim.Optimizer,
                 order: RowOrder, counters: dict, device: torch.device) -> None:
    """Continue from ``trainer_state/``: weights, optimizer, RNG, data position and `counters`, in place.

    A damaged state (a file cut short, edited or replaced) is a `DataError` naming the file and saying what
    to do; the run directory is left as it is.
    """
    directory = os.path.join(work, STATE_DIR)
    try:
        state = load_train_state(directory, map_location=device)
        restore_train_state(state, directory, model, optimizer)
        try:
            order.load_state(state.user["data"])
            counters.update({k: state.user[k] for k in counters})
        except (KeyError, TypeError) as exc:
            raise DataError(os.path.join(directory, "state.json"), None,
                            f"damaged: its training position has no {exc}") from None
    except DataError as exc:
        raise DataError(exc.path, exc.line, f"{exc.message}; {_START_AGAIN.format(out=work)}") from None


def write_checkpoint(work: str, model: BertForPreTraining, optimizer, tokenizer: Tokenizer, order: RowOrder,
                     counters: dict) -> None:
    """trainer_state/ first (atomic as a whole), then the HF export at the top of the run's directory."""
    user = {**counters, "data": order.state()}
    save_train_state(os.path.join(work, STATE_DIR), model.state_dict(), optimizer, user)
    save_pretrained(work, model.config, model.hf_state_dict(), tokenizer, architectures=model.architectures)


def pretrain(args: PretrainArgs) -> dict:
    """Run (or resume) pretraining; returns the final summary (also written to out/summary.json)."""
    info = init_distributed(args.device)
    try:
        summary = _pretrain(args, info)
    except BaseException:
        cleanup(info, failed=True)  # a barrier after this rank alone stopped (SIGTERM to it) would hang the job
        raise
    cleanup(info)
    return summary


def _pretrain(args: PretrainArgs, info: DistInfo) -> dict:
    budget = Budget.parse(args.budget, args.tokens, args.steps)
    corpus_paths = check_corpus_files(args.corpus, "corpus")
    valid_paths = check_corpus_files(args.valid, "validation") if args.valid else []
    device = training_device(args.device)
    bf16 = resolve_bf16(args.bf16, device)
    retain_freed_memory_for(device)  # reuse freed activation memory across steps (common/malloc.py)
    tokenizer = load_tokenizer(args.tokenizer)
    config = resolve_config(args, tokenizer)
    tokenizer.model_max_length = trained_positions(args, config)
    compute = _compute_record(bf16, device)
    work = run_dir(args)  # --out, or OUT.unfinished for a run replacing what --out holds
    check_out_dir(args, work, config, budget, tokenizer, corpus_paths, valid_paths, info, compute)

    # every input is read and checked before --out is written (start_out_dir, below)
    rows = build_rows(corpus_paths, tokenizer, args, info, seed=args.seed)
    space = TokenSpace.from_tokenizer(tokenizer)
    spec = MaskingSpec(rate=args.mask_rate, whole_word=args.wwm, num_masks=args.num_masks)
    maker = BatchMaker(rows, space, spec, seed=args.seed, static_copies=args.static_masks)
    valid, vrows = [], None
    if valid_paths:
        vrows = build_rows(valid_paths, tokenizer, args, info, seed=10_007)
        valid = validation_batches(vrows, space, args.batch_size, max_rows=args.valid_rows)

    torch.manual_seed(args.seed)
    model = BertForPreTraining(config, nsp=args.nsp)
    if args.init_from and not args.resume:
        load_initial_weights(model, args.init_from)
    model = model.to(device)
    optimizer = make_optimizer(model, args.lr, weight_decay=args.weight_decay)
    order = RowOrder(len(rows), args.seed, info.world_size, info.rank)
    counters = {"step": 0, "tokens": 0, "elapsed": 0.0, "next_eval": 1}
    log = RunLog(os.path.join(work, "log.jsonl"), enabled=info.is_main)
    if args.resume:
        if info.is_main:  # what saves killed mid-write left: a full state copy, a half-drawn curve
            sweep_temporaries(work)
        resume_state(args, work, model, optimizer, order, counters, device)
        log.truncate_after(counters["step"])
        logger.info("resumed %s at step %d (%d tokens)", work, counters["step"], counters["tokens"])
    else:
        start_out_dir(args, work, config, _data_record(rows.corpus.meta["files"],
                                                 vrows.corpus.meta["files"] if vrows else [], tokenizer), info,
                      compute, tokenizer.model_max_length)
    ddp = model
    if info.enabled:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    bar = None
    if args.progress and info.is_main:
        from tqdm.auto import tqdm

        unit = {"tokens": "tok", "steps": "step", "seconds": "s"}[budget.kind]
        bar = tqdm(total=budget.total, unit=unit, unit_scale=True, desc="pretrain", dynamic_ncols=True)

    def used() -> float:
        return {"tokens": counters["tokens"], "steps": counters["step"], "seconds": counters["elapsed"]}[budget.kind]

    def progress() -> float:
        return budget.progress(counters["tokens"], counters["step"], counters["elapsed"])

    if bar is not None:
        bar.update(used())
    clock = Clock(counters["elapsed"])
    last_ckpt, window_t, window_tok = clock.elapsed(), time.monotonic(), 0
    first_rows = None
    ddp.train()
    while progress() < 1.0 and (args.max_steps is None or counters["step"] < args.max_steps):
        # --- one optimizer step: lr from progress, accumulate, clip, step
        factor = lr_factor(progress(), warmup=args.warmup, decay=args.decay)
        lr = args.lr * factor
        set_lr(optimizer, args.lr, factor)
        micro = order.next_step(args.batch_size, args.grad_accum)
        first_rows = first_rows if first_rows is not None else micro[0][0].tolist()
        loss_sum = correct = count = tokens = 0.0
        for i, (idx, epoch, offset) in enumerate(micro):
            batch = maker.make(idx, epoch, offset).to(device)
            sync = contextlib.nullcontext() if (i == len(micro) - 1 or not info.enabled) else ddp.no_sync()
            with sync:
                out = run_model(ddp, batch, device, bf16)
                (out.loss / len(micro)).backward()
            loss_sum += out.loss.item()
            correct += out.mlm_correct.item()
            count += out.mlm_count
            tokens += batch.n_tokens
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # --- bookkeeping agreed by all ranks (tokens and wall clock decide when the budget ends)
        loss_sum, correct, count, tokens, elapsed = all_reduce_sum(
            [loss_sum, correct, count, tokens, clock.elapsed()], info, device)
        before = used()
        counters["step"] += 1
        counters["tokens"] += int(tokens)
        counters["elapsed"] = elapsed / info.world_size
        window_tok += tokens
        loss = loss_sum / (len(micro) * info.world_size)
        acc = correct / max(count, 1)
        if bar is not None:
            bar.update(min(used(), budget.total) - min(before, budget.total))
            bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.3f}", refresh=False)
        if counters["step"] % args.log_every == 0 or counters["step"] == 1:
            now = time.monotonic()
            tok_s = window_tok / max(now - window_t, 1e-9)
            window_t, window_tok = now, 0
            log.write({"type": "train", "step": counters["step"], "tokens": counters["tokens"], "loss": loss,
                       "mlm_accuracy": acc, "lr": lr, "tokens_per_s": tok_s, "elapsed": counters["elapsed"]})
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.3f}", tok_s=f"{tok_s:,.0f}")
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {counters['step']}; lower --lr")
        # --- periodic validation and checkpoints
        due_eval = (counters["step"] % args.eval_every_steps == 0) if args.eval_every_steps else \
            (args.evals > 0 and progress() >= counters["next_eval"] / args.evals)
        if due_eval and progress() < 1.0:
            counters["next_eval"] = int(progress() * args.evals) + 1 if args.evals else 1
            if valid:
                record = {"type": "valid", "step": counters["step"], "tokens": counters["tokens"],
                          **evaluate(model, valid, device, bf16, info)}
                log.write(record)
                if info.is_main:
                    plot_curves(log.read(), os.path.join(work, "curve.png"), title=args.out)
        due_ckpt = (counters["step"] % args.ckpt_every_steps == 0) if args.ckpt_every_steps else \
            (counters["elapsed"] - last_ckpt >= args.ckpt_every_minutes * 60)
        if due_ckpt:
            last_ckpt = counters["elapsed"]
            if info.is_main:
                write_checkpoint(work, model, optimizer, tokenizer, order, counters)
            barrier(info)
    if bar is not None:
        bar.close()

    # --- the end: final validation, checkpoint, plot, summary
    summary = {"steps": counters["step"], "tokens": counters["tokens"], "elapsed_s": counters["elapsed"],
               "budget": budget.to_dict(), "bf16": bf16, "device": str(device), "world_size": info.world_size,
               "parameters": sum(p.numel() for p in model.parameters())}
    finished = progress() >= 1.0  # else stopped by --max-steps, to be resumed
    if valid:
        final = evaluate(model, valid, device, bf16, info)
        if finished:  # a paused run's is only printed: logged, it stayed in the resumed run's log as an extra
            log.write({"type": "valid", "step": counters["step"], "tokens": counters["tokens"], **final})
        summary["valid"] = final
    # where the run is: --out, or until its budget is spent a replacing run's OUT.unfinished
    summary["out"] = args.out if finished else work
    if info.is_main:
        write_checkpoint(work, model, optimizer, tokenizer, order, counters)
        plot_curves(log.read(), os.path.join(work, "curve.png"), title=args.out)
        from twotower.common.atomic import atomic_write_text

        atomic_write_text(os.path.join(work, "summary.json"), json.dumps(summary, indent=2) + "\n")
    if finished:
        finish_out_dir(args, work, info)
    if args.dump_replicas:
        from safetensors.torch import save_file

        os.makedirs(args.dump_replicas, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                  os.path.join(args.dump_replicas, f"rank{info.rank}.safetensors"),
                  metadata={"first_rows": json.dumps(first_rows)})
    barrier(info)
    return summary

