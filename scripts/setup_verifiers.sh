#!/usr/bin/env bash
# Installs the `verifiers` package (0.4.0 from PyPI) into its own environment, .venv-verifiers (idempotent: a
# no-op when already installed), for `rollout.environment: verifiers` (docs/environments.md). Beside .venv,
# not in it: verifiers pins openai<3 and mcp==2.0.0, while the project's openai-agents needs openai>=3
# (pip: ResolutionImpossible). No torch; ~600 MB, about 2 min here. scripts/test.sh runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VERIFIERS_VERSION="0.4.0"
stamp=".venv-verifiers/.streamrl-verifiers-${VERIFIERS_VERSION}"
[ -f "$stamp" ] && exit 0
[ -x .venv-verifiers/bin/python ] || "$PY" -m venv .venv-verifiers
.venv-verifiers/bin/pip install --quiet "verifiers==${VERIFIERS_VERSION}"
if ! .venv-verifiers/bin/python -c "import verifiers.v1" >/dev/null 2>.venv-verifiers/import-check.log; then
  echo "setup_verifiers: verifiers was installed but does not import; see .venv-verifiers/import-check.log" >&2
  exit 1
fi
touch "$stamp"
echo "setup_verifiers: verifiers ${VERIFIERS_VERSION} is in .venv-verifiers"
