#!/usr/bin/env bash
# Installs Parley and its test tools into .venv, then runs the whole test suite.
# Usage: bash tests/run.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch first: a bare `torch` requirement could pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e '.[test]'
# The reference implementation, as a test-only oracle. It pins an old torch, hence --no-deps.
python -m pip install -q --no-deps "moshi==0.2.13"
if [ -f tests/web_setup.sh ]; then bash tests/web_setup.sh || echo "web_setup: chromium unavailable; browser tests will skip"; fi
exec python -m pytest -q "$@"
