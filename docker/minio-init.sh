#!/bin/sh
# One-shot MinIO set-up for the compose stack (runs in the minio/mc image, POSIX sh):
#   1. the pipeline bucket ($HVA_BUCKET), kept across restarts;
#   2. a pipeline user ($HVA_S3_ACCESS_KEY) allowed only on that bucket — the credentials of
#      Airflow's aws_default connection; the MinIO root user stays with the operator of the
#      stack;
#   3. the training ranks' user ($HVA_RANKS_S3_ACCESS_KEY, the hva_ranks connection): reads
#      datasets/, reads and writes runs/, nothing under models/ (publishing is the worker's).
# Idempotent: `docker compose up` runs it on every start.
set -eu

: "${MINIO_ROOT_USER:?MINIO_ROOT_USER is not set (see .env.example)}"
: "${MINIO_ROOT_PASSWORD:?MINIO_ROOT_PASSWORD is not set (see .env.example)}"
: "${HVA_BUCKET:?HVA_BUCKET is not set (see .env.example)}"
: "${HVA_S3_ACCESS_KEY:?HVA_S3_ACCESS_KEY is not set (see .env.example)}"
: "${HVA_S3_SECRET_KEY:?HVA_S3_SECRET_KEY is not set (see .env.example)}"
: "${HVA_RANKS_S3_ACCESS_KEY:?HVA_RANKS_S3_ACCESS_KEY is not set (see .env.example)}"
: "${HVA_RANKS_S3_SECRET_KEY:?HVA_RANKS_S3_SECRET_KEY is not set (see .env.example)}"
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
ranks_policy=/tmp/hva-ranks-policy.json
cat >"$ranks_policy" <<JSON
{
  "Version": "2012-10-17",
  "Statement": [
    {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
     "Resource": ["arn:aws:s3:::$HVA_BUCKET"]},
    {"Effect": "Allow", "Action": ["s3:GetObject"],
     "Resource": ["arn:aws:s3:::$HVA_BUCKET/datasets/*", "arn:aws:s3:::$HVA_BUCKET/runs/*"]},
    {"Effect": "Allow", "Action": ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
                                   "s3:ListMultipartUploadParts"],
     "Resource": ["arn:aws:s3:::$HVA_BUCKET/runs/*"]}
  ]
}
JSON

# attach answers an error when the policy is attached already (a restart): accept that case only.
user_with_policy() { # USER SECRET POLICY FILE
  mc admin policy create hva "$3" "$4"
  mc admin user add hva "$1" "$2"
  if ! out=$(mc admin policy attach hva "$3" --user "$1" 2>&1); then
    case "$out" in
      *already*) ;;
      *) echo "$out" >&2; exit 1 ;;
    esac
  fi
}
user_with_policy "$HVA_S3_ACCESS_KEY" "$HVA_S3_SECRET_KEY" hva-pipeline "$policy"
user_with_policy "$HVA_RANKS_S3_ACCESS_KEY" "$HVA_RANKS_S3_SECRET_KEY" hva-ranks "$ranks_policy"
echo "minio-init: bucket s3://$HVA_BUCKET ready; user $HVA_S3_ACCESS_KEY has policy hva-pipeline," \
  "user $HVA_RANKS_S3_ACCESS_KEY (the ranks) has policy hva-ranks"
