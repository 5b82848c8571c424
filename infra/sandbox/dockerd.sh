#!/usr/bin/env bash
# A private Docker engine for OS-task sandboxes, under the repo's .run/dockerd folder.
#
#   infra/sandbox/dockerd.sh start    # installs docker.io if missing; socket .run/dockerd/docker.sock
#   infra/sandbox/dockerd.sh status   # exit 0 when the engine answers
#   infra/sandbox/dockerd.sh stop
#
# cgroupfs driver and overlay2, as ARCHITECTURE.md "Local infrastructure" found working on these machines.
# Idempotent: start on a running engine and stop on a stopped one do nothing.
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
run="$repo/.run/dockerd"
sock="$run/docker.sock"
pidfile="$run/dockerd.pid"

answers() { DOCKER_HOST="unix://$sock" timeout 5 docker version >/dev/null 2>&1; }

case "${1:-}" in
  start)
    if answers; then echo "dockerd: already running (unix://$sock)"; exit 0; fi
    if ! command -v dockerd >/dev/null; then
      apt-get install -y docker.io >&2 || { apt-get update >&2 && apt-get install -y docker.io >&2; }
    fi
    mkdir -p "$run/data" "$run/exec"
    nohup dockerd --data-root "$run/data" --exec-root "$run/exec" --pidfile "$pidfile" \
      --host "unix://$sock" --exec-opt native.cgroupdriver=cgroupfs --storage-driver overlay2 \
      --bridge none --iptables=false --ip6tables=false >"$run/dockerd.log" 2>&1 &
    for _ in $(seq 1 60); do
      if answers; then echo "dockerd: running (unix://$sock)"; exit 0; fi
      sleep 0.5
    done
    echo "dockerd: did not answer within 30 s; see $run/dockerd.log" >&2
    exit 1
    ;;
  stop)
    if [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      pid="$(cat "$pidfile")"
      kill "$pid"
      for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    echo "dockerd: stopped"
    ;;
  status)
    if answers; then echo "dockerd: running (unix://$sock)"; else echo "dockerd: not running"; exit 1; fi
    ;;
  *)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
