#!/usr/bin/env bash
# One command on a fresh machine: install, then train the quickstart (CPU, a few minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/streamrl run configs/quickstart.yaml "$@"
