#!/usr/bin/env bash
# Create .venv and install twotower with its test extras. Idempotent: a stamp
# keyed on pyproject.toml skips the install when nothing changed.
# On machines without CUDA, torch is pinned to the local CPU build (2.13.0) so
# that pip does not pull a multi-GB CUDA wheel; pyproject keeps a normal range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.twotower-installed
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pip_=(.venv/bin/python -m pip install -q)
if ! command -v nvidia-smi >/dev/null 2>&1; then
  "${pip_[@]}" "torch==2.13.0" || "${pip_[@]}" "torch>=2.2" --index-url https://download.pytorch.org/whl/cpu
fi
"${pip_[@]}" -e ".[test]"
echo "$want" > "$stamp"
