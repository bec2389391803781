#!/usr/bin/env bash
# Build .gpu-kit/ (git-ignored): the Horovod sdist and the cp312 wheels the GPU device lacks,
# then print the size of the tree the device tool copies and fail over its 64 MiB.
#   scripts/gpu/kit.sh [--dest DIR] [--limit-mib N]
# What it holds and why: scripts/gpu/kit.py; how the check uses it: docs/testing.md.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
py=${HVA_VENV:-$root/.venv}/bin/python
[ -x "$py" ] || { echo "kit: ERROR: no $py: run scripts/setup.sh first (the kit reads the trainer's dependencies from it)" >&2; exit 1; }
exec "$py" "$root/scripts/gpu/kit.py" "$@"
