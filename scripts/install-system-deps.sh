#!/usr/bin/env bash
# Installs the system packages the tests need, when missing and when we may (root + apt).
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || need+=(libibverbs1)
# pyverbs lists RDMA devices for the Mooncake backend and `tierkv info` (loaded from the system copy).
[ -d /usr/lib/python3/dist-packages/pyverbs ] || need+=(python3-pyverbs)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-system-deps: missing ${need[*]} and cannot apt-get here; the tests that need them will say so" >&2
  exit 0
fi
echo "install-system-deps: apt-get install ${need[*]}"
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
