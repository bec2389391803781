#!/usr/bin/env bash
# Everything the tests run that is not Python: built or installed before any test starts, so
# that no test waits on a build (a cold trainer image takes ~18 min on 2 cores, longer than a
# test's timeout) and no test depends on another having run first.
#
#   scripts/prebuild.sh        # scripts/test.sh runs it after scripts/setup.sh
#
# Steps, each idempotent and each timed (a warm machine: seconds in all):
#   packages       Debian packages of the engines and browser tests, one apt-get for all
#   engine         podman's Docker API (scripts/engines/podman_engine.sh start)
#   runtime-image  the docker launcher tests' image (podman_engine.sh image)
#   stack-images   the compose stack's stand-ins, Airflow and trainer images
#                  (scripts/engines/compose_stack.sh images; cached by a hash of their inputs)
# The test fixtures run the same commands (tests/engine_scripts.py), so pytest alone still
# works, only slower on a cold machine.
#
# Needs root. Where this machine cannot run the engines (not root, a package not installable:
# a script exits 2) it says so and exits 0: the tests that need them then fail in CI naming
# what is missing, and skip elsewhere. Any other failure fails. Times go to stderr and to
# $HVA_PREBUILD_TIMES (default .runs/prebuild-times.txt).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
times=${HVA_PREBUILD_TIMES:-$root/.runs/prebuild-times.txt}
mkdir -p "$(dirname "$times")"
: >"$times"
export PATH="${HVA_VENV:-$root/.venv}/bin:$PATH"

log() { echo "prebuild: $*" >&2; }

# Debian packages : a file each provides (installed when any is missing).
packages=(
  podman:/usr/bin/podman runc:/usr/sbin/runc debootstrap:/usr/sbin/debootstrap
  slirp4netns:/usr/bin/slirp4netns fuse-overlayfs:/usr/bin/fuse-overlayfs uidmap:/usr/bin/newuidmap
  openssh-server:/usr/sbin/sshd openssh-client:/usr/bin/ssh iproute2:/usr/sbin/ip
  chromium:/usr/bin/chromium chromium-driver:/usr/bin/chromedriver
  docker-registry:/usr/bin/docker-registry
)

step() { # NAME COMMAND...: run, time, record; exit 2 of the command = unavailable here
  local name=$1 start=$SECONDS rc=0
  shift
  log "$name ..."
  "$@" || rc=$?
  local took=$((SECONDS - start))
  case $rc in
    0) log "$name: ${took}s"; echo "$name ${took}" >>"$times" ;;
    2) log "$name: UNAVAILABLE on this machine (${took}s); the tests that need it will say so"
       echo "$name unavailable" >>"$times"; return 2 ;;
    *) log "$name: FAILED (exit $rc, ${took}s)"; exit "$rc" ;;
  esac
}

install_packages() {
  local want=() pair
  for pair in "${packages[@]}"; do [ -e "${pair#*:}" ] || want+=("${pair%%:*}"); done
  [ ${#want[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || { log "missing ${want[*]} and no apt-get"; return 2; }
  log "apt-get install ${want[*]}"
  local apt_log="$root/.runs/prebuild-apt.log"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q "${want[@]}" >"$apt_log" 2>&1; then
    apt-get update -q >>"$apt_log" 2>&1 || true
    apt-get install -y -q "${want[@]}" >>"$apt_log" 2>&1 || { tail -20 "$apt_log" >&2; return 2; }
  fi
}

if [ "$(id -u)" != 0 ]; then
  log "not root (uid $(id -u)): no engine, images or simulated hosts here; the tests that need them will say so"
  echo "all unavailable" >>"$times"
  exit 0
fi
step packages install_packages || exit 0
step engine scripts/engines/podman_engine.sh start || exit 0
step runtime-image scripts/engines/podman_engine.sh image || exit 0
step stack-images scripts/engines/compose_stack.sh images || exit 0
log "done: $(tr '\n' ' ' <"$times")"
