#!/usr/bin/env bash
# Stops everything infra/up.sh started and checks that nothing is left running.
set -uo pipefail
source "$(dirname "$0")/env.sh"
"$ROLLSTREAM_ROOT/infra/minio.sh" stop
"$ROLLSTREAM_ROOT/infra/kafka.sh" stop
# The OS-task tests start a private Docker engine on demand (infra/sandbox/dockerd.sh): it is
# part of what a test run started, so it stops here too.
"$ROLLSTREAM_ROOT/infra/sandbox/dockerd.sh" stop >/dev/null
# So does the db family's MariaDB server (infra/mariadb.sh), started by its tests.
"$ROLLSTREAM_ROOT/infra/mariadb.sh" stop
left=$(pgrep -f "$ROLLSTREAM_RUN/(kafka|minio|dockerd|mariadb)" || true)
if [ -n "$left" ]; then log "still running after stop: $left"; exit 1; fi
log "infrastructure stopped"
