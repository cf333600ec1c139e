"""L4 remote tier: the value format, the circuit breaker and the BlockTier shell (DESIGN §5, §13).

Every value stored in a remote pool is ``header || payload`` where the 64-byte
header is::

    magic "TKV4" | version u16 | flags u16 | layout fingerprint 8B | key 16B
    | payload length u64 | xxh3_64(payload) u64 | MAC 16B (zeros when no auth key)

With ``l4.auth_key`` set, the MAC is a keyed BLAKE2b-128 over the first 48
header bytes and the payload, so a value written by anyone without the key is
a miss. A value that is foreign, truncated, of another layout or fails its
checksum is a miss too, counted by reason, never wrong KV.

``RemoteTier`` turns a small backend (``exists``/``read``/``write``/``delete``
over string names) into the batched BlockTier protocol. It owns the breaker:
after ``l4.breaker_failures`` failed calls in a row it stops asking the pool
for ``l4.breaker_reset_s`` and then lets one call through as a probe. Nothing
here raises into the caller for a failing pool: every failure is a per-key
False, counted through the store's failure hook and logged once.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import numpy as np
import torch
import xxhash

from tierkv.layout import KVLayout
from tierkv.tiers.base import Lineage, as_bytes, copy_block

MAGIC = b"TKV4"
VERSION = 1
FLAG_MAC = 1
_HEAD = struct.Struct("<4sHH8s16sQQ")  # magic, version, flags, fingerprint, key, length, checksum
MAC_BYTES = 16
_CHUNK = 64 << 10  # verify-and-copy granularity: small enough to stay in L2 between the two passes
HEADER_BYTES = _HEAD.size + MAC_BYTES  # 64: payloads start cache-line aligned
FailureHook = Callable[[str, str, int, str], None]  # (tier, reason, blocks, detail)
_FAILED = object()  # what ``RemoteTier._call`` returns for a skipped or failed call

# Why a value is not usable; each is a failure reason in the store's metrics.
OK, TRUNCATED, FOREIGN, LAYOUT, CORRUPT, UNAUTHENTICATED = (
    "ok", "truncated", "foreign", "layout", "corrupt", "unauthenticated")


class RemoteUnavailable(Exception):
    """The pool did not answer (connection refused, timeout, server error)."""


class ValueCodec:
    """Builds and checks value headers for one layout. Stateless after construction; thread-safe."""

    def __init__(self, layout: KVLayout, auth_key: str = "") -> None:
        self.fingerprint = bytes.fromhex(layout.fingerprint)
        self.payload_bytes = layout.block_bytes
        self.value_bytes = HEADER_BYTES + layout.block_bytes
        self._mac_key = auth_key.encode() if auth_key else b""
        if len(self._mac_key) > 64:
            self._mac_key = hashlib.blake2b(self._mac_key, digest_size=64).digest()

    @property
    def authenticated(self) -> bool:
        return bool(self._mac_key)

    def _mac(self, head: bytes | memoryview, payload: memoryview) -> bytes:
        h = hashlib.blake2b(key=self._mac_key, digest_size=MAC_BYTES)
        h.update(head)
        h.update(payload)
        return h.digest()

    def header(self, key: bytes, payload: memoryview) -> bytes:
        """The 64 header bytes for ``payload`` stored under ``key``."""
        flags = FLAG_MAC if self._mac_key else 0
        head = _HEAD.pack(MAGIC, VERSION, flags, self.fingerprint, key, len(payload),
                          xxhash.xxh3_64_intdigest(payload))
        mac = self._mac(head, payload) if self._mac_key else bytes(MAC_BYTES)
        return head + mac

    def encode_into(self, key: bytes, block: torch.Tensor, out: memoryview) -> None:
        """Write header and payload of ``block`` into ``out`` (``value_bytes`` long)."""
        payload = out[HEADER_BYTES:self.value_bytes]
        dst = torch.frombuffer(payload, dtype=torch.uint8)
        copy_block(dst, block.reshape(-1).view(torch.uint8))
        out[:HEADER_BYTES] = self.header(key, payload)

    def _check_header(self, key: bytes, value: memoryview) -> tuple[str, int, int]:
        """(verdict, flags, checksum) from the header alone; verdict OK means the payload is worth reading."""
        if len(value) < HEADER_BYTES:
            return (TRUNCATED if value[:4] == MAGIC[: len(value)] else FOREIGN), 0, 0
        magic, version, flags, fp, vkey, length, checksum = _HEAD.unpack_from(value)
        if magic != MAGIC or version != VERSION or vkey != key:
            return FOREIGN, 0, 0
        if fp != self.fingerprint or length != self.payload_bytes:
            return LAYOUT, 0, 0
        if len(value) != HEADER_BYTES + length:
            return TRUNCATED, 0, 0
        if self._mac_key and not flags & FLAG_MAC:
            return UNAUTHENTICATED, 0, 0
        return OK, flags, checksum

    def check(self, key: bytes, value: memoryview) -> str:
        """OK when ``value`` is a whole, untampered block of this layout under ``key``; else the reason."""
        return self.verify_into(key, value, None)

    def verify_into(self, key: bytes, value: memoryview, dst: torch.Tensor | None) -> str:
        """``check``, copying the payload into the CPU block ``dst`` on the way (dst undefined unless OK).

        The copy and the checksum (and MAC) run chunk by chunk, so the payload
        is read from memory once: each chunk is hashed while still in cache.
        """
        verdict, _flags, checksum = self._check_header(key, value)
        if verdict != OK:
            return verdict
        payload = value[HEADER_BYTES:]
        digest = xxhash.xxh3_64()
        mac = None
        if self._mac_key:
            mac = hashlib.blake2b(key=self._mac_key, digest_size=MAC_BYTES)
            mac.update(value[:_HEAD.size])
        src = np.frombuffer(value, dtype=np.uint8, offset=HEADER_BYTES) if dst is not None else None
        if dst is not None and dst.numel() * dst.element_size() != len(payload):
            raise ValueError(f"l4 get: {len(payload)} payload bytes for a {dst.numel() * dst.element_size()}-byte block")
        for off in range(0, len(payload), _CHUNK):
            piece = payload[off:off + _CHUNK]
            if src is not None:
                ctypes.memmove(dst.data_ptr() + off, src.ctypes.data + off, len(piece))
            digest.update(piece)
            if mac is not None:
                mac.update(piece)
        if mac is not None and not hmac.compare_digest(mac.digest(), bytes(value[_HEAD.size:HEADER_BYTES])):
            return UNAUTHENTICATED
        return OK if digest.intdigest() == checksum else CORRUPT


class CircuitBreaker:
    """Closed -> open after ``failures`` failed calls in a row; half-open after ``reset_s``.

    While open, ``allow()`` is False, so the pool is not asked at all. After
    ``reset_s`` one caller gets True (the probe); its ``success()`` closes the
    breaker, its ``failure()`` opens it for another ``reset_s``. Thread-safe.
    """

    def __init__(self, failures: int, reset_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = failures
        self.reset_s = reset_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failed = 0
        self._open_until: float | None = None
        self._probing = False
        self.opens = 0

    @property
    def state(self) -> str:
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "half_open" if self._clock() >= self._open_until else "open"

    def allow(self) -> bool:
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or self._clock() < self._open_until:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        with self._lock:
            self._failed = 0
            self._open_until = None
            self._probing = False

    def failure(self) -> None:
        with self._lock:
            self._failed += 1
            if self._probing or self._failed >= self.threshold:
                if self._open_until is None or self._probing:
                    self.opens += 1
                self._open_until = self._clock() + self.reset_s
                self._probing = False


class Deadline:
    """Runs blocking client calls on one worker thread with a wall-clock limit.

    For clients without their own timeouts (Mooncake's RPCs retry for seconds).
    A caller holds the gate from submit until its call has *finished*, even
    when it gave up waiting, so a late call can never touch buffers that a
    newer call uses; callers that cannot get the gate in time fail fast.
    """

    def __init__(self, timeout_s: float, name: str) -> None:
        self.timeout_s = timeout_s
        self._gate = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)

    def run(self, fn: Callable, *args, after: Callable | None = None):
        """``after(fn(*args))`` within the limit, else RemoteUnavailable.

        ``after`` runs on the caller's thread while the gate is still held:
        the place to read buffers the call filled.
        """
        if not self._gate.acquire(timeout=self.timeout_s):
            raise RemoteUnavailable(f"busy: an earlier call is still running after {self.timeout_s:.3f}s")
        fut = self._pool.submit(fn, *args)
        try:
            result = fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            fut.add_done_callback(lambda _f: self._gate.release())
            raise RemoteUnavailable(f"timeout after {self.timeout_s:.3f}s") from None
        except BaseException:
            self._gate.release()
            raise
        try:
            return after(result) if after is not None else result
        finally:
            self._gate.release()

    def close(self, wait_s: float = 5.0) -> bool:
        """Stop the worker once a running call ends (up to ``wait_s``); True when none was left running."""
        idle = self._gate.acquire(timeout=wait_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        return idle


class RemoteBackend(Protocol):
    """What a pool client provides. Names are strings; every call is batched.

    Methods raise RemoteUnavailable, or one of ``errors`` (the client
    library's own), when the pool does not answer; per-name misses are
    reported in the results. Anything else is a bug and propagates.
    """

    url: str
    errors: tuple[type[BaseException], ...]

    def exists(self, names: list[str]) -> list[bool]: ...

    def write(self, names: list[str], header: Callable[[int], bytes], payloads: list[memoryview]) -> list[bool]:
        """Store value i = ``header(i) + payloads[i]``; the payloads stay unchanged until return.

        ``header(i)`` reads payload i once (checksum, MAC): call it just before
        sending payload i, so the send finds the bytes still in cache.
        """

    def read(self, names: list[str], size: int, sink: Callable[[int, memoryview], None]) -> None:
        """Fetch values; ``sink(i, value)`` runs on the caller's thread for each one found (view valid only then).

        ``value`` is None for a value larger than ``size`` (another layout's).
        """

    def delete(self, names: list[str]) -> None: ...

    def info(self) -> dict: ...

    def close(self) -> None: ...


class RemoteTier:
    """L4 as a BlockTier: header, checksum, MAC, breaker and failure accounting over a backend.

    Capacity is the pool's business (it evicts on its own), so ``capacity``
    is unbounded and ``used`` unknown (-1). Methods may be called from any
    thread; they block for at most about the configured timeout and never
    raise for a pool failure.
    """

    name = "l4"

    def __init__(self, backend: RemoteBackend, layout: KVLayout, key_prefix: str, auth_key: str,
                 breaker: CircuitBreaker, on_failure: FailureHook | None = None) -> None:
        self.backend = backend
        self.layout = layout
        self.codec = ValueCodec(layout, auth_key)
        self.breaker = breaker
        self.prefix = key_prefix
        self._on_failure = on_failure or (lambda *a: None)
        self._lock = threading.Lock()
        self.counts = {"calls": 0, "failed_calls": 0, "skipped_calls": 0, "hits": 0, "misses": 0,
                       "bad_values": 0, "bytes_read": 0, "bytes_written": 0}

    @property
    def capacity(self) -> int:
        return 1 << 62

    @property
    def used(self) -> int:
        return -1

    def key_name(self, key: bytes) -> str:
        """The pool's name for ``key``: ``<key_prefix>/<fingerprint>/<hex key>``."""
        return f"{self.prefix}/{self.layout.fingerprint}/{key.hex()}"

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.counts[k] += v

    def _call(self, what: str, n: int, fn: Callable, *args):
        """``fn(*args)`` under the breaker; ``_FAILED`` when skipped or failed (already counted)."""
        if not self.breaker.allow():
            self._count(skipped_calls=1)
            self._on_failure(self.name, "breaker_open", n, f"{self.backend.url}: breaker open, not asking")
            return _FAILED
        self._count(calls=1)
        try:
            out = fn(*args)
        except (RemoteUnavailable, *self.backend.errors) as exc:
            self.breaker.failure()
            self._count(failed_calls=1)
            self._on_failure(self.name, "unavailable", n, f"{self.backend.url} {what}: {exc!r}")
            return _FAILED
        self.breaker.success()
        return out

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: the pool holds a value under its name (not yet verified). One batched call."""
        if not keys:
            return []
        found = self._call("exists", len(keys), self.backend.exists, [self.key_name(k) for k in keys])
        return [False] * len(keys) if found is _FAILED else list(found)

    def put(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
            lineage: Sequence[Lineage] | None = None) -> list[bool]:
        """Store each block with its header. Blocks must be CPU tensors the caller keeps unchanged until return."""
        if not keys:
            return []
        codec = self.codec
        payloads = [as_bytes(b if b.is_contiguous() else b.contiguous()) for b in blocks]
        for p in payloads:
            if len(p) != codec.payload_bytes:
                raise ValueError(f"l4 put: a {len(p)}-byte block for a layout of {codec.payload_bytes} bytes")
        names = [self.key_name(k) for k in keys]
        ok = self._call("write", len(keys), self.backend.write, names,
                        lambda i: codec.header(keys[i], payloads[i]), payloads)
        if ok is _FAILED:
            return [False] * len(keys)
        if not all(ok):
            self._on_failure(self.name, "put_rejected", len(ok) - sum(ok),
                             f"{self.backend.url}: the pool refused {len(ok) - sum(ok)} of {len(ok)} value(s)")
        self._count(bytes_written=sum(ok) * codec.payload_bytes)
        return list(ok)

    def get(self, keys: Sequence[bytes], dst: Sequence[torch.Tensor]) -> list[bool]:
        """Copy each verified block into ``dst[i]``; False for a missing or bad value (dst then undefined)."""
        if not keys:
            return []
        out = [False] * len(keys)
        bad: dict[str, int] = {}
        codec = self.codec

        def sink(i: int, value: memoryview | None) -> None:
            if value is None:
                verdict = LAYOUT
            elif dst[i].device.type == "cpu" and dst[i].is_contiguous():
                verdict = codec.verify_into(keys[i], value, dst[i])
            else:
                verdict = codec.check(keys[i], value)
                if verdict == OK:
                    _copy_payload(dst[i], value)
            if verdict != OK:
                bad[verdict] = bad.get(verdict, 0) + 1
                return
            out[i] = True

        names = [self.key_name(k) for k in keys]
        if self._call("read", len(keys), self.backend.read, names, codec.value_bytes, sink) is _FAILED:
            return out
        for verdict, n in bad.items():
            self._on_failure(self.name, verdict, n, f"{self.backend.url}: {n} value(s) rejected as {verdict}")
        hits = sum(out)
        self._count(hits=hits, misses=len(keys) - hits, bad_values=sum(bad.values()),
                    bytes_read=hits * codec.payload_bytes)
        return out

    def remove(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._call("delete", len(keys), self.backend.delete, [self.key_name(k) for k in keys])

    def stats(self) -> dict:
        """Call counters, breaker state and the backend's own description. Thread-safe snapshot."""
        with self._lock:
            out = dict(self.counts)
        out.update(breaker=self.breaker.state, breaker_opens=self.breaker.opens,
                   authenticated=self.codec.authenticated, **self.backend.info())
        return out

    def close(self) -> None:
        self.backend.close()


def _copy_payload(dst: torch.Tensor, value: memoryview) -> None:
    """Copy the payload of a verified value (possibly read-only bytes) into a block on any device."""
    src = np.frombuffer(value, dtype=np.uint8, offset=HEADER_BYTES)
    n = dst.numel() * dst.element_size()
    if n != src.nbytes:
        raise ValueError(f"l4 get: {src.nbytes} payload bytes for a {n}-byte block")
    if dst.device.type == "cpu" and dst.is_contiguous():
        ctypes.memmove(dst.data_ptr(), src.ctypes.data, n)
    else:
        dst.copy_(torch.from_numpy(src.copy()).view(dst.dtype).view(dst.shape))
