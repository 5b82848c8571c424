#!/usr/bin/env bash
# Prints the Debian mirror to bootstrap SUITE from (default bookworm): ROLLSTREAM_DEBIAN_MIRROR when
# set, else the one apt already uses on this machine, else deb.debian.org.
#
#   infra/debian-mirror.sh bookworm
set -euo pipefail
suite="${1:-bookworm}"

# The mirror apt already uses on this machine (deb822 .sources or one-line .list entries),
# skipping the security archive, which has no full suite to bootstrap from.
find_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f "$f" ]] || continue
    awk -v s="$suite" '
      /^URIs:/ {u=$2} /^Suites:/ {ok=0; for (i=2;i<=NF;i++) if ($i==s) ok=1}
      /^$/ {if (ok && u !~ /security/) {print u; exit} ok=0; u=""}
      END {if (ok && u !~ /security/) print u}' "$f"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -f "$f" ]] || continue
    awk -v s="$suite" '$1=="deb" && $3==s && $2 !~ /security/ {print $2}' "$f"
  done
}
mirror="${ROLLSTREAM_DEBIAN_MIRROR:-$(find_mirror | head -n1)}"
echo "${mirror:-http://deb.debian.org/debian}"
