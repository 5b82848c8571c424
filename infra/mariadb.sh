#!/usr/bin/env bash
# A private MariaDB server for the db family's MySQL backend (EnvSettings.db_backend = "mysql"),
# run as the invoking user from its own data directory under .run/mariadb, on 127.0.0.1 only.
#
#   infra/mariadb.sh start    # installs mariadb-server if missing; creates the data directory once
#   infra/mariadb.sh status   # exit 0 when the server answers
#   infra/mariadb.sh stop
#
# Nothing system-wide is configured: --no-defaults keeps /etc/mysql out, and Debian's own service is
# neither started nor changed. The admin account $MARIADB_USER / $MARIADB_PASSWORD (env.sh) is the
# one the environments use to create and drop per-session databases and users.
# Idempotent: start on a running server and stop on a stopped one do nothing.
set -euo pipefail
source "$(dirname "$0")/env.sh"

DIR="$ROLLSTREAM_RUN/mariadb"
DATA="$DIR/data"
PIDFILE="$DIR/mariadbd.pid"
# Where LOAD_FILE / INTO OUTFILE may reach even with the FILE privilege (no session has it): an empty folder.
FILES="$DIR/files"

answers() { mariadb-admin --no-defaults --socket="$MARIADB_SOCKET" --connect-timeout=2 ping >/dev/null 2>&1; }

install() {
  command -v mariadbd >/dev/null && command -v mariadb-install-db >/dev/null && command -v eatmydata >/dev/null \
    && return 0
  local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
  log "installing Debian packages mariadb-server eatmydata"
  $sudo apt-get update -qq >&2 || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends mariadb-server eatmydata >&2 \
    || die "could not install mariadb-server and eatmydata; install them by hand"
}

# SQL run as the data directory's owner (unix_socket authentication) once the server answers:
# the admin account, and no anonymous accounts that would shadow per-session users on localhost.
bootstrap_sql() {
  local user=$MARIADB_USER pass=${MARIADB_PASSWORD//\'/\'\'} host
  for host in localhost 127.0.0.1; do
    echo "CREATE USER IF NOT EXISTS '$user'@'$host' IDENTIFIED BY '$pass';"
    echo "ALTER USER '$user'@'$host' IDENTIFIED BY '$pass';"
    echo "GRANT ALL PRIVILEGES ON *.* TO '$user'@'$host' WITH GRANT OPTION;"
  done
  echo "DELETE FROM mysql.global_priv WHERE User = '';"
  echo "DROP DATABASE IF EXISTS test;"
  echo "FLUSH PRIVILEGES;"
}

start() {
  if answers; then log "MariaDB already running on $MARIADB_HOST:$MARIADB_PORT (socket $MARIADB_SOCKET)"; return 0; fi
  if port_open "$MARIADB_HOST" "$MARIADB_PORT"; then die "port $MARIADB_HOST:$MARIADB_PORT is taken by another process; set MARIADB_PORT"; fi
  install
  mkdir -p "$DIR" "$FILES" "$(dirname "$MARIADB_SOCKET")"
  local as_user=(); [ "$(id -u)" -eq 0 ] && as_user=(--user=root)  # mariadbd refuses root unless told
  if [ ! -d "$DATA/mysql" ]; then
    log "creating the MariaDB data directory $DATA"
    rm -rf "$DATA"
    mariadb-install-db --no-defaults --datadir="$DATA" "${as_user[@]}" --auth-root-authentication-method=socket \
      --skip-test-db > "$DIR/install.log" 2>&1 || { tail -20 "$DIR/install.log" >&2; die "mariadb-install-db failed"; }
  fi
  log "starting MariaDB on $MARIADB_HOST:$MARIADB_PORT (data: $DATA)"
  # Scratch databases only: durability is traded for speed. Every session creates and drops a
  # database, and MariaDB syncs each DDL to disk (20-40 ms on a busy disk); eatmydata turns those
  # fsyncs into no-ops (a crash may lose the data directory: delete it, the next start makes it anew).
  # local_infile off, and secure_file_priv pinned to an empty folder.
  setsid nohup eatmydata mariadbd --no-defaults "${as_user[@]}" --datadir="$DATA" --pid-file="$PIDFILE" \
    --socket="$MARIADB_SOCKET" --port="$MARIADB_PORT" --bind-address="$MARIADB_HOST" --skip-name-resolve \
    --max-connections=300 --character-set-server=utf8mb4 --collation-server=utf8mb4_unicode_520_ci \
    --local-infile=0 --secure-file-priv="$FILES" --skip-log-bin \
    --innodb-buffer-pool-size=64M --innodb-flush-log-at-trx-commit=0 --innodb-doublewrite=0 \
    --log-error="$DIR/mariadbd.log" > /dev/null 2>&1 < /dev/null &
  local i
  for i in $(seq 1 120); do
    if answers; then
      bootstrap_sql | mariadb --no-defaults --socket="$MARIADB_SOCKET" -u "$(id -un)" \
        || die "could not set up the admin account (see $DIR/mariadbd.log)"
      log "MariaDB answers on $MARIADB_HOST:$MARIADB_PORT"
      return 0
    fi
    sleep 0.5
  done
  tail -40 "$DIR/mariadbd.log" >&2; die "MariaDB did not answer within 60 s"
}

case "${1:-}" in
  start) start ;;
  stop) stop_pid "$PIDFILE" MariaDB ;;
  status) answers && echo "mariadb: running on $MARIADB_HOST:$MARIADB_PORT" || { echo "mariadb: stopped"; exit 1; } ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
