#!/bin/sh
# minio-init: create the checkpoint bucket once MinIO is up (idempotent).
set -eu
mc alias set local http://minio:9000 "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD"
mc mb --ignore-existing "local/${CKPT_BUCKET}"
echo "bucket ${CKPT_BUCKET} ready"
