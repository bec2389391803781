# Sourced by the engine scripts: install the Debian packages a script lacks, once, loudly.
# The sourcing script defines log() and unavailable() (which exits 2: the component cannot be
# had here) and sets $state (its state folder, where apt's log goes).

# apt_install_missing PKG...: apt-get install PKG..., with one `apt-get update` and a retry if
# the first try fails (a machine whose package lists are stale or absent).
apt_install_missing() {
  [ $# -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || unavailable "missing $* and no apt-get to install them"
  log "installing $* (apt-get)"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >"$state/apt.log" 2>&1; then
    apt-get update -q >>"$state/apt.log" 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >>"$state/apt.log" 2>&1 ||
      unavailable "apt-get install $* failed; see $state/apt.log"
  fi
}
