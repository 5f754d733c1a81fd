#!/usr/bin/env bash
# One command on a fresh machine: install, lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check streamrl tests bench
exec .venv/bin/python -m pytest -q "$@"
