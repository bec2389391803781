#!/bin/sh
# `minio server DIR [--console-address ADDR]` of the MinIO stand-in: moto's S3 API on :9000.
# The data folder and the console address are accepted and ignored (moto keeps objects in memory
# and has no console); anything other than `server` is refused.
set -eu
if [ "${1:-}" != server ]; then
  echo "minio (stand-in): only 'minio server ...' is supported, got: $*" >&2
  exit 2
fi
echo "minio (stand-in): moto S3 server on 0.0.0.0:9000; credentials are NOT checked" >&2
exec /opt/moto/bin/moto_server -H 0.0.0.0 -p 9000
