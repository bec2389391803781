#!/usr/bin/env bash
# /entrypoint of the Airflow stand-in, doing what the official image's does for this stack:
#   - waits for the metadata DB (`airflow db check`, CONNECTION_CHECK_MAX_COUNT tries,
#     CONNECTION_CHECK_SLEEP_TIME seconds apart; 0 tries: no wait);
#   - _AIRFLOW_DB_MIGRATE=true: `airflow db migrate`;
#   - _AIRFLOW_WWW_USER_CREATE=true: `airflow users create` (FAB) as Admin from
#     _AIRFLOW_WWW_USER_USERNAME / _AIRFLOW_WWW_USER_PASSWORD, or the output of the command
#     _AIRFLOW_WWW_USER_PASSWORD_CMD (as the official image: e.g. `cat /run/secrets/x`). The
#     password goes to the command on its standard input (its prompt), not its command line
#     (the official image passes --password);
#   - then runs the command: `bash ...` and `python ...` as given, an `airflow ...` command as
#     given, anything else as an airflow subcommand (`api-server` -> `airflow api-server`).
set -euo pipefail

wait_for_db() {
  local tries=${CONNECTION_CHECK_MAX_COUNT:-20} pause=${CONNECTION_CHECK_SLEEP_TIME:-3} n=0
  [ "$tries" -gt 0 ] || return 0
  until airflow db check >/dev/null 2>&1; do
    n=$((n + 1))
    if [ "$n" -ge "$tries" ]; then
      echo "entrypoint: the metadata DB did not answer after $tries tries:" >&2
      airflow db check >&2 || true
      exit 1
    fi
    echo "entrypoint: waiting for the metadata DB ($n/$tries)" >&2
    sleep "$pause"
  done
}

case "${1:-}" in
  bash | python | python3) exec "$@" ;;
esac
wait_for_db
if [ "${_AIRFLOW_DB_MIGRATE:-}" = true ]; then
  airflow db migrate
fi
if [ "${_AIRFLOW_WWW_USER_CREATE:-}" = true ]; then
  if [ -z "${_AIRFLOW_WWW_USER_PASSWORD:-}" ] && [ -n "${_AIRFLOW_WWW_USER_PASSWORD_CMD:-}" ]; then
    _AIRFLOW_WWW_USER_PASSWORD=$(eval "$_AIRFLOW_WWW_USER_PASSWORD_CMD")
  fi
  : "${_AIRFLOW_WWW_USER_PASSWORD:?_AIRFLOW_WWW_USER_PASSWORD or _AIRFLOW_WWW_USER_PASSWORD_CMD is required with _AIRFLOW_WWW_USER_CREATE}"
  user=${_AIRFLOW_WWW_USER_USERNAME:-admin}
  if airflow users list -o plain 2>/dev/null | awk '{print $2}' | grep -qx "$user"; then
    echo "entrypoint: user $user exists"
  else
    printf '%s\n%s\n' "$_AIRFLOW_WWW_USER_PASSWORD" "$_AIRFLOW_WWW_USER_PASSWORD" |
      airflow users create --username "$user" \
      --firstname "${_AIRFLOW_WWW_USER_FIRSTNAME:-Airflow}" \
      --lastname "${_AIRFLOW_WWW_USER_LASTNAME:-Admin}" \
      --email "${_AIRFLOW_WWW_USER_EMAIL:-airflowadmin@example.com}" \
      --role "${_AIRFLOW_WWW_USER_ROLE:-Admin}"
  fi
fi
if [ $# -eq 0 ]; then exec airflow; fi
if [ "$1" = airflow ]; then exec "$@"; fi
exec airflow "$@"
