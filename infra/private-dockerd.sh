#!/usr/bin/env bash
# A private Docker engine (Debian's docker.io daemon, installed when missing) in a folder of its own:
# data, exec root, pid file and socket DIR/docker.sock. The callers choose its networking:
# infra/sandbox/dockerd.sh (OS-task sandboxes: none at all) and infra/compose/engine.sh (compose: NAT).
#
#   infra/private-dockerd.sh NAME DIR start|stop|status [DOCKERD FLAGS...]
#
# cgroupfs driver and overlay2, as ARCHITECTURE.md "Local infrastructure" found working on these machines.
# Idempotent: start on a running engine and stop on a stopped one do nothing.
set -euo pipefail

name="$1" run="$2" action="${3:-}"
shift 3 || true
sock="$run/docker.sock"
pidfile="$run/dockerd.pid"

answers() { DOCKER_HOST="unix://$sock" timeout 5 docker version >/dev/null 2>&1; }

case "$action" in
  start)
    if answers; then echo "$name: already running (unix://$sock)"; exit 0; fi
    if ! command -v dockerd >/dev/null; then
      apt-get install -y docker.io >&2 || { apt-get update >&2 && apt-get install -y docker.io >&2; }
    fi
    mkdir -p "$run/data" "$run/exec"
    nohup dockerd --data-root "$run/data" --exec-root "$run/exec" --pidfile "$pidfile" \
      --host "unix://$sock" --exec-opt native.cgroupdriver=cgroupfs --storage-driver overlay2 \
      "$@" >"$run/dockerd.log" 2>&1 &
    for _ in $(seq 1 60); do
      if answers; then echo "$name: running (unix://$sock)"; exit 0; fi
      sleep 0.5
    done
    echo "$name: did not answer within 30 s; see $run/dockerd.log" >&2
    exit 1
    ;;
  stop)
    if [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      pid="$(cat "$pidfile")"
      kill "$pid"
      for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    # dockerd leaves its default network namespace mounted under the exec root: unmounted, so that
    # `rm -rf .run` works after a stop.
    awk -v r="$run/" 'index($2, r) == 1 {print $2}' /proc/mounts | sort -r | while read -r m; do umount "$m" || true; done
    echo "$name: stopped"
    ;;
  status)
    if answers; then echo "$name: running (unix://$sock)"; else echo "$name: not running"; exit 1; fi
    ;;
  *)
    echo "usage: $0 NAME DIR start|stop|status [DOCKERD FLAGS...]" >&2
    exit 2
    ;;
esac
