#!/usr/bin/env bash
# Stops everything infra/up.sh started and checks that nothing is left running.
set -uo pipefail
source "$(dirname "$0")/env.sh"
"$ROLLSTREAM_ROOT/infra/minio.sh" stop
"$ROLLSTREAM_ROOT/infra/kafka.sh" stop
left=$(pgrep -f "$ROLLSTREAM_RUN/(kafka|minio)" || true)
if [ -n "$left" ]; then log "still running after stop: $left"; exit 1; fi
log "infrastructure stopped"
