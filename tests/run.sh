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
# pipecat's realtime event parser, for the strict-validator test; its full dependency set
# would downgrade soundfile/soxr and pull numba and onnxruntime, so only what the parser imports.
python -m pip install -q --no-deps "pipecat-ai==1.14.0" "loguru==0.7.3" "wait_for2==0.4.1" \
    "docstring_parser==0.18.0" "loudness==0.2.0" "sentencex==1.0.32" "pillow==13.0.0"
# LiveKit's PersonaPlex plugin (tests/test_demo_model.py; livekit-agents is in the test extra). Its
# package imports NVIDIA's Riva client, which pins websockets<16 and would downgrade the server's
# websockets 16, hence --no-deps (the Riva client's grpcio and protobuf come with livekit-agents).
python -m pip install -q --no-deps "livekit-plugins-nvidia==1.8.9" "nvidia-riva-client==2.28.0"
# LiveKit's GPT-Live plugin (tests/test_live_clients.py): a thin wrapper of livekit-agents' GPTLiveModel whose
# dependencies (livekit-agents, openai, httpx2) are already in; --no-deps keeps pip from re-resolving them.
python -m pip install -q --no-deps "livekit-plugins-openai==1.8.9"
# LiveKit's Kyutai STT plugin (tests/test_kyutai_doors.py): its dependencies (livekit-agents[codecs],
# msgpack, numpy) are already in; --no-deps keeps pip from re-resolving them.
python -m pip install -q --no-deps "livekit-plugins-kyutai-lasuite==0.0.6"
# HAProxy for the `parley launch` end-to-end tests (tests/test_launch.py): the distribution's package.
if ! command -v haproxy >/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null; } \
            || echo "haproxy could not be installed: the launch end-to-end test will skip"
    else
        echo "haproxy not installed and no root apt-get: the launch end-to-end test will skip"
    fi
fi
# The openai Node SDK test (tests/test_node_sdk.py) runs the SDK version tests/node/package-lock.json pins.
if command -v node >/dev/null && command -v npm >/dev/null; then
    (cd tests/node && npm ci --no-audit --no-fund --loglevel=error) \
        || echo "npm ci failed in tests/node: the Node SDK test will skip"
else
    echo "node/npm not installed: the Node SDK test (tests/test_node_sdk.py) will skip"
fi
if [ -f tests/web_setup.sh ]; then bash tests/web_setup.sh || echo "web_setup: chromium unavailable; browser tests will skip"; fi
exec python -m pytest -q "$@"
