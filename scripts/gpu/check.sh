#!/usr/bin/env bash
# The GPU check (issue #33), one command on a lent GPU machine, results into $OUT:
#   bash scripts/gpu/check.sh [--budget S] ...        # on the device, .gpu-kit carried
#   bash scripts/gpu/check.sh --cpu --out DIR [...]   # the CPU rehearsal here (the venv's Horovod)
# Build the kit first here (scripts/gpu/kit.sh). The steps: bench/gpu_check.py; how to run it on
# the device and what it writes: docs/testing.md ("The GPU check").
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
cpu=0
for a in "$@"; do [ "$a" = --cpu ] && cpu=1; done
if [ "$cpu" = 1 ]; then
  py=${HVA_VENV:-$root/.venv}/bin/python
  [ -x "$py" ] || { echo "check: ERROR: no $py: run scripts/setup.sh first" >&2; exit 1; }
else
  py=${PYTHON:-python3}  # the device's python3 is the one that holds torch
fi
out=()
case " $* " in *" --out "*) ;; *) out=(--out "${OUT:?check: set OUT or pass --out DIR}") ;; esac
export PYTHONUNBUFFERED=1
# The device's Python has torch but not this project: it imports horovod_airflow.* (this
# process and every rank it starts) from a view of the checkout's folders. The --cpu rehearsal
# does the same (PYTHONPATH comes before the venv's editable install), so it rehearses that too.
view=$(mktemp -d "${TMPDIR:-/tmp}/hva-view.XXXXXX")
bash "$root/scripts/package_view.sh" "$view"
export PYTHONPATH="$view${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m bench.gpu_check "${out[@]}" "$@"
