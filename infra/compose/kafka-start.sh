#!/usr/bin/env bash
# The entry point of infra/compose/kafka.Dockerfile: the broker's settings as infra/kafka.sh writes
# them (combined broker and controller, one node; infra/kafka/broker.properties), its storage formatted
# on first start, then the broker. KAFKA_ADVERTISED_HOST: the name clients reach it by (compose: kafka).
set -euo pipefail
host="${KAFKA_ADVERTISED_HOST:-kafka}"
data=/var/lib/kafka/data
config=/opt/kafka/config
mkdir -p "$data" /var/lib/kafka/logs
cat > "$config/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@localhost:9093
listeners=PLAINTEXT://:9092,CONTROLLER://localhost:9093
advertised.listeners=PLAINTEXT://$host:9092
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$data
PROPS
cat "$config/broker.properties" >> "$config/server.properties"
opts=(-Xms256m "-Xmx${KAFKA_HEAP_MB:-1024}m" -XX:+UseG1GC -Djava.awt.headless=true
      "-Dlog4j2.configurationFile=$config/log4j2.yaml" -Dkafka.logs.dir=/var/lib/kafka/logs)
cp='/opt/kafka/libs/*'
if [[ ! -f "$data/meta.properties" ]]; then
  java -cp "$cp" kafka.tools.StorageTool format -t "$(java -cp "$cp" kafka.tools.StorageTool random-uuid | tail -1)" \
    -c "$config/server.properties"
fi
exec java "${opts[@]}" -cp "$cp" kafka.Kafka "$config/server.properties"
