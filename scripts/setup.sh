#!/usr/bin/env bash
# Installs streamrl and everything it needs into .venv (idempotent; a no-op when up to date).
# On a CPU machine the pinned torch==2.13.0 CPU wheel goes in first, so no multi-GB CUDA build is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.streamrl-installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      .venv/bin/pip install --quiet "torch>=2.6,<2.15"
    else
      .venv/bin/pip install --quiet torch==2.13.0
    fi
  fi
  .venv/bin/pip install --quiet -e ".[dev,agents,envs]"
  rm -f .venv/.streamrl-installed-*
  touch "$stamp"
fi
# The embedded engine's CPU decode-attention kernel: compiled once per machine (~30 s), cached by torch.
# Built here so the first engine start (and the first test) does not pay for it. A machine that cannot
# build it still works: the engine logs a warning and uses PyTorch SDPA.
.venv/bin/python -c "from streamrl.engine.kernels import decode_attention; decode_attention()"
