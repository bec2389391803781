#!/bin/sh
# Entrypoint of the postgres stand-in (docker/standins/postgres.Containerfile): on an empty
# PGDATA, create the cluster with POSTGRES_USER as superuser (password POSTGRES_PASSWORD) and
# the database POSTGRES_DB; then run the server as the postgres user, listening on every
# address with password (scram-sha-256) authentication for TCP clients. As in the official
# image, the password may come from a file instead: POSTGRES_PASSWORD_FILE (a compose secret).
set -eu
if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
  [ -z "${POSTGRES_PASSWORD:-}" ] || { echo "set POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE, not both" >&2; exit 1; }
  POSTGRES_PASSWORD=$(cat "$POSTGRES_PASSWORD_FILE")
fi
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE is required (as in the official image)}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }

mkdir -p "$PGDATA"
chown postgres:postgres "$PGDATA"
chmod 0700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
  chown postgres "$pwfile"
  # UTF8 + C.UTF-8: Airflow's FAB tables hold non-ASCII text; the Debian default (SQL_ASCII
  # under the C locale) makes its set-up fail.
  as_postgres initdb --username="$user" --pwfile="$pwfile" --encoding=UTF8 --locale=C.UTF-8 \
    --auth-local=trust --auth-host=scram-sha-256 -D "$PGDATA" >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  echo "listen_addresses = '*'" >>"$PGDATA/postgresql.auto.conf"
  if [ "$db" != postgres ]; then
    echo "CREATE DATABASE \"$db\" OWNER \"$user\";" |
      as_postgres postgres --single -j -D "$PGDATA" postgres >/dev/null
  fi
  echo "postgres stand-in: initialised $PGDATA (user $user, database $db)"
fi
if [ "${1:-postgres}" = postgres ]; then
  [ $# -gt 0 ] && shift
  exec setpriv --reuid=postgres --regid=postgres --init-groups postgres -D "$PGDATA" "$@"
fi
exec "$@"
