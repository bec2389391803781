#!/bin/sh
# Run first by the compose stack's one-shot init jobs (airflow-init, minio-init), POSIX sh:
# refuse to start while any of the job's settings still holds a published placeholder of
# .env.example ("change-me..."), naming the variables (never their values). Every secret of
# the stack passes through one of these two jobs' environments, so `up` stops here, before
# anything is created with a password the whole world knows.
bad=$(env | sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)=.*change-me.*/\1/p' | sort -u | tr '\n' ' ')
if [ -n "$bad" ]; then
  echo "refusing to start: ${bad}still hold(s) a published placeholder of .env.example" \
    "(change-me...): set your own values in .env (a random one: openssl rand -hex 24)" >&2
  exit 1
fi
