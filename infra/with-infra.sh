#!/usr/bin/env bash
# with-infra.sh CMD...: runs CMD with Kafka and MinIO up. Starts them if they are not running and
# then stops them again afterwards (also on failure or Ctrl-C); leaves them alone if they were.
# Exits with CMD's status, except that pytest's 5 ("no tests collected") counts as a failure.
set -uo pipefail
source "$(dirname "$0")/env.sh"
started=0
if ! "$ROLLSTREAM_ROOT/infra/kafka.sh" status >/dev/null 2>&1 || ! "$ROLLSTREAM_ROOT/infra/minio.sh" status >/dev/null 2>&1; then
  started=1
fi
cleanup() { [ $started -eq 1 ] && "$ROLLSTREAM_ROOT/infra/down.sh"; }
trap cleanup EXIT
trap 'exit 130' INT TERM
"$ROLLSTREAM_ROOT/infra/up.sh" || exit 1
"$@"
rc=$?
if [ $rc -eq 5 ]; then log "the test run collected no tests: failing"; rc=1; fi
exit $rc
