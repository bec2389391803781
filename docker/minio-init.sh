#!/bin/sh
# One-shot MinIO set-up for the compose stack (runs in the minio/mc image, POSIX sh):
#   1. the pipeline bucket ($HVA_BUCKET), kept across restarts;
#   2. a pipeline user ($HVA_S3_ACCESS_KEY) allowed only on that bucket — the credentials of
#      Airflow's aws_default connection and of every training rank; the MinIO root user stays
#      with the operator of the stack.
# Idempotent: `docker compose up` runs it on every start.
set -eu

: "${MINIO_ROOT_USER:?MINIO_ROOT_USER is not set (see .env.example)}"
: "${MINIO_ROOT_PASSWORD:?MINIO_ROOT_PASSWORD is not set (see .env.example)}"
: "${HVA_BUCKET:?HVA_BUCKET is not set (see .env.example)}"
: "${HVA_S3_ACCESS_KEY:?HVA_S3_ACCESS_KEY is not set (see .env.example)}"
: "${HVA_S3_SECRET_KEY:?HVA_S3_SECRET_KEY is not set (see .env.example)}"
endpoint=${MINIO_ENDPOINT:-http://minio:9000}

mc alias set hva "$endpoint" "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD" >/dev/null
mc mb --ignore-existing "hva/$HVA_BUCKET"

policy=/tmp/hva-pipeline-policy.json
cat >"$policy" <<JSON
{
  "Version": "2012-10-17",
  "Statement": [
    {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
     "Resource": ["arn:aws:s3:::$HVA_BUCKET"]},
    {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                                   "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"],
     "Resource": ["arn:aws:s3:::$HVA_BUCKET/*"]}
  ]
}
JSON
mc admin policy create hva hva-pipeline "$policy"
mc admin user add hva "$HVA_S3_ACCESS_KEY" "$HVA_S3_SECRET_KEY"
# attach answers an error when the policy is attached already (a restart): accept that case only.
if ! out=$(mc admin policy attach hva hva-pipeline --user "$HVA_S3_ACCESS_KEY" 2>&1); then
  case "$out" in
    *already*) ;;
    *) echo "$out" >&2; exit 1 ;;
  esac
fi
echo "minio-init: bucket s3://$HVA_BUCKET ready; user $HVA_S3_ACCESS_KEY has policy hva-pipeline"
