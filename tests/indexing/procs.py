"""Real writer processes for the concurrency tests: a child that commits batches until told to stop."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

WRITER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {repo!r})
    import faiss, numpy as np
    faiss.omp_set_num_threads(1)
    import twotower.indexing.store as st
    from twotower.indexing import IndexStore

    directory, stop, dim, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    pause, retain = float(sys.argv[5]), sys.argv[6]
    if retain != "default":
        st.RETAIN_SECONDS = float(retain)  # how long merged-away files stay for readers still opening them
    rng = np.random.default_rng(1)
    store = IndexStore.open(directory)
    n, commits = 0, 0
    while not os.path.exists(stop):
        ids = [f"w{{n + j}}" for j in range(batch)]
        store.add([{{"id": i, "title": "", "text": "written " + i}} for i in ids],
                  rng.normal(size=(batch, dim)).astype("float32"))
        if n >= 2 * batch:  # also delete: the oldest written batch but one
            store.delete([f"w{{n - 2 * batch + j}}" for j in range(0, batch, 2)])
        store.commit()
        n += batch
        commits += 1
        time.sleep(pause)
    store.close()
    print(commits, n)
    """
)


def start_writer(tmp_path: Path, directory: Path, dim: int, batch: int = 20, pause: float = 0.0,
                 retain: float | None = None) -> tuple[subprocess.Popen, Path]:
    """Start a child that commits `batch` documents at a time to `directory` until `stop` exists.

    `pause`: seconds between commits; `retain`: the writer's ``RETAIN_SECONDS`` (None: the default).
    """
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(repo=str(REPO)))
    stop = tmp_path / "stop"
    proc = subprocess.Popen([sys.executable, str(script), str(directory), str(stop), str(dim), str(batch), str(pause),
                             "default" if retain is None else str(retain)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, stop


def stop_writer(proc: subprocess.Popen, stop: Path) -> tuple[int, int]:
    """Ask the writer to stop; returns (commits, documents written). Fails the test if the writer failed."""
    stop.touch()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, f"writer failed:\n{err}"
    commits, n = (int(x) for x in out.split())
    return commits, n


def run_with_refresher(store, search_loops: list, done: threading.Event, errors: list[str],
                       seconds: float = 3.0, pause: float = 0.01) -> int:
    """Run `search_loops` (callables that stop when `done` is set) and one thread calling
    ``store.refresh()`` for `seconds`; returns how many refreshes ran. Errors go to `errors`."""
    count = [0]

    def refresh_loop() -> None:
        while not done.is_set():
            try:
                store.refresh()
                count[0] += 1
            except Exception as e:  # noqa: BLE001 - reported by the caller
                errors.append(repr(e))
                return
            time.sleep(pause)

    run_threads([*search_loops, refresh_loop], until=lambda: (time.sleep(seconds), done.set()))
    return count[0]


def run_threads(targets: list, until=None) -> None:
    """Start one real thread per callable, call `until()` (if given), then join them all."""
    threads = [threading.Thread(target=f) for f in targets]
    for t in threads:
        t.start()
    if until is not None:
        until()
    for t in threads:
        t.join(60)


def kill_at_flag(proc: subprocess.Popen, flag: Path, stage: str, timeout: float = 60, poll: float = 0.02) -> None:
    """SIGKILL `proc` once it has written `stage` into `flag` (a child's crash point), then reap it.

    Fails the test if the child exits first or never gets there within `timeout` seconds.
    """
    import os
    import signal

    import pytest

    try:
        deadline = time.monotonic() + timeout
        while not flag.exists():
            if proc.poll() is not None:
                pytest.fail(f"child exited early with code {proc.returncode}")
            if time.monotonic() > deadline:
                pytest.fail("child never reached the crash point")
            time.sleep(poll)
        assert flag.read_text() == stage
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
