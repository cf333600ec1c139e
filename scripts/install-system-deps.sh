#!/usr/bin/env bash
# Installs the system packages the tests need, when missing and when we may (root + apt).
# Under CI (CI=1 or TIERKV_REQUIRE_SERVERS=1) a package that cannot be installed is an error:
# the tests that need it would fail anyway, and this says why first.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || need+=(libibverbs1)
# pyverbs lists RDMA devices for the Mooncake backend and `tierkv info` (loaded from the system copy).
[ -d /usr/lib/python3/dist-packages/pyverbs ] || need+=(python3-pyverbs)
# A C compiler builds the native helpers (tierkv.native); openssl makes the redis TLS test's certificate.
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
[ ${#need[@]} -eq 0 ] && exit 0
strict=0
if [ "${CI:-}" = 1 ] || [ "${CI:-}" = true ] || [ "${TIERKV_REQUIRE_SERVERS:-}" = 1 ]; then strict=1; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  if [ $strict = 1 ]; then
    echo "install-system-deps: missing ${need[*]} and cannot apt-get here (needs root and apt-get); CI needs them" >&2
    exit 1
  fi
  echo "install-system-deps: missing ${need[*]} and cannot apt-get here; the tests that need them will say so" >&2
  exit 0
fi
echo "install-system-deps: apt-get install ${need[*]}"
if ! { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; }; then
  echo "install-system-deps: apt-get install ${need[*]} failed" >&2
  [ $strict = 1 ] && exit 1
  exit 0
fi
for cmd in redis-server cc openssl; do
  if ! command -v $cmd >/dev/null 2>&1; then
    echo "install-system-deps: $cmd still missing after apt-get" >&2
    [ $strict = 0 ] || exit 1
  fi
done
