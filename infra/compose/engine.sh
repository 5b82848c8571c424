#!/usr/bin/env bash
# A private Docker engine for the compose stack, under the repo's .run/compose-engine folder.
#
#   infra/compose/engine.sh start    # installs docker.io if missing; socket .run/compose-engine/docker.sock
#   infra/compose/engine.sh status   # exit 0 when the engine answers
#   infra/compose/engine.sh stop
#   export DOCKER_HOST=unix://$PWD/.run/compose-engine/docker.sock   # then docker / docker-compose use it
#
# Unlike the OS-task sandboxes' engine (infra/sandbox/dockerd.sh: no network at all), this one gives
# compose's project network its NAT, so containers reach each other by service name and builds reach
# the package registries. No default bridge (docker0): a system Docker on the same machine keeps its
# own; builds use the host's network instead (docker-compose.yml's build sections say network: host).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
exec "$repo/infra/private-dockerd.sh" "compose engine" "$repo/.run/compose-engine" "${1:-}" --bridge none
