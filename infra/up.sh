#!/usr/bin/env bash
# Starts the local infrastructure (Kafka, MinIO), then creates every topic and bucket.
# Idempotent: what is already running is left as it is.
set -euo pipefail
source "$(dirname "$0")/env.sh"
"$ROLLSTREAM_ROOT/infra/kafka.sh" start
"$ROLLSTREAM_ROOT/infra/minio.sh" start
"$VENV/bin/rollstream" infra init
