#!/usr/bin/env bash
# One command on a fresh machine: install, lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_vllm.sh   # the real vLLM server, for tests/test_vllm*.py
bash scripts/setup_verifiers.sh   # the verifiers package, for tests/test_verifiers_env.py
# Triton, for the GPU runner's kernel tests, which run under its interpreter without a GPU: beside
# .venv, not in it (torch imports Triton wherever it can, and Triton's bindings then print leak
# warnings at the exit of every process, the CLI's included).
[ -d .venv-triton/triton ] || .venv/bin/pip install --quiet --no-deps --target .venv-triton "triton>=3.2,<4"
.venv/bin/ruff check streamrl tests bench
exec .venv/bin/python -m pytest -q "$@"
