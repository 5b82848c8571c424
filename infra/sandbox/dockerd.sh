#!/usr/bin/env bash
# A private Docker engine for OS-task sandboxes, under the repo's .run/dockerd folder, with no network
# at all (no bridge, no NAT): sandboxes run with --network none.
#
#   infra/sandbox/dockerd.sh start    # installs docker.io if missing; socket .run/dockerd/docker.sock
#   infra/sandbox/dockerd.sh status   # exit 0 when the engine answers
#   infra/sandbox/dockerd.sh stop
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
exec "$repo/infra/private-dockerd.sh" dockerd "$repo/.run/dockerd" "${1:-}" \
  --bridge none --iptables=false --ip6tables=false
