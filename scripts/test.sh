#!/usr/bin/env bash
# The README's test command: sets everything up, then lint, types, tests.
#   scripts/test.sh [pytest args...]
#
# 1. scripts/setup.sh      the Python environment and Horovod (cached wheel)
# 2. scripts/prebuild.sh   packages, podman's Docker API and every image the tests run, before
#                          any test starts (HVA_PREBUILD=0 skips it: unit tests on a laptop)
# 3. ruff, mypy, pytest    pytest prints its 30 slowest tests
# Each step's time is printed at the end (CI's budget: 90 min; a cold machine ~60 min).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=${HVA_VENV:-$root/.venv}
timings=()
timed() { # NAME COMMAND...
  local name=$1 start=$SECONDS
  shift
  echo "== $name" >&2
  "$@"
  timings+=("$name $((SECONDS - start))s")
}
report() {
  local rc=$?
  [ ${#timings[@]} -eq 0 ] || echo "test: step times: ${timings[*]}" >&2
  [ -f "$root/.runs/prebuild-times.txt" ] &&
    echo "test: prebuild steps: $(tr '\n' ' ' <"$root/.runs/prebuild-times.txt")" >&2
  # The podman API service prebuild started for this run stops with it (one the user had
  # running before is left alone).
  if [ "${was_serving:-1}" = 0 ]; then bash scripts/engines/podman_engine.sh stop >/dev/null 2>&1 || true; fi
  exit "$rc"
}
trap report EXIT

timed setup bash scripts/setup.sh
export PATH="$venv/bin:$PATH"
if [ "${HVA_PREBUILD:-1}" != 0 ]; then
  was_serving=1
  [ "$(id -u)" = 0 ] && ! bash scripts/engines/podman_engine.sh status >/dev/null 2>&1 && was_serving=0
  timed prebuild bash scripts/prebuild.sh
fi
timed ruff sh -c 'ruff format --check . && ruff check .'
timed mypy bash scripts/mypy.sh
echo "== pytest" >&2
start=$SECONDS
set +e
python -m pytest --durations=30 "$@"
rc=$?
set -e
timings+=("pytest $((SECONDS - start))s")
if [ "$rc" -eq 5 ]; then echo "test: ERROR: pytest collected no tests" >&2; exit 1; fi
exit "$rc"
