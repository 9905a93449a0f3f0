#!/usr/bin/env bash
# Create .venv and install twotower with its test extras. Idempotent: a stamp
# keyed on pyproject.toml skips the install when nothing changed (and then prints nothing).
# On machines without CUDA, torch is pinned to the local CPU build (2.13.0) so
# that pip does not pull a multi-GB CUDA wheel; pyproject keeps a normal range.
# Each step says what it does first: the first set-up takes minutes, mostly in pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step() { echo "setup: $*"; }
if [ ! -x .venv/bin/python ]; then
  step "creating .venv ($("$PY" --version 2>&1))"
  "$PY" -m venv .venv
fi
stamp=.venv/.twotower-installed
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# pip byte-compiles what it installs one file at a time (half the set-up); compileall below does it
# on every core instead.
pip_=(.venv/bin/python -m pip install -q --no-compile)
if ! command -v nvidia-smi >/dev/null 2>&1; then
  step "installing torch CPU build (no CUDA on this machine; a few minutes the first time)"
  "${pip_[@]}" "torch==2.13.0" || "${pip_[@]}" "torch>=2.2" --index-url https://download.pytorch.org/whl/cpu
fi
step "installing twotower (editable) + test extras (with pymilvus and milvus-lite for the Milvus backend)"
"${pip_[@]}" -e ".[test]"
step "compiling the installed Python files (all cores)"
# A file that does not compile (a package's own test data) is skipped, as pip skips it.
.venv/bin/python -m compileall -q -j 0 .venv/lib >/dev/null 2>&1 || true
echo "$want" > "$stamp"
step "done: .venv is ready"
