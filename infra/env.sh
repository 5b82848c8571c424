# Shared settings of the local infrastructure scripts. Sourced, never run.
# Every value can be overridden from the environment; these are the documented local defaults.
ROLLSTREAM_ROOT="${ROLLSTREAM_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
# Per-user cache: jars and binaries survive a fresh clone on the same machine.
ROLLSTREAM_CACHE="${ROLLSTREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollstream}"
# Per-checkout run folder (ignored by git): data, logs and pid files of the services.
ROLLSTREAM_RUN="${ROLLSTREAM_RUN:-$ROLLSTREAM_ROOT/.run}"
ROLLSTREAM_SHARED="${ROLLSTREAM_SHARED:-$ROLLSTREAM_ROOT/../shared}"

KAFKA_VERSION="${KAFKA_VERSION:-4.1.1}"
KAFKA_HOST="${KAFKA_HOST:-127.0.0.1}"
KAFKA_PORT="${KAFKA_PORT:-9092}"
KAFKA_CONTROLLER_PORT="${KAFKA_CONTROLLER_PORT:-9093}"
# The broker's SASL/SCRAM listener (security_protocol SASL_PLAINTEXT); 9092 stays unauthenticated for local work.
KAFKA_SASL_PORT="${KAFKA_SASL_PORT:-9094}"
KAFKA_HEAP_MB="${KAFKA_HEAP_MB:-768}"

# MinIO's repository tags releases with RELEASE.* names, which Go cannot use: pin the
# pseudo-version of the last commit the module proxy serves.
MINIO_VERSION="${MINIO_VERSION:-v0.0.0-20260212201848-7aac2a2c5b7c}"
MINIO_HOST="${MINIO_HOST:-127.0.0.1}"
MINIO_PORT="${MINIO_PORT:-9000}"
MINIO_CONSOLE_PORT="${MINIO_CONSOLE_PORT:-9001}"
export MINIO_ROOT_USER="${MINIO_ROOT_USER:-rollstream}"
export MINIO_ROOT_PASSWORD="${MINIO_ROOT_PASSWORD:-rollstream-local-secret}"

# The db family's MySQL backend (infra/mariadb.sh): a private server, not Debian's service on 3306.
MARIADB_HOST="${MARIADB_HOST:-127.0.0.1}"
MARIADB_PORT="${MARIADB_PORT:-3307}"
MARIADB_SOCKET="${MARIADB_SOCKET:-$ROLLSTREAM_RUN/mariadb/mariadb.sock}"
MARIADB_USER="${MARIADB_USER:-rollstream}"
MARIADB_PASSWORD="${MARIADB_PASSWORD:-rollstream-local-secret}"

PYTHON="${PYTHON:-python3.11}"
VENV="${VENV:-$ROLLSTREAM_ROOT/.venv}"

log() { printf '[rollstream] %s\n' "$*" >&2; }
die() { printf '[rollstream] error: %s\n' "$*" >&2; exit 1; }

# pid_alive FILE: the process named in FILE is running.
pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# port_open HOST PORT: something accepts TCP connections there.
port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

# stop_pid FILE NAME: TERM, wait up to 20 s, then KILL; removes FILE.
stop_pid() {
  local file=$1 name=$2 pid i
  if ! pid_alive "$file"; then rm -f "$file"; return 0; fi
  pid=$(cat "$file")
  log "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then log "$name did not stop in 20 s: killing"; kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$file"
}
