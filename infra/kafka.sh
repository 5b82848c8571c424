#!/usr/bin/env bash
# A real single-node Apache Kafka broker (KRaft, combined broker+controller) on Java 17, without
# Docker. Usage: infra/kafka.sh fetch|start|stop|status
set -euo pipefail
source "$(dirname "$0")/env.sh"

LIBS="$ROLLSTREAM_CACHE/kafka-$KAFKA_VERSION/libs"
DIR="$ROLLSTREAM_RUN/kafka"
PIDFILE="$DIR/kafka.pid"

fetch() {
  [ -f "$LIBS/.complete" ] && return 0
  command -v mvn >/dev/null || die "Maven is needed to fetch the Kafka jars"
  log "fetching Apache Kafka $KAFKA_VERSION jars with Maven into $LIBS (once per user)"
  rm -rf "$LIBS"; mkdir -p "$LIBS"
  mvn -B -q -Dstyle.color=never -f "$ROLLSTREAM_ROOT/infra/kafka/pom.xml" -Dkafka.version="$KAFKA_VERSION" \
    dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$LIBS" >&2
  ls "$LIBS"/kafka_2.13-"$KAFKA_VERSION".jar >/dev/null || die "Maven did not deliver kafka_2.13-$KAFKA_VERSION.jar"
  touch "$LIBS/.complete"
}

write_config() {
  mkdir -p "$DIR/data" "$DIR/logs"
  cat > "$DIR/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$KAFKA_HOST:$KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://$KAFKA_HOST:$KAFKA_PORT,CONTROLLER://$KAFKA_HOST:$KAFKA_CONTROLLER_PORT,SASL_PLAINTEXT://$KAFKA_HOST:$KAFKA_SASL_PORT
advertised.listeners=PLAINTEXT://$KAFKA_HOST:$KAFKA_PORT,SASL_PLAINTEXT://$KAFKA_HOST:$KAFKA_SASL_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT
# A second client listener that authenticates with SASL/SCRAM, as a secured cluster does. Its users are
# SCRAM credentials in the cluster's metadata (kafka-configs.sh or the Admin API's
# alterUserScramCredentials); there are none until someone creates them, so nobody gets in by default.
sasl.enabled.mechanisms=SCRAM-SHA-256,SCRAM-SHA-512
listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
log.dirs=$DIR/data
PROPS
  cat "$ROLLSTREAM_ROOT/infra/kafka/broker.properties" >> "$DIR/server.properties"
}

start() {
  if pid_alive "$PIDFILE"; then
    log "Kafka already running (pid $(cat "$PIDFILE")) on $KAFKA_HOST:$KAFKA_PORT"
    port_open "$KAFKA_HOST" "$KAFKA_SASL_PORT" ||
      log "note: it has no SCRAM listener on $KAFKA_HOST:$KAFKA_SASL_PORT (started by an older version?): infra/down.sh, then up again, opens it"
    return 0
  fi
  if port_open "$KAFKA_HOST" "$KAFKA_PORT"; then die "port $KAFKA_HOST:$KAFKA_PORT is taken by another process; set KAFKA_PORT"; fi
  fetch
  write_config
  local cp="$LIBS/*"
  local log4j="$ROLLSTREAM_ROOT/infra/kafka/log4j2.yaml"
  local java_opts=(-Xms256m "-Xmx${KAFKA_HEAP_MB}m" -XX:+UseG1GC -Djava.awt.headless=true
                   "-Dlog4j2.configurationFile=$log4j" "-Dkafka.logs.dir=$DIR/logs")
  if [ ! -f "$DIR/data/meta.properties" ]; then
    log "formatting KRaft storage in $DIR/data"
    java "${java_opts[@]}" -cp "$cp" kafka.tools.StorageTool format \
      -t "$(java -cp "$cp" kafka.tools.StorageTool random-uuid 2>/dev/null | tail -1)" \
      -c "$DIR/server.properties" > "$DIR/logs/format.log" 2>&1 || { cat "$DIR/logs/format.log" >&2; die "formatting Kafka storage failed"; }
  fi
  log "starting Apache Kafka $KAFKA_VERSION on $KAFKA_HOST:$KAFKA_PORT (logs: $DIR/logs)"
  setsid nohup java "${java_opts[@]}" -cp "$cp" kafka.Kafka "$DIR/server.properties" \
    > "$DIR/logs/stdout.log" 2>&1 < /dev/null &
  echo $! > "$PIDFILE"
  local i
  for i in $(seq 1 120); do
    if port_open "$KAFKA_HOST" "$KAFKA_PORT"; then log "Kafka answers on $KAFKA_HOST:$KAFKA_PORT"; return 0; fi
    pid_alive "$PIDFILE" || { tail -40 "$DIR/logs/stdout.log" >&2; die "Kafka exited during start-up"; }
    sleep 0.5
  done
  tail -40 "$DIR/logs/stdout.log" >&2; die "Kafka did not open $KAFKA_HOST:$KAFKA_PORT within 60 s"
}

case "${1:-}" in
  fetch) fetch ;;
  start) start ;;
  stop) stop_pid "$PIDFILE" Kafka ;;
  status) pid_alive "$PIDFILE" && echo "kafka: running (pid $(cat "$PIDFILE")) on $KAFKA_HOST:$KAFKA_PORT" || { echo "kafka: stopped"; exit 1; } ;;
  *) echo "usage: $0 fetch|start|stop|status" >&2; exit 2 ;;
esac
