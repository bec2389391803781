#!/usr/bin/env bash
# Idempotent set-up used by both README commands (scripts/run_pipeline.sh and scripts/test.sh):
#   1. a virtual environment in .venv (ignored by git),
#   2. the pinned dependencies of requirements/lock.txt and test-extras.txt (skipped while
#      they are unchanged),
#   3. Horovod 0.28.1 built against the pinned torch (scripts/build_horovod.sh; the wheel is
#      cached outside the work tree, so the build runs once per machine),
#   4. this project, editable, and a `horovodrun --check-build` that must list PyTorch and Gloo.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=${HVA_VENV:-$root/.venv}
python=${PYTHON:-python3.11}
PIP_VERSION=26.3

command -v "$python" >/dev/null || { echo "setup: ERROR: $python not found (Python 3.11 is required; set PYTHON=...)" >&2; exit 1; }
if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv" >&2
  "$python" -m venv "$venv"
fi
py="$venv/bin/python"

stamp=$(cat requirements/lock.txt requirements/test-extras.txt pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$venv/.lock-stamp" 2>/dev/null)" != "$stamp" ]; then
  start=$(date +%s)
  echo "setup: installing requirements/lock.txt into $venv (a few minutes the first time)" >&2
  "$py" -m pip install -q "pip==$PIP_VERSION"
  "$py" -m pip install -q -r requirements/lock.txt
  "$py" -m pip install -q --no-deps -r requirements/test-extras.txt
  "$py" -m pip install -q --no-deps --no-build-isolation -e .
  echo "$stamp" >"$venv/.lock-stamp"
  echo "setup: dependencies installed in $(( $(date +%s) - start ))s" >&2
fi

bash "$root/scripts/build_horovod.sh" "$py"

check=$("$venv/bin/horovodrun" --check-build 2>&1) || { echo "$check" >&2; echo "setup: ERROR: horovodrun --check-build failed" >&2; exit 1; }
for want in "PyTorch" "Gloo"; do
  if ! grep -q "\[X\] $want" <<<"$check"; then
    echo "$check" >&2
    echo "setup: ERROR: horovodrun --check-build does not list $want as available" >&2
    exit 1
  fi
done
echo "setup: ready ($venv; horovod with PyTorch + Gloo)" >&2
