# A single-node Apache Kafka broker (KRaft) built from the same Maven-fetched jars as infra/setup.sh, for
# machines that cannot pull the official apache/kafka image (infra/compose/local-images.yml). Build
# context: the repository root, after `make docker-context` (the jars, the extra CA certificates).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
COPY .docker-context/ca-certificates/ /usr/local/share/ca-certificates/
RUN (update-ca-certificates || true) \
    && apt-get update && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/*
COPY .docker-context/kafka-libs/ /opt/kafka/libs/
COPY infra/kafka/log4j2.yaml infra/kafka/broker.properties /opt/kafka/config/
COPY infra/compose/kafka-start.sh /opt/kafka/start.sh
VOLUME /var/lib/kafka
EXPOSE 9092
ENTRYPOINT ["/opt/kafka/start.sh"]
