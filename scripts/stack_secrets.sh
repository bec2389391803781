#!/usr/bin/env bash
# The compose stack's secret files (docker-compose.yml's top-level `secrets:`), random values for
# each one missing; an existing file is kept as it is (so a restart keeps its passwords).
#
#   scripts/stack_secrets.sh DIR        # e.g. secrets (HVA_SECRETS_DIR in .env)
#
# Files are written without a trailing newline, mode 0640, group 0 (the Airflow containers run
# as AIRFLOW_UID:0 and read them through the bind mount); the folder is 0750. smtp_password is
# made empty (an SMTP server without login): write yours there. No value is printed.
set -euo pipefail
dir=${1:?usage: $0 DIR (the HVA_SECRETS_DIR of .env)}
names=(postgres_password airflow_admin_password airflow_jwt_secret airflow_api_secret_key
  s3_admin_secret_key s3_worker_secret_key s3_ranks_secret_key)
umask 027
mkdir -p "$dir"
chmod 750 "$dir"
write() { # NAME: the value on stdin
  local tmp="$dir/.$1.tmp"
  cat >"$tmp"
  chgrp 0 "$tmp" 2>/dev/null || true
  chmod 640 "$tmp"
  mv "$tmp" "$dir/$1"
  echo "stack_secrets: wrote $dir/$1" >&2
}
for name in "${names[@]}"; do
  [ -s "$dir/$name" ] || head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' | write "$name"
done
[ -s "$dir/airflow_fernet_key" ] || head -c 32 /dev/urandom | base64 | tr '+/' '-_' | tr -d '\n' |
  write airflow_fernet_key
[ -e "$dir/smtp_password" ] || printf '' | write smtp_password
