#!/usr/bin/env bash
# A real container engine for the docker launcher, without Docker: podman's Docker-compatible
# API on a unix socket, plus a small runtime image built without any registry.
#
#   scripts/engines/podman_engine.sh start    # install podman if missing, serve the Docker API
#   scripts/engines/podman_engine.sh image    # build (once) the runtime image, print its name
#   scripts/engines/podman_engine.sh base     # import (once) the Debian minbase image, print its name
#   scripts/engines/podman_engine.sh env      # print the exports a Docker client needs
#   scripts/engines/podman_engine.sh status   # exit 0 when the API answers
#   scripts/engines/podman_engine.sh stop     # stop the API service this script started
#
# Then: eval "$(scripts/engines/podman_engine.sh env)" and use the docker CLI / docker SDK /
# HorovodTrainOperator(launcher="docker", image=<printed name>) as with Docker.
#
# The image is only the Debian bookworm userland plus the shared libraries Python, torch and
# Horovod load; the project's virtual environment, its base Python (a venv's python is a
# symlink into it) and the source are bind-mounted read-only at their host paths, so the image
# stays small and never goes stale when the code changes. The image is cached in podman's
# storage (/var/lib/containers) and rebuilt only when missing or when its recipe changes.
#
# Needs root (podman's rootful storage and network). Settings (environment):
#   HVA_PODMAN_STATE   state folder: containers.conf, socket, pid, log (/var/tmp/hva-podman)
#   HVA_APT_MIRROR     Debian mirror for debootstrap (default: first deb.debian.org-style
#                      mirror in /etc/apt/sources.list*, else http://deb.debian.org/debian)
#   HVA_PODMAN_IMAGE   runtime image repository name (localhost/hva-runtime)
#   HVA_INSECURE_REGISTRIES  comma-separated host:port registries served over plain HTTP that
#                      the engine may pull from (127.0.0.1:5055: the tests' local registry)
set -euo pipefail

state=${HVA_PODMAN_STATE:-/var/tmp/hva-podman}
HVA_INSECURE_REGISTRIES=${HVA_INSECURE_REGISTRIES:-127.0.0.1:5055}
sock="$state/podman.sock"
pidfile="$state/service.pid"
conf="$state/containers.conf"
registries_conf="$state/registries.conf"
base_image=localhost/hva-bookworm:minbase
runtime_repo=${HVA_PODMAN_IMAGE:-localhost/hva-runtime}

log() { echo "podman_engine: $*" >&2; }
die() { echo "podman_engine: ERROR: $*" >&2; exit 1; }

# The state folder holds the API socket and the engine's settings: in a world-writable place
# (/var/tmp, /tmp) it must be our own, else another user who made it first could swap them.
if [ -e "$state" ] && [ "$(stat -c %u "$state")" != "$(id -u)" ]; then
  case "$(cd "$(dirname "$state")" && pwd)/" in
    /var/tmp/* | /tmp/*)
      die "state folder $state is owned by uid $(stat -c %u "$state"), not by $(id -un): remove it or set HVA_PODMAN_STATE elsewhere" ;;
  esac
fi
# Exit 2: this machine cannot run the engine (not root, packages or mirror unreachable).
unavailable() { echo "podman_engine: UNAVAILABLE: $*" >&2; exit 2; }
# shellcheck source=apt_missing.sh
. "$(dirname "${BASH_SOURCE[0]}")/apt_missing.sh"

need_root() {
  [ "$(id -u)" = 0 ] || unavailable "must run as root (podman's rootful storage and networking); got uid $(id -u)"
}

install_packages() {
  # Debian package : a command it provides
  local want=() pkg cmd
  for pair in podman:podman runc:runc debootstrap:debootstrap slirp4netns:slirp4netns \
    fuse-overlayfs:fuse-overlayfs uidmap:newuidmap; do
    pkg=${pair%%:*}
    cmd=${pair#*:}
    command -v "$cmd" >/dev/null 2>&1 || want+=("$pkg")
  done
  apt_install_missing "${want[@]}"
}

write_conf() {
  # runc: crun refuses the hybrid cgroup v1/v2 setup of these VMs.
  # default_ulimits: podman would otherwise try to raise the hard limits, which a sandboxed
  # root may not do.
  cat >"$conf" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
EOF
}

write_registries_conf() {
  # The system's search and short-name settings, plus the plain-HTTP registries allowed here.
  { [ -f /etc/containers/registries.conf ] && cat /etc/containers/registries.conf
    local r
    for r in ${HVA_INSECURE_REGISTRIES//,/ }; do
      printf '\n[[registry]]\nlocation = "%s"\ninsecure = true\n' "$r"
    done
  } >"$registries_conf"
}

podman_() { CONTAINERS_CONF="$conf" CONTAINERS_REGISTRIES_CONF="$registries_conf" podman "$@"; }

api_answers() {
  [ -S "$sock" ] && CONTAINERS_CONF="$conf" podman --url "unix://$sock" version >/dev/null 2>&1
}

service_pid() {
  local pid
  pid=$(cat "$pidfile" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

cmd_start() {
  need_root
  mkdir -p "$state"
  install_packages
  write_conf
  write_registries_conf
  local pid
  if pid=$(service_pid) && api_answers; then
    # conmon, started by the service for every container, needs the service's working
    # directory: a service started from a folder deleted since (a removed checkout or work
    # tree) answers the API but can start no container ("write child: broken pipe").
    if [ -d "$(readlink "/proc/$pid/cwd")" ]; then
      log "already serving unix://$sock (pid $pid)"
      return 0
    fi
    log "the service (pid $pid) lost its working directory; restarting it"
    cmd_stop
  fi
  rm -f "$sock"
  # --time=0: serve until stopped (the default exits after 5 s idle). From the state folder,
  # which outlives any checkout the caller ran in (see above).
  (cd "$state" && CONTAINERS_CONF="$conf" CONTAINERS_REGISTRIES_CONF="$registries_conf" \
    exec setsid podman system service --time=0 "unix://$sock" \
    >"$state/service.log" 2>&1 </dev/null) &
  echo $! >"$pidfile"
  for _ in $(seq 1 100); do
    api_answers && { log "serving the Docker API on unix://$sock (pid $(cat "$pidfile"))"; return 0; }
    kill -0 "$(cat "$pidfile")" 2>/dev/null || break
    sleep 0.2
  done
  tail -20 "$state/service.log" >&2 || true
  die "podman system service did not answer on unix://$sock"
}

cmd_stop() {
  local pid
  if pid=$(service_pid); then
    kill "$pid"
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    log "stopped the API service (pid $pid)"
  else
    log "no API service running from $state"
  fi
  rm -f "$pidfile" "$sock"
}

cmd_status() {
  if api_answers; then echo "serving unix://$sock"; else echo "not serving ($sock)"; return 1; fi
}

cmd_env() {
  echo "export DOCKER_HOST=unix://$sock"
  echo "export CONTAINERS_CONF=$conf"
  echo "export CONTAINERS_REGISTRIES_CONF=$registries_conf"
}

apt_mirror() {
  if [ -n "${HVA_APT_MIRROR:-}" ]; then echo "$HVA_APT_MIRROR"; return; fi
  local m
  # deb822 (URIs: ...) and one-line (deb URL suite ...) formats; skip security/updates/3rd party.
  m=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
    2>/dev/null | sed -n -E 's#^(URIs:|deb)[[:space:]]+(\[[^]]*\][[:space:]]+)?(https?://[^[:space:]]+/debian)/?([[:space:]].*)?$#\3#p' |
    grep -v -e security | head -1 || true)
  echo "${m:-http://deb.debian.org/debian}"
}

# The shared libraries a from-source CPython (pyenv), torch and Horovod load that minbase lacks,
# plus procps (horovodrun inspects processes) and CA certificates (S3 over TLS).
containerfile() {
  cat <<EOF
FROM $base_image
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \\
      ca-certificates libbz2-1.0 libexpat1 libffi8 libgomp1 liblzma5 libncursesw6 libnsl2 \\
      libreadline8 libsqlite3-0 libssl3 libtirpc3 libuuid1 procps zlib1g \\
    && rm -rf /var/lib/apt/lists/*
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
EOF
}

ensure_base() {
  # The Debian bookworm minbase image every image of ours starts from (no registry needed).
  podman_ image exists "$base_image" && return 0
  local root mirror start
  root=$(mktemp -d "$state/rootfs.XXXXXX")
  mirror=$(apt_mirror)
  start=$(date +%s)
  log "debootstrap bookworm minbase from $mirror (about 30 s)"
  if ! debootstrap --variant=minbase bookworm "$root" "$mirror" >"$state/debootstrap.log" 2>&1; then
    rm -rf "$root"
    unavailable "debootstrap from $mirror failed (mirror unreachable?); see $state/debootstrap.log"
  fi
  tar -C "$root" -c . | podman_ import - "$base_image" >/dev/null
  rm -rf "$root"
  log "imported $base_image in $(( $(date +%s) - start ))s"
}

# What building an image needs: root, the state folder and engine settings, podman, debootstrap.
prepare_build() {
  need_root
  mkdir -p "$state"
  [ -f "$conf" ] || write_conf
  command -v podman >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1 || install_packages
}

cmd_base() {
  prepare_build
  ensure_base
  echo "$base_image"
}

cmd_image() {
  prepare_build
  local tag image
  tag=$(containerfile | sha256sum | cut -c1-12)
  image="$runtime_repo:$tag"
  if podman_ image exists "$image"; then
    echo "$image"
    return 0
  fi
  ensure_base
  local ctx
  ctx=$(mktemp -d "$state/build.XXXXXX")
  containerfile >"$ctx/Containerfile"
  log "building $image"
  # host network: the build's apt-get reaches the same mirror the host does.
  if ! podman_ build --network host -t "$image" -f "$ctx/Containerfile" "$ctx" >"$state/build.log" 2>&1; then
    rm -rf "$ctx"
    tail -20 "$state/build.log" >&2 || true
    die "podman build failed; see $state/build.log"
  fi
  rm -rf "$ctx"
  echo "$image"
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) cmd_env ;;
  image) cmd_image ;;
  base) cmd_base ;;
  *) die "usage: $0 start|image|base|env|status|stop (got '${1:-}')" ;;
esac
