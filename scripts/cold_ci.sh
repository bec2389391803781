#!/usr/bin/env bash
# CI as a new machine runs it, before you stop: a fresh clone of the committed HEAD, then
# `CI=true bash .ci/run` in it and the README's main job (`scripts/run_pipeline.sh`) after it,
# each timed, with every cache pointed at new folders where asked.
#
#   scripts/cold_ci.sh --cold                   # empty caches: what a new machine's first CI does
#   scripts/cold_ci.sh --caches DIR             # caches in DIR (new: cold; reused: warm)
#   scripts/cold_ci.sh --order shuffle[:SEED]   # test files and tests in a shuffled order
#   scripts/cold_ci.sh                          # this machine's own caches: what CI does here
#
# "Caches" are everything a first run builds outside the clone: the Horovod wheel
# (HOROVOD_WHEEL_CACHE), pip's downloads (PIP_CACHE_DIR), podman's image store
# (CONTAINERS_STORAGE_CONF: its own graphroot and runroot) and the engine scripts' state
# folders (HVA_PODMAN_STATE: a podman API service of its own; HVA_STACK_STATE). Debian
# packages installed on the machine stay installed: a machine without them installs them in
# scripts/prebuild.sh (the "packages" step). The user's own image store, wheel cache and
# podman service are not touched.
#
# Options: --keep keeps the clone and --cold's caches; --workdir DIR puts both under DIR
# (default: a new folder under /var/tmp); --no-main-job runs .ci/run alone. Prints the log's
# path, the total time, each step's time and pytest's summary; exits non-zero when .ci/run or
# the main job failed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
caches="" cold=0 order=default keep=0 workdir="" main_job=1
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --cold) cold=1 ;;
    --caches) caches=${2:?--caches needs a folder}; shift ;;
    --order) order=${2:?--order needs default or shuffle[:SEED]}; shift ;;
    --keep) keep=1 ;;
    --no-main-job) main_job=0 ;;
    --workdir) workdir=${2:?--workdir needs a folder}; shift ;;
    -h | --help) usage 0 ;;
    *) echo "cold_ci: ERROR: unknown option '$1' (allowed: --cold, --caches DIR, --order default|shuffle[:SEED], --keep, --workdir DIR, --no-main-job)" >&2; exit 2 ;;
  esac
  shift
done
[ "$cold" = 1 ] && [ -n "$caches" ] && { echo "cold_ci: ERROR: --cold and --caches DIR exclude each other (--cold is --caches <a new folder>)" >&2; exit 2; }
case "$order" in
  default) addopts="" ;;
  shuffle) addopts="-p random_order --random-order-bucket=module --random-order-seed=$RANDOM" ;;
  shuffle:*) seed=${order#shuffle:}
    [[ "$seed" =~ ^[0-9]+$ ]] || { echo "cold_ci: ERROR: --order shuffle:SEED needs a number, got '$seed'" >&2; exit 2; }
    addopts="-p random_order --random-order-bucket=module --random-order-seed=$seed" ;;
  *) echo "cold_ci: ERROR: --order must be default, shuffle or shuffle:SEED, got '$order'" >&2; exit 2 ;;
esac

work=${workdir:-$(mktemp -d /var/tmp/hva-ci.XXXXXX)}
mkdir -p "$work"
repo="$work/repo"
[ -e "$repo" ] && { echo "cold_ci: ERROR: $repo exists; give another --workdir" >&2; exit 2; }
git clone -q "$root" "$repo"
echo "cold_ci: clone of $(git -C "$repo" rev-parse --short HEAD) in $repo" >&2

env_args=(CI=true)
[ -n "$addopts" ] && env_args+=("PYTEST_ADDOPTS=$addopts")
if [ "$cold" = 1 ]; then caches="$work/caches"; fi
if [ -n "$caches" ]; then
  [ -d "$caches" ] && [ -n "$(ls -A "$caches" 2>/dev/null)" ] && state="warm" || state="cold (empty)"
  mkdir -p "$caches"
  caches=$(cd "$caches" && pwd)
  cat >"$caches/storage.conf" <<CONF
[storage]
driver = "overlay"
graphroot = "$caches/podman-storage"
runroot = "$caches/podman-run"
CONF
  env_args+=(
    "HOROVOD_WHEEL_CACHE=$caches/horovod-wheels" "PIP_CACHE_DIR=$caches/pip"
    "CONTAINERS_STORAGE_CONF=$caches/storage.conf" "HVA_PODMAN_STATE=$caches/podman-state"
    "HVA_STACK_STATE=$caches/stack"
  )
  echo "cold_ci: caches in $caches, $state" >&2
else
  echo "cold_ci: this machine's own caches" >&2
fi
[ -n "$addopts" ] && echo "cold_ci: PYTEST_ADDOPTS=$addopts" >&2

log="$work/ci.log"
start=$(date +%s)
set +e
(cd "$repo" && env "${env_args[@]}" bash .ci/run </dev/null) 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
took=$(( $(date +%s) - start ))
main_rc=0 main_took=0
if [ "$main_job" = 1 ]; then  # the README's other command, as written, in the same clone
  start=$(date +%s)
  set +e
  (cd "$repo" && env "${env_args[@]}" scripts/run_pipeline.sh </dev/null) 2>&1 | tee "$work/main-job.log"
  main_rc=${PIPESTATUS[0]}
  set -e
  main_took=$(( $(date +%s) - start ))
fi

{
  echo "cold_ci: .ci/run exited $rc after $((took / 60)) min $((took % 60)) s"
  if [ "$main_job" = 1 ]; then
    echo "cold_ci: scripts/run_pipeline.sh exited $main_rc after $((main_took / 60)) min $((main_took % 60)) s"
  fi
  grep -E '^test: (step times|prebuild steps)|compose_stack: built|^=+ .*(passed|failed|error).* =+$' "$log" || true
} >&2
if [ -n "$caches" ]; then  # the podman API service of that state folder ends with the run
  env "${env_args[@]}" bash "$root/scripts/engines/podman_engine.sh" stop >/dev/null 2>&1 || true
fi
if [ "$cold" = 1 ] && [ "$keep" = 0 ]; then
  if command -v podman >/dev/null; then
    CONTAINERS_STORAGE_CONF="$caches/storage.conf" podman rm -af -t 0 >/dev/null 2>&1 || true
    CONTAINERS_STORAGE_CONF="$caches/storage.conf" podman rmi -af >/dev/null 2>&1 || true
  fi
  cp "$log" "$work.log"
  [ -f "$work/main-job.log" ] && cp "$work/main-job.log" "$work.main-job.log"
  rm -rf "$work"
  log="$work.log"
  echo "cold_ci: removed $work (--keep keeps it)" >&2
fi
echo "cold_ci: log $log" >&2
[ "$rc" = 0 ] || exit "$rc"
exit "$main_rc"
