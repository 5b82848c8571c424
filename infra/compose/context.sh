#!/usr/bin/env bash
# Fills .docker-context/, the files the images copy that are not in the repository:
#   wheels/           the CPU torch wheel (not on the package index; ../shared/wheels or ROLLSTREAM_WHEELS)
#   ca-certificates/  this machine's extra CA certificates (/usr/local/share/ca-certificates/*.crt), so that
#                     builds and containers trust the same HTTPS as the host (empty when there are none)
#   kafka-libs/       the Kafka jars infra/kafka.sh fetches with Maven   (only with --local-images)
#   minio/minio       the MinIO binary infra/minio.sh builds from source (only with --local-images)
#
#   infra/compose/context.sh [--local-images]
set -euo pipefail
source "$(dirname "$0")/../env.sh"
ctx="$ROLLSTREAM_ROOT/.docker-context"
wheels="${ROLLSTREAM_WHEELS:-$ROLLSTREAM_SHARED/wheels}"

mkdir -p "$ctx/wheels" "$ctx/ca-certificates"
ls "$wheels"/torch-*+cpu-*.whl >/dev/null 2>&1 || die "no CPU torch wheel in $wheels (set ROLLSTREAM_WHEELS)"
cp -u "$wheels"/*.whl "$ctx/wheels/"
rm -f "$ctx/ca-certificates/"*
shopt -s nullglob
certs=(/usr/local/share/ca-certificates/*.crt)
(( ${#certs[@]} )) && cp "${certs[@]}" "$ctx/ca-certificates/"
touch "$ctx/ca-certificates/.keep"  # COPY of an empty folder needs something in it

if [[ "${1:-}" == "--local-images" ]]; then
  "$ROLLSTREAM_ROOT/infra/kafka.sh" fetch
  "$ROLLSTREAM_ROOT/infra/minio.sh" build
  rm -rf "$ctx/kafka-libs" && cp -r "$ROLLSTREAM_CACHE/kafka-$KAFKA_VERSION/libs" "$ctx/kafka-libs"
  mkdir -p "$ctx/minio" && cp "$ROLLSTREAM_CACHE/minio-$MINIO_VERSION/bin/minio" "$ctx/minio/minio"
fi
log "docker build context ready in $ctx"
