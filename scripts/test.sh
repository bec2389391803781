#!/usr/bin/env bash
# The README's test command: sets everything up (scripts/setup.sh), then lint, types, tests.
#   scripts/test.sh [pytest args...]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup.sh
venv=${HVA_VENV:-$root/.venv}
export PATH="$venv/bin:$PATH"
echo "== ruff" >&2
ruff format --check .
ruff check .
echo "== mypy" >&2
mypy
echo "== pytest" >&2
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "test: ERROR: pytest collected no tests" >&2; exit 1; fi
exit "$rc"
