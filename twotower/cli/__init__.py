"""The twotower command line: one entry point, one module per command group.

Each command module exposes ``register(subparsers)``; it adds its sub-command
and sets ``func`` on the parser defaults.  Heavy imports (torch, faiss) happen
inside the command functions so that ``twotower --help`` stays fast and a
command's bad input is reported before anything large loads.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import io
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

# Order is the order of `twotower --help`.
_COMMAND_MODULES = [
    "tokenizer_cmd",
    "pretrain_cmd",
    "embed_cmd",
    "train_cmd",
    "finetune_cmd",
    "index_cmd",
    "search_cmd",
    "answer_cmd",
    "eval_cmd",
    "serve_cmd",
]


# The commands that spread their work over torchrun's processes (each sets `torchrun=True` in its defaults);
# any other command under torchrun is refused.
TORCHRUN_COMMANDS = ("index build", "train dual", "train reranker", "pretrain")


class CLIError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


class Terminated(KeyboardInterrupt):
    """A signal (SIGTERM) that stops a command as Ctrl-C does (`resumable`); `main` exits with its status,
    128 + `signum` (143 for SIGTERM), as a supervisor expects of a process it stopped, not Ctrl-C's 130."""

    def __init__(self, signum: int) -> None:
        super().__init__()
        self.signum = signum


# When `twotower train` and `finetune` first save the state --resume continues from.
FIRST_SAVE = "at the first dev evaluation after a step, or after --save-every steps"


def resumable(args: argparse.Namespace, train: Callable[[], Any], saved_at: Callable[[], str | None],
              holds_run: Callable[[], bool], first_save: str = FIRST_SAVE) -> Any:
    """`train()` of a command with ``--resume``; on Ctrl-C or SIGTERM the line `main` prints (``interrupted``) says what
    ``--resume`` would continue from: `saved_at()` ("step 150"; None: no state saved yet, which the command
    first saves `first_save`), else how to start over (with ``--overwrite`` where `holds_run()`: ``--out``
    holds a run)."""
    import signal
    import threading

    # SIGTERM (SLURM's scancel, `kill`; torchrun passes it on to every rank) ends the run as Ctrl-C does: it
    # killed the process where it stood, with no word of what --resume would continue from. Python lets only
    # the main thread set a handler (`main` called from a worker thread failed "signal only works in main
    # thread"); there SIGTERM stays as it was.
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main_thread else None
    restore = before if before is not None else signal.SIG_DFL  # (None: a handler Python did not install)

    def terminated(signum: int, frame: Any) -> None:
        """Once: a second SIGTERM (a stop that is taking too long) kills as before."""
        signal.signal(signal.SIGTERM, restore)
        raise Terminated(signum)

    if main_thread:
        signal.signal(signal.SIGTERM, terminated)
    try:
        return train()
    except KeyboardInterrupt:
        where = saved_at()
        again = " with --overwrite" if where is None and holds_run() else ""
        args.interrupted = (f"the run's state after {where} is saved; run the same command with --resume to "
                            "continue from there" if where is not None else
                            f"no state was saved yet (the first is saved {first_save}): run the command "
                            f"again{again} to start over")
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, restore)


def build_parser() -> argparse.ArgumentParser:
    from twotower import __version__

    parser = argparse.ArgumentParser(prog="twotower", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"twotower {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(f"twotower.cli.{name}").register(sub)
    return parser


# "--passage-window (passage_window)", "--passages (passages=True)": a flag, then the library's keyword for it
_KEYWORD_AFTER_FLAG = re.compile(r"(--[a-z][a-z0-9-]*) \(([a-z_]+(?:=[A-Za-z0-9_]+)?)\)")


def _flag_alone(match: re.Match) -> str:
    """The flag of a `_KEYWORD_AFTER_FLAG` match without its annotation, when the annotation is that flag's own
    keyword; anything else (a user's file name, "nope--x (y).tsv") as it was."""
    flag, keyword = match.group(1), match.group(2)
    return flag if keyword.split("=")[0] == flag[2:].replace("-", "_") else match.group(0)


def flags_only(message: str) -> str:
    """A library message as the command line says it: the flag alone, without the Python keyword beside it.

    Why: the library names a setting by its flag and its keyword, for both kinds of user; on the command line
    "--passage-window (passage_window)" quoted a name the user never typed. Only the flag's own keyword goes:
    every message passes through here, and a path such as "nope--x (y).tsv" was printed as "nope--x.tsv".

    Example:
        >>> flags_only("build with --passages (passages=True) to split them")
        'build with --passages to split them'
        >>> flags_only("--qrels nope--x (y).tsv: file not found")
        '--qrels nope--x (y).tsv: file not found'
    """
    return _KEYWORD_AFTER_FLAG.sub(_flag_alone, message)


class _FlagsOnlyFormatter(logging.Formatter):
    """The command's log lines (warnings of the library) with `flags_only`."""

    def format(self, record: logging.LogRecord) -> str:
        return flags_only(super().format(record))


def _prog(args: argparse.Namespace) -> str:
    """The command as typed, its action included (``twotower index add``), as argparse names it in usage errors."""
    action = getattr(args, f"{args.command}_command", None)  # index_command, train_command, tokenizer_command
    return " ".join(["twotower", args.command] + ([action] if action else []))


def main(argv: list[str] | None = None) -> int:
    from twotower.common.distributed import PeerStopped, launched_as, met_by_this_rank_only

    launch = launched_as()
    say = launch.is_main  # under torchrun rank 0 speaks: every rank runs the same checks on the same input
    parser = build_parser()
    if say:
        args = parser.parse_args(argv)
    else:  # a bad flag's usage error (and --help) once, from rank 0; the exit status is every rank's
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = parser.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(_FlagsOnlyFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, handlers=[handler])
    if not getattr(args, "func", None):
        if say:
            parser.print_help()
        return 2

    def error(message: str, exc: BaseException | None = None) -> None:
        """Rank 0 says it; an error only some rank met (`this_rank_only`) is said by that rank, naming it."""
        alone = exc is not None and launch.enabled and met_by_this_rank_only(exc)
        if say or alone:
            where = f"rank {launch.rank}: " if alone else ""
            print(f"{_prog(args)}: error: {where}{flags_only(message)}", file=sys.stderr)

    if launch.enabled and not getattr(args, "torchrun", False):
        # every rank would run the whole command: duplicated work, and writers racing on the same --out
        error(f"runs in one process; run it without torchrun ({', '.join(TORCHRUN_COMMANDS)} spread their work "
              "over torchrun's processes)")
        return 2
    try:
        if getattr(args, "device", None) is not None:  # every command's --device, one check
            from twotower.cli.checks import device_option

            device_option(args.device)
        rc = args.func(args)
        sys.stdout.flush()  # a reader that went away (`| head`) is found here, not in the interpreter's exit
    except BrokenPipeError:
        # `twotower index info | head -4`: the reader closed the pipe; nothing of ours failed, so no traceback.
        # What is still buffered goes nowhere (Python's recipe), and the status is a SIGPIPE death's.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (CLIError, FileNotFoundError, ValueError) as exc:
        error(str(exc), exc)
        return 2
    except PeerStopped:
        return 1  # rank 0 said why
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        # a full disk is the user's to fix, not a bug: the stores raise it with the directory named; it may be
        # one rank's alone (its shards), so every rank says it
        print(f"{_prog(args)}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        # Ctrl-C (and SIGTERM while training, `resumable`) is the user's, not a bug: one line (it was a traceback from inside torch), saying what is kept
        # when the command says (`set_defaults(interrupted=...)`, formatted with the arguments)
        kept = getattr(args, "interrupted", None)
        if say:
            print(f"\n{_prog(args)}: interrupted{': ' + kept.format(**vars(args)) if kept else ''}", file=sys.stderr)
        return 128 + (exc.signum if isinstance(exc, Terminated) else 2)  # the signal's status: 130 Ctrl-C, 143 SIGTERM
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
