from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from twotower.common.file_lock import lock_note, try_lock


def test_second_holder_is_refused_until_the_first_closes(tmp_path):
    path = tmp_path / "LOCK"
    fd = try_lock(path)
    assert fd is not None and path.exists()
    assert try_lock(path) is None  # flock is per open file: a second open in this process is refused too
    os.pwrite(fd, b"1234\n", 0)
    assert lock_note(path) == "1234"
    os.close(fd)
    again = try_lock(path)
    assert again is not None
    os.close(again)


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    path = tmp_path / "LOCK"
    code = ("import sys, time; from twotower.common.file_lock import try_lock; "
            "fd = try_lock(sys.argv[1]); print('locked' if fd is not None else 'refused', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        assert try_lock(path) is None
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 5
    fd = try_lock(path)
    while fd is None and time.monotonic() < deadline:
        time.sleep(0.05)
        fd = try_lock(path)
    assert fd is not None
    os.close(fd)


def test_missing_directory_and_unreadable_note(tmp_path):
    with pytest.raises(FileNotFoundError):
        try_lock(tmp_path / "gone" / "LOCK")
    assert lock_note(tmp_path / "nothing-here") == ""
