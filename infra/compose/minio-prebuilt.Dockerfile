# MinIO from the binary infra/minio.sh built from source on this machine (the same pinned version as
# infra/minio.Dockerfile builds), for machines that cannot pull the Go toolchain image
# (infra/compose/local-images.yml). Build context: the repository root, after `make docker-context`.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends curl ca-certificates && rm -rf /var/lib/apt/lists/*
COPY .docker-context/minio/minio /usr/local/bin/minio
ENTRYPOINT ["minio"]
