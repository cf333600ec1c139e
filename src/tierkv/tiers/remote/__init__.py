"""L4 remote pool backends, chosen by URL scheme (docs/design.md §10).

``mooncake://`` is Mooncake Store (RDMA where a device is found, TCP
otherwise); ``redis://``, ``rediss://``, ``valkey://`` and
``redis+cluster://`` are any Redis-protocol server or cluster. Both sit
behind ``RemoteTier``, which adds the value trailer, checksum, optional MAC
and the circuit breaker. Backend clients are imported only here, on demand.
"""

from __future__ import annotations

from tierkv.config import L4Config
from tierkv.layout import KVLayout
from tierkv.tiers.remote.base import CircuitBreaker, FailureHook, RemoteTier
from tierkv.tiers.remote.codec import TRAILER_BYTES

__all__ = ["RemoteTier", "open_backend", "open_remote", "trailer_room"]

REDIS_SCHEMES = tuple(s for s in L4Config.SCHEMES if s != "mooncake")  # config names the schemes once


def trailer_room(url: str) -> int:
    """Bytes of room after each block that let ``url``'s client move a value in one piece.

    Mooncake moves registered memory: with room for the 64-byte trailer after
    every block, a value lands in (and leaves) its slot as one transfer
    instead of two (block + trailer), which measured 5-7 % faster over TCP.
    Redis needs none (tierkv reads its replies itself). 0 when no L4 is set.
    """
    return TRAILER_BYTES if url.split("://", 1)[0] == "mooncake" else 0


def open_backend(url: str, timeout_ms: int, value_bytes: int):
    """The raw backend client for ``url`` (no header, no breaker): for the tier and for benchmarks."""
    scheme = url.split("://", 1)[0]
    if scheme in REDIS_SCHEMES:
        from tierkv.tiers.remote.redis import RedisBackend

        return RedisBackend(url, timeout_ms)
    if scheme == "mooncake":
        from tierkv.tiers.remote.mooncake import MooncakeBackend

        return MooncakeBackend(url, timeout_ms, value_bytes)
    raise ValueError(f"l4.url: expected a URL with scheme one of {list(L4Config.SCHEMES)}, got {url!r}")


def open_remote(config: L4Config, layout: KVLayout, on_failure: FailureHook | None = None) -> RemoteTier:
    """The L4 tier for ``config.url``. Connecting is lazy: a pool that is down now is a miss, not an error.

    Raises ValueError for a malformed URL and ImportError (naming the pip
    extra) when the backend's client library is missing.
    """
    backend = open_backend(config.url, config.timeout_ms, layout.block_bytes + TRAILER_BYTES)
    breaker = CircuitBreaker(config.breaker_failures, config.breaker_reset_s)
    return RemoteTier(backend, layout, config.key_prefix, config.auth_key, breaker, on_failure,
                      config.compress, config.compress_level, config.compress_threads)
