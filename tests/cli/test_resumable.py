"""`resumable`: SIGTERM stops a training as Ctrl-C does, once; the exit status is the signal's; a command run from
a worker thread leaves signals alone."""

from __future__ import annotations

import argparse
import os
import signal
import threading

import pytest

from twotower.cli import main, resumable


class _Own(Exception):
    """What the test's own SIGTERM handler raises: a SIGTERM `resumable` let through reaches it."""


@pytest.fixture()
def own_handler():
    def own(signum, frame):
        raise _Own

    before = signal.signal(signal.SIGTERM, own)
    yield own
    signal.signal(signal.SIGTERM, before)


def _resumable(train) -> object:
    return resumable(argparse.Namespace(), train, lambda: None, lambda: False)


def test_a_second_sigterm_kills_as_before(own_handler):
    """The handler stayed for the whole stop: a second SIGTERM (a supervisor's, a stop taking too long) raised
    Ctrl-C again inside the stop instead of what the process does on SIGTERM."""
    seen = []

    def train():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except KeyboardInterrupt:
            seen.append(signal.getsignal(signal.SIGTERM))
            os.kill(os.getpid(), signal.SIGTERM)  # the second: the process's own handler
        raise AssertionError("the second SIGTERM was not delivered")

    try:
        _resumable(train)
    except _Own:
        pass
    except KeyboardInterrupt:  # not pytest's own Ctrl-C: this test sent it
        pytest.fail("the second SIGTERM stopped the command as Ctrl-C again")
    assert seen == [own_handler] and signal.getsignal(signal.SIGTERM) is own_handler


def test_sigterm_exits_with_its_own_status_not_ctrl_cs(own_handler, monkeypatch, capsys):
    """SIGTERM exited 130, Ctrl-C's status; a supervisor that sent SIGTERM expects 143 (128 + 15)."""
    from twotower.cli import train_cmd

    def run(args):
        def train():
            os.kill(os.getpid(), signal.SIGTERM)
        return resumable(args, train, lambda: "step 4", lambda: False)

    def ctrl_c(args):
        raise KeyboardInterrupt

    argv = ["train", "dual", "--model", "m", "--data", "d", "--out", "o"]
    monkeypatch.setattr(train_cmd, "run_dual", run)
    assert main(argv) == 143
    assert "interrupted: the run's state after step 4 is saved" in capsys.readouterr().err
    monkeypatch.setattr(train_cmd, "run_dual", ctrl_c)
    assert main(argv) == 130


def test_a_command_run_from_a_worker_thread_leaves_signals_alone():
    """Only the main thread may set a signal handler: `main([...train...])` from a worker thread failed with
    "signal only works in main thread"."""
    results: list[object] = []
    worker = threading.Thread(target=lambda: results.append(_resumable(lambda: "trained")))
    worker.start()
    worker.join()
    assert results == ["trained"]
