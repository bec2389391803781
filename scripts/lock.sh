#!/usr/bin/env bash
# Re-resolve requirements/base.in into requirements/lock.txt in a throw-away environment.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"${PYTHON:-python3.11}" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q pip==26.3
"$tmp/venv/bin/pip" install -q -r "$root/requirements/base.in"
{
  echo "# Resolved from requirements/base.in with pip on CPython 3.11 / x86_64 (scripts/lock.sh)."
  echo "# Horovod is not here: scripts/build_horovod.sh builds it against the torch pinned below."
  "$tmp/venv/bin/pip" freeze | grep -v '^-e \|^horovod' | sort -f
} >"$root/requirements/lock.txt"
echo "lock: wrote requirements/lock.txt" >&2
