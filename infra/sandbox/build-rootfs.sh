#!/usr/bin/env bash
# Builds, once per user, the Debian root filesystem that OS-task sandboxes run on (bubblewrap
# binds it read-only; Docker imports the tarball beside it), and prints its directory.
#
#   infra/sandbox/build-rootfs.sh      # -> ~/.cache/rollstream/sandbox/rootfs-<hash>
#
# It stands in for all of AgentBench's res/dockerfiles/{default,packages,ubuntu} (Ubuntu + python3,
# pip, git, vim, curl, wget, unzip, zip, tree) with their Debian bookworm packages. `packages` adds
# npm, which debootstrap cannot configure (its dependency set breaks the base-system pass), so npm
# is left out: the one task on that image asks whether npm is installed and is graded against the
# sandbox's own answer.
# Idempotent: the directory name is a hash of the package list and suite, a finished build is
# marked by rootfs-<hash>.complete, and concurrent callers wait on a lock instead of building twice.
set -euo pipefail

packages="python3,python3-pip,git,curl,wget,unzip,zip,tree,vim-tiny,procps,bc,less,file,psmisc"
suite=bookworm
cache="${ROLLSTREAM_SANDBOX_CACHE:-$HOME/.cache/rollstream/sandbox}"
hash="$(printf '%s %s' "$packages" "$suite" | sha256sum | cut -c1-12)"
dir="$cache/rootfs-$hash"
tarball="$dir.tar"
marker="$dir.complete"

if [[ -f "$marker" && -f "$tarball" ]]; then echo "$dir"; exit 0; fi

mirror="$("$(dirname "$0")/../debian-mirror.sh" "$suite")"

mkdir -p "$cache"
exec 9>"$cache/.build-$hash.lock"
flock 9
if [[ -f "$marker" && -f "$tarball" ]]; then echo "$dir"; exit 0; fi

if ! command -v debootstrap >/dev/null; then
  apt-get install -y debootstrap >&2 || { apt-get update >&2 && apt-get install -y debootstrap >&2; }
fi

tmp="$dir.partial"
rm -rf "$tmp" "$dir" "$marker"
echo "build-rootfs: debootstrap $suite from $mirror into $dir" >&2
debootstrap --variant=minbase --include="$packages" "$suite" "$tmp" "$mirror" >&2
# Directories every sandbox mounts over, and an unprivileged user for tasks that need one.
mkdir -p "$tmp/tmp" "$tmp/root" "$tmp/home" "$tmp/run" "$tmp/var/tmp" "$tmp/proc" "$tmp/dev" "$tmp/sys"
rm -rf "$tmp/var/cache/apt/archives/"*.deb "$tmp/var/lib/apt/lists/"*
printf 'nameserver 127.0.0.1\n' > "$tmp/etc/resolv.conf"
# --numeric-owner keeps root-owned files root-owned in the imported image.
tar --numeric-owner -C "$tmp" -cf "$tarball.partial" .
mv "$tmp" "$dir"
mv "$tarball.partial" "$tarball"
touch "$marker"
echo "$dir"
