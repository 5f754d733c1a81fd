#!/usr/bin/env bash
# One command on a fresh machine: install, lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_vllm.sh   # the real vLLM server, for tests/test_vllm*.py
.venv/bin/ruff check streamrl tests bench
exec .venv/bin/python -m pytest -q "$@"
