#!/usr/bin/env bash
# A real MinIO server on loopback, built once from source with `go install` at a pinned version.
# Usage: infra/minio.sh build|start|stop|status
set -euo pipefail
source "$(dirname "$0")/env.sh"

BIN="$ROLLSTREAM_CACHE/minio-$MINIO_VERSION/bin/minio"
DIR="$ROLLSTREAM_RUN/minio"
PIDFILE="$DIR/minio.pid"

build() {
  [ -x "$BIN" ] && return 0
  command -v go >/dev/null || die "Go (>= 1.24) is needed to build MinIO"
  log "building MinIO $MINIO_VERSION with go install into $(dirname "$BIN") (once per user; several minutes on 2 cores)"
  mkdir -p "$(dirname "$BIN")"
  (cd /tmp && GOFLAGS=-mod=mod GOBIN="$(dirname "$BIN")" go install "github.com/minio/minio@$MINIO_VERSION") >&2
  [ -x "$BIN" ] || die "go install did not produce $BIN"
}

start() {
  if pid_alive "$PIDFILE"; then log "MinIO already running (pid $(cat "$PIDFILE")) on $MINIO_HOST:$MINIO_PORT"; return 0; fi
  if port_open "$MINIO_HOST" "$MINIO_PORT"; then die "port $MINIO_HOST:$MINIO_PORT is taken by another process; set MINIO_PORT"; fi
  build
  mkdir -p "$DIR/data" "$DIR/logs"
  log "starting MinIO on $MINIO_HOST:$MINIO_PORT (data: $DIR/data)"
  MINIO_BROWSER=off MINIO_UPDATE=off setsid nohup "$BIN" server "$DIR/data" --quiet \
    --address "$MINIO_HOST:$MINIO_PORT" --console-address "$MINIO_HOST:$MINIO_CONSOLE_PORT" \
    > "$DIR/logs/minio.log" 2>&1 < /dev/null &
  echo $! > "$PIDFILE"
  local i
  for i in $(seq 1 120); do
    if curl -fsS "http://$MINIO_HOST:$MINIO_PORT/minio/health/ready" >/dev/null 2>&1; then log "MinIO answers on $MINIO_HOST:$MINIO_PORT"; return 0; fi
    pid_alive "$PIDFILE" || { tail -40 "$DIR/logs/minio.log" >&2; die "MinIO exited during start-up"; }
    sleep 0.5
  done
  tail -40 "$DIR/logs/minio.log" >&2; die "MinIO did not become ready within 60 s"
}

case "${1:-}" in
  build) build ;;
  start) start ;;
  stop) stop_pid "$PIDFILE" MinIO ;;
  status) pid_alive "$PIDFILE" && echo "minio: running (pid $(cat "$PIDFILE")) on $MINIO_HOST:$MINIO_PORT" || { echo "minio: stopped"; exit 1; } ;;
  *) echo "usage: $0 build|start|stop|status" >&2; exit 2 ;;
esac
