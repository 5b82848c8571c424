# MinIO built from source at the same pinned version infra/minio.sh builds. MinIO stopped
# publishing community images in October 2025 and removed them from Docker Hub in September 2026;
# building from source keeps compose and the local scripts on one version.
FROM golang:1.24-bookworm AS build
ARG MINIO_VERSION=v0.0.0-20260212201848-7aac2a2c5b7c
RUN CGO_ENABLED=0 GOBIN=/out go install "github.com/minio/minio@${MINIO_VERSION}"
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends curl ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/minio /usr/local/bin/minio
ENTRYPOINT ["minio"]
