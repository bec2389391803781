#!/usr/bin/env bash
# Two (or more) simulated hosts on one machine, for multi-host Horovod: a network namespace per
# host, each with its own hostname, address and sshd, joined by a bridge in the root namespace.
#
#   scripts/engines/netns_hosts.sh up       # create namespaces, bridge, keys, sshd per host
#   scripts/engines/netns_hosts.sh down     # stop those sshd (by PID), delete all of it
#   scripts/engines/netns_hosts.sh lose H   # host H lost as a preempted node: every process in
#                                           # its namespace killed, namespace and link deleted
#                                           # (`up` brings it back)
#   scripts/engines/netns_hosts.sh status   # show what exists
#   scripts/engines/netns_hosts.sh env      # print the settings a launcher needs
#
# Layout (defaults; 10.231.77.0/24 is a private subnet of our own, nothing else is routed):
#
#   root namespace: bridge hvd0 10.231.77.254 ── veth ── h1: hvd0 10.231.77.1, sshd :2222
#                                             └─ veth ── h2: hvd0 10.231.77.2, sshd :2222
#
# Every host's interface is named like the bridge (hvd0), so horovodrun's driver (which runs
# in the root namespace, like an Airflow worker would) and all ranks share one interface name
# for --network-interface, and the driver's address on it is reachable from every rank.
# Namespaces share the filesystem, so the same venv and source paths work on every "host".
# Then, from the root namespace:
#
#   horovodrun -np 2 -H 10.231.77.1:1,10.231.77.2:1 -p 2222 -i "$STATE/id_ed25519" \
#       --network-interface hvd0 python -m ...
#
# Needs root. Settings (environment): HVA_NETNS_STATE (/var/tmp/hva-netns), HVA_NETNS_HOSTS
# ("h1 h2"), HVA_NETNS_SUBNET (10.231.77, a /24), HVA_NETNS_IFACE (hvd0), HVA_NETNS_SSH_PORT
# (2222).
set -euo pipefail

state=${HVA_NETNS_STATE:-/var/tmp/hva-netns}
hosts=${HVA_NETNS_HOSTS:-h1 h2}
subnet=${HVA_NETNS_SUBNET:-10.231.77}
iface=${HVA_NETNS_IFACE:-hvd0}
port=${HVA_NETNS_SSH_PORT:-2222}
bridge_ip="$subnet.254"
# The bridge's own MAC address, fixed (locally administered, from the subnet). Left alone, a
# Linux bridge takes the lowest MAC of its ports, and changes it when that port goes: losing
# one host (`lose`) would then cut every other host off from the root namespace until their
# neighbour entries expired, long enough for their sshd to drop horovodrun's sessions
# (ClientAlive below), a failure no real node loss causes.
IFS=. read -r _ b c <<<"$subnet"
bridge_mac=$(printf '02:0a:%02x:%02x:00:fe' "$b" "$c")

log() { echo "netns_hosts: $*" >&2; }
die() { echo "netns_hosts: ERROR: $*" >&2; exit 1; }
# Exit 2: this machine cannot host the simulated hosts (not root, packages not installable).
unavailable() { echo "netns_hosts: UNAVAILABLE: $*" >&2; exit 2; }
# shellcheck source=apt_missing.sh
. "$(dirname "${BASH_SOURCE[0]}")/apt_missing.sh"

[[ "$subnet" =~ ^10\.[0-9]{1,3}\.[0-9]{1,3}$ ]] ||
  die "HVA_NETNS_SUBNET must be the first three octets of a 10.x.y.0/24 subnet, got '$subnet'"
[ ${#iface} -le 10 ] || die "HVA_NETNS_IFACE must be at most 10 characters (got '$iface')"

host_ip() { # host name -> address: .1 for the first host, .2 for the second, ...
  echo "$subnet.$(host_index "$1")"
}

host_index() { # host name -> its position in $hosts, from 1
  local i=0 h
  for h in $hosts; do
    i=$((i + 1))
    [ "$h" = "$1" ] && { echo "$i"; return 0; }
  done
  return 1
}

sshd_pid() { # host -> pid of its listening sshd, when alive
  local pid st
  pid=$(cat "$state/$1/sshd.pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  # A killed sshd whose parent (PID 1 of a container, often) does not reap it stays a zombie,
  # which kill -0 still finds: it is dead all the same and must be started again.
  st=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1) || return 1
  case "$st" in Z | X | "") return 1 ;; esac
  echo "$pid"
}

install_packages() {
  local want=()
  [ -x /usr/sbin/sshd ] || want+=(openssh-server)
  command -v ssh >/dev/null 2>&1 || want+=(openssh-client)
  command -v ip >/dev/null 2>&1 || want+=(iproute2)
  command -v unshare >/dev/null 2>&1 || want+=(util-linux)
  apt_install_missing "${want[@]}"
  # Debian's package starts the system sshd where it can; the simulated hosts do not need it.
}

write_sshd_config() { # host ip
  local h=$1 ip=$2 dir="$state/$1"
  mkdir -p "$dir"
  [ -f "$dir/host_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -C "hva-$h-host" -f "$dir/host_ed25519"
  cat >"$dir/sshd_config" <<EOF
# sshd of simulated host $h (namespace $h), written by scripts/engines/netns_hosts.sh
Port $port
ListenAddress $ip
HostKey $dir/host_ed25519
PidFile $dir/sshd.pid
AuthorizedKeysFile $state/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
# horovodrun opens one connection per task service and per rank, at once.
MaxStartups 100
MaxSessions 100
# Close sessions whose client is gone (a killed launcher), so ranks do not linger.
ClientAliveInterval 5
ClientAliveCountMax 2
EOF
}

write_hosts_file() { # host
  # `ip netns exec NAME` bind-mounts /etc/netns/NAME/hosts over /etc/hosts, for sshd and all it
  # starts. Each host's own name must resolve to its address: Horovod 0.28.1 builds the Gloo
  # device of its process sets from gethostname(), and crashes (SIGSEGV in hvd.init) when the
  # name does not resolve.
  local h2
  mkdir -p "/etc/netns/$1"
  {
    echo "127.0.0.1 localhost"
    for h2 in $hosts; do echo "$(host_ip "$h2") $h2"; done
  } >"/etc/netns/$1/hosts"
}

trust_host_keys() {
  # horovodrun's ssh (-o StrictHostKeyChecking=no, no way to pass a known_hosts file) records
  # host keys in ~/.ssh/known_hosts; fresh keys for the same [address]:port on every `up`
  # would make it warn about a changed host key. So: replace our entries there on up, and
  # remove them on down.
  local h
  mkdir -p ~/.ssh && chmod 700 ~/.ssh
  for h in $hosts; do ssh-keygen -q -R "[$(host_ip "$h")]:$port" >/dev/null 2>&1 || true; done
  cat "$state/known_hosts" >>~/.ssh/known_hosts
}

cmd_up() {
  [ "$(id -u)" = 0 ] || unavailable "must run as root (network namespaces, veth, sshd); got uid $(id -u)"
  mkdir -p "$state"
  install_packages
  mkdir -p /run/sshd # sshd's privilege-separation directory
  [ -f "$state/id_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -C "hva-netns-launcher" -f "$state/id_ed25519"
  cp "$state/id_ed25519.pub" "$state/authorized_keys"

  if ! ip link show "$iface" >/dev/null 2>&1; then
    ip link add "$iface" type bridge
    ip link set "$iface" address "$bridge_mac"
    ip addr add "$bridge_ip/24" dev "$iface"
    ip link set "$iface" up
  fi
  local h ip peer known=""
  for h in $hosts; do
    ip=$(host_ip "$h")
    peer="$iface-$h"
    [ ${#peer} -le 15 ] || die "interface name '$peer' is longer than 15 characters; shorten host '$h'"
    if ! ip netns list | grep -qw "^$h"; then
      ip netns add "$h"
    fi
    ip -n "$h" link set lo up
    if ! ip -n "$h" link show "$iface" >/dev/null 2>&1; then
      ip link add "$peer" type veth peer name "$iface" netns "$h"
      ip link set "$peer" master "$iface"
      ip link set "$peer" up
      ip -n "$h" addr add "$ip/24" dev "$iface"
      ip -n "$h" link set "$iface" up
    fi
    write_sshd_config "$h" "$ip"
    write_hosts_file "$h"
    if ! sshd_pid "$h" >/dev/null; then
      # Own UTS namespace: the host's hostname is its name, seen by every process sshd starts.
      # Own CPU (round-robin over this machine's): a rank sizes its torch threads from its
      # affinity, as on a real host with its own cores.
      local pin=()
      command -v taskset >/dev/null 2>&1 && pin=(taskset -c "$(( ($(host_index "$h") - 1) % $(nproc) ))")
      ip netns exec "$h" "${pin[@]}" unshare --uts sh -c "hostname $h && exec /usr/sbin/sshd -f $state/$h/sshd_config -E $state/$h/sshd.log"
    fi
    known="$known[$ip]:$port $(cut -d' ' -f1,2 "$state/$h/host_ed25519.pub")"$'\n'
  done
  printf '%s' "$known" >"$state/known_hosts"
  trust_host_keys

  # Prove it: the root namespace (where horovodrun's driver runs) and every host reach every
  # host over ssh with the key, and each answers with its own hostname.
  local src dst got
  for dst in $hosts; do
    for _ in $(seq 1 50); do
      [ -n "$(sshd_pid "$dst" || true)" ] && break
      sleep 0.1
    done
    sshd_pid "$dst" >/dev/null || die "sshd of $dst did not start; see $state/$dst/sshd.log"
  done
  for src in root $hosts; do
    for dst in $hosts; do
      local run=()
      [ "$src" = root ] || run=(ip netns exec "$src")
      got=$("${run[@]}" ssh -F /dev/null -o BatchMode=yes -o ConnectTimeout=5 \
        -o UserKnownHostsFile="$state/known_hosts" -o StrictHostKeyChecking=yes \
        -i "$state/id_ed25519" -p "$port" "root@$(host_ip "$dst")" hostname) ||
        die "ssh from $src to $dst ($(host_ip "$dst"):$port) failed"
      [ "$got" = "$dst" ] || die "ssh from $src to $dst answered hostname '$got'"
    done
  done
  log "up: $(for h in $hosts; do printf '%s=%s ' "$h" "$(host_ip "$h")"; done)(ssh port $port, key $state/id_ed25519)"
}

remove_host() { # host: its sshd and every process in its namespace killed, then it is deleted
  local h=$1 pid
  if pid=$(sshd_pid "$h"); then
    # The listener, then any session it forked: all of them live only in this namespace.
    kill "$pid" 2>/dev/null || true
  fi
  if ip netns list | grep -qw "^$h"; then
    for pid in $(ip netns pids "$h" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$h"
  fi
  ip link del "$iface-$h" 2>/dev/null || true
  rm -f "/etc/netns/$h/hosts"
  rmdir "/etc/netns/$h" 2>/dev/null || true
}

cmd_lose() { # host
  [ -n "${1:-}" ] && host_index "$1" >/dev/null ||
    die "lose: name one of the hosts ($hosts), got '${1:-}'"
  remove_host "$1"
  # The others (and the bridge) still hold its link's old MAC address: a host brought back
  # by `up` has a new one, and would not be reached until those entries expired.
  local ip h
  ip=$(host_ip "$1")
  ip neigh flush to "$ip" 2>/dev/null || true
  for h in $hosts; do
    [ "$h" = "$1" ] || ip -n "$h" neigh flush to "$ip" 2>/dev/null || true
  done
  log "lost $1 ($(host_ip "$1")): its processes killed, its namespace and link deleted"
}

cmd_down() {
  local h
  for h in $hosts; do remove_host "$h"; done
  ip link show "$iface" >/dev/null 2>&1 && ip link del "$iface"
  for h in $hosts; do
    ssh-keygen -q -R "[$(host_ip "$h")]:$port" >/dev/null 2>&1 || true
  done
  rm -f ~/.ssh/known_hosts.old
  rm -rf "$state"
  log "down"
}

cmd_status() {
  local h rc=0
  ip -br addr show "$iface" 2>/dev/null || { echo "no bridge $iface"; rc=1; }
  for h in $hosts; do
    if ip netns list | grep -qw "^$h"; then
      echo "$h: $(ip -n "$h" -br addr show "$iface" 2>/dev/null | awk '{print $3}') sshd pid $(sshd_pid "$h" || echo none)"
    else
      echo "$h: absent"
      rc=1
    fi
  done
  return $rc
}

cmd_env() {
  local h list=""
  for h in $hosts; do list="$list${list:+,}$(host_ip "$h"):1"; done
  echo "export HVA_NETNS_HOSTS_ARG=$list"
  echo "export HVA_NETNS_SSH_PORT=$port"
  echo "export HVA_NETNS_SSH_KEY=$state/id_ed25519"
  echo "export HVA_NETNS_IFACE=$iface"
  echo "export HVA_NETNS_BRIDGE_IP=$bridge_ip"
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  lose) cmd_lose "${2:-}" ;;
  status) cmd_status ;;
  env) cmd_env ;;
  *) die "usage: $0 up|down|lose HOST|status|env (got '${1:-}')" ;;
esac
