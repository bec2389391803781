#!/usr/bin/env bash
# The README's main-job command: set everything up (scripts/setup.sh), then run the whole
# retraining DAG once on embedded defaults (see scripts/run_pipeline.py --help).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup.sh"
venv=${HVA_VENV:-$root/.venv}
exec "$venv/bin/python" "$root/scripts/run_pipeline.py" "$@"
