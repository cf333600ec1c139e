"""L4 remote tier: the circuit breaker, the call deadline and the BlockTier shell (docs/design.md §10, §15).

The value format (block + 64-byte trailer, checksum, optional MAC) lives in
``codec.py``. ``RemoteTier`` turns a small backend (``exists``/``read_into``/
``write``/``delete`` over string names) into the batched BlockTier protocol.
It owns the breaker: after ``l4.breaker_failures`` failed calls in a row it
stops asking the pool for ``l4.breaker_reset_s`` and then lets one call
through as a probe. Nothing here raises into the caller for a failing pool:
every failure is a per-key False, counted through the store's failure hook
and logged once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import torch

from tierkv.compress import AutoChooser, BlockCodec
from tierkv.layout import KVLayout
from tierkv.tiers.base import FailureHook, Lineage, as_bytes
from tierkv.tiers.remote.codec import CORRUPT, OK, ValueCodec

Landed = Callable[[int, int, bytes], None]  # (index, length, tail): value ``index`` is in its block
_FAILED = object()  # what ``RemoteTier._call`` returns for a skipped or failed call


class RemoteUnavailable(Exception):
    """The pool did not answer (connection refused, timeout, server error)."""


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

    def write(self, names: list[str], trailer: Callable[[int], bytes], blocks: list[torch.Tensor]) -> list[bool]:
        """Store value i = bytes of ``blocks[i]`` + ``trailer(i)``; the blocks stay unchanged until return.

        Blocks are contiguous CPU tensors. ``trailer(i)`` reads block i once
        (checksum, MAC): call it right after sending block i, or just before,
        so it finds the bytes in cache.
        """

    def read_into(self, names: list[str], blocks: list[torch.Tensor],
                  landed: Landed | None = None) -> list[tuple[int, bytes]]:
        """Fetch value i: its payload into ``blocks[i]``, its last TRAILER_BYTES into the returned ``tail``.

        Blocks are contiguous CPU tensors. Per name ``(length, tail)``:
        ``length`` is the stored value's size, -1 when the name is missing
        (``tail`` then empty). A shorter value (a compressed block) may land
        its first ``length - TRAILER_BYTES`` bytes at the start of ``blocks[i]``
        (Redis does; Mooncake values have one size). When ``length`` is not
        ``block bytes + TRAILER_BYTES``, the rest of ``blocks[i]`` is undefined
        and ``tail`` holds what the backend could read of the value's last
        bytes (nothing for a value larger than it can hold). Returns only once
        nothing more will be written into ``blocks``.

        ``landed(i, length, tail)``, when given, may be called on the calling
        thread as soon as value i is complete, with what the result will hold
        for it, so the caller can check it while it is still in cache. A
        backend that lands a batch in one transfer need not call it; the
        caller checks whatever was not reported once this returns.
        """

    def register(self, ptr: int, nbytes: int, slot_bytes: int = 0) -> None:
        """Tell the client that ``[ptr, ptr + nbytes)`` will be a source or destination, so it can
        move data there without staging (RDMA/TCP registration). The memory must outlive the
        backend. ``slot_bytes`` > 0: the memory is slots of that size, each a block followed by
        room the backend may write a trailer into. A no-op for clients that need none."""

    def unregister(self, ptr: int) -> None:
        """Undo ``register`` of the memory at ``ptr`` before it is freed. A no-op where ``register`` is one."""

    def delete(self, names: list[str]) -> None: ...

    def info(self) -> dict: ...

    def close(self) -> None: ...


class RemoteTier:
    """L4 as a BlockTier: trailer, checksum, MAC, breaker and failure accounting over a backend.

    Capacity is the pool's business (it evicts on its own), so ``capacity``
    is unbounded and ``used`` unknown (-1). Methods may be called from any
    thread; they block for at most about the configured timeout and never
    raise for a pool failure. ``compress`` (``l4.compress``): as L3's; a
    compressed value is read whatever the setting.
    """

    name = "l4"

    def __init__(self, backend: RemoteBackend, layout: KVLayout, key_prefix: str, auth_key: str,
                 breaker: CircuitBreaker, on_failure: FailureHook | None = None, compress: str = "off",
                 compress_level: int = 1, compress_threads: int = 1) -> None:
        self.backend = backend
        self.layout = layout
        self.codec = ValueCodec(layout, auth_key)
        self.breaker = breaker
        self.prefix = key_prefix
        self._name_prefix = f"{key_prefix}/{layout.fingerprint}/"
        self._on_failure = on_failure or (lambda *a: None)
        self._lock = threading.Lock()
        # With a MAC, half of a batch's BLAKE2b passes run here (hashlib releases the GIL): 1.9x
        # measured on 2 cores. Without one, xxh3 is too cheap to be worth a thread hop.
        self._mac_helper = ThreadPoolExecutor(1, thread_name_prefix="tierkv-l4-mac") if auth_key else None
        self.counts = {"calls": 0, "failed_calls": 0, "skipped_calls": 0, "hits": 0, "misses": 0,
                       "bad_values": 0, "bytes_read": 0, "bytes_written": 0, "stored_bytes_written": 0,
                       "coded_hits": 0}
        self.compress = compress
        self._codec = (BlockCodec(layout.itemsize, layout.block_bytes, compress_level, compress_threads)
                       if compress != "off" else None)
        self._auto = AutoChooser(self._codec) if compress == "auto" else None
        self._codec_read: BlockCodec | None = None

    @property
    def capacity(self) -> int:
        return 1 << 62

    @property
    def used(self) -> int:
        return -1

    def view(self, key: bytes) -> None:
        """Never: the bytes are remote (``get`` fetches them)."""
        return None

    def key_name(self, key: bytes) -> str:
        """The pool's name for ``key``: ``<key_prefix>/<fingerprint>/<hex key>``."""
        return self._name_prefix + key.hex()

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

    def _cpu_blocks(self, what: str, blocks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The blocks as contiguous CPU tensors of the layout's size (a bounce copy where they are not)."""
        out, size = [], self.codec.payload_bytes
        for b in blocks:
            if b.nbytes != size:
                raise ValueError(f"l4 {what}: a {b.nbytes}-byte block for a layout of {size} bytes")
            out.append(b if b.is_cpu and b.is_contiguous() else torch.empty(b.shape, dtype=b.dtype))
        return out

    def put(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
            lineage: Sequence[Lineage] | None = None) -> list[bool]:
        """Store each block with its trailer. The caller keeps the blocks unchanged until return."""
        if not keys:
            return []
        codec = self.codec
        src = self._cpu_blocks("put", blocks)
        for s, b in zip(src, blocks):
            if s is not b:
                s.copy_(b)
        names = [self.key_name(k) for k in keys]
        src, coded = self._encode(src)
        if self._mac_helper is not None:  # the MAC is the cost: compute the trailers on two threads first
            trailers = self._map_halves(lambda i: codec.trailer(keys[i], src[i], coded[i]), len(keys))
            trailer = trailers.__getitem__
        else:
            trailer = lambda i: codec.trailer(keys[i], src[i], coded[i])  # noqa: E731 - built when asked
        ok = self._call("write", len(keys), self.backend.write, names, trailer, src)
        if ok is _FAILED:
            return [False] * len(keys)
        if not all(ok):
            self._on_failure(self.name, "put_rejected", len(ok) - sum(ok),
                             f"{self.backend.url}: the pool refused {len(ok) - sum(ok)} of {len(ok)} value(s)")
        self._count(bytes_written=sum(ok) * codec.payload_bytes,
                    stored_bytes_written=sum(s.nbytes for s, good in zip(src, ok) if good))
        return list(ok)

    def _encode(self, blocks: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
        """The payloads to store (a block, or its compressed bytes) and each one's compress flags.
        ``auto`` while off codes a sample block now and then instead (its ratio and decode time)."""
        if self._codec is None:
            return blocks, [0] * len(blocks)
        views = [as_bytes(b) for b in blocks]
        if self._auto is not None and not self._auto.choice.on:
            if views and self._auto.needs_samples():
                self._auto.sample(views[0])
            return blocks, [0] * len(blocks)
        stored = self._codec.encode_many(views)
        out = [b if c is None else torch.frombuffer(bytearray(c), dtype=torch.uint8) for b, c in zip(blocks, stored)]
        return out, [0 if c is None else self._codec.flags for c in stored]

    def register(self, memory: torch.Tensor, room: int = 0) -> None:
        """Register a long-lived CPU pool of blocks (the store's L1 pool, L2 slab), ``memory[i]``
        one block, that blocks are put from and got into, so the backend moves them without
        staging copies. The caller keeps it alive until ``close``.

        ``room``: the pool keeps that many bytes free after every block (``SlotPool``'s
        ``slot_room``) and lets the tier write there: a backend may then land a whole value,
        block and trailer, in one piece. Pass it only for memory whose room no block uses.
        A CUDA tensor is ignored (its blocks travel through CPU bounce buffers), as is a pool
        whose blocks are not each contiguous.
        """
        if memory.device.type != "cpu" or memory.dim() < 2 or not len(memory) or not memory[0].is_contiguous():
            return
        slot = memory.stride(0) * memory.element_size()
        block = memory[0].numel() * memory.element_size()
        if room and slot != block + room:
            raise ValueError(f"l4 register: room={room} needs slots of {block + room} bytes, these are {slot}")
        try:
            nbytes = (memory.shape[0] - 1) * slot + block + room  # the last slot's room included
            self.backend.register(memory.data_ptr(), nbytes, slot if room else 0)
        except (RemoteUnavailable, *self.backend.errors) as exc:  # its blocks are staged instead
            self._on_failure(self.name, "register", 0, f"{self.backend.url}: {exc!r}")

    def unregister(self, memory: torch.Tensor) -> None:
        """Undo ``register(memory)`` before the memory is freed; no call moving data there may be
        running. Its blocks go through staging afterwards. Never raises for a pool failure."""
        if memory.device.type != "cpu" or not memory.numel():
            return
        try:
            self.backend.unregister(memory.data_ptr())
        except (RemoteUnavailable, *self.backend.errors) as exc:
            self._on_failure(self.name, "register", 0, f"{self.backend.url}: {exc!r}")

    def get(self, keys: Sequence[bytes], dst: Sequence[torch.Tensor]) -> list[bool]:
        """Copy each verified block into ``dst[i]``; False for a missing or bad value (dst then undefined).

        A contiguous CPU block receives the payload directly (from the socket,
        or by the transfer engine when it lies in registered memory) and is
        verified in place; other blocks (CUDA, strided) go through a CPU bounce.
        """
        if not keys:
            return []
        codec = self.codec
        blocks = self._cpu_blocks("get", dst)
        names = [self.key_name(k) for k in keys]
        early: dict[int, str | None] = {}  # verdicts reached while the batch was still arriving

        decoded: set[int] = set()  # compressed values decoded as they landed

        def landed(i: int, length: int, tail: bytes) -> None:
            verdict = None if length < 0 else codec.verify(keys[i], length, tail, blocks[i])
            if verdict == OK and codec.coded(tail):
                # Decoded now, while the next values are still on their way (and this one in cache).
                decoded.add(i)
                verdict = OK if self._decode_one(blocks[i], tail) else CORRUPT
            early[i] = verdict

        # Without a MAC the xxh3 pass is cheapest on a block that just arrived (it is still in
        # cache): measured 1.15-1.20x a pass over the whole batch afterwards, on Redis. With one,
        # the BLAKE2b passes are the cost and run on two threads once the batch is in.
        t0 = time.perf_counter()
        found = self._call("read", len(keys), self.backend.read_into, names, blocks,
                           landed if self._mac_helper is None else None)
        out = [False] * len(keys)
        if found is _FAILED:
            return out
        seconds = time.perf_counter() - t0

        def verdict_of(i: int) -> str | None:
            if i in early:
                return early[i]
            length, tail = found[i]
            return None if length < 0 else codec.verify(keys[i], length, tail, blocks[i])

        verdicts = (self._map_halves(verdict_of, len(keys)) if self._mac_helper is not None
                    else [verdict_of(i) for i in range(len(keys))])
        coded_hits = self._decode(verdicts, found, blocks, seconds, decoded)
        bad: dict[str, int] = {}
        for i, verdict in enumerate(verdicts):
            if verdict is None:
                continue
            if verdict != OK:
                bad[verdict] = bad.get(verdict, 0) + 1
                continue
            if blocks[i] is not dst[i]:
                dst[i].copy_(blocks[i])
            out[i] = True
        for verdict, n in bad.items():
            self._on_failure(self.name, verdict, n, f"{self.backend.url}: {n} value(s) rejected as {verdict}")
        hits = sum(out)
        self._count(hits=hits, misses=len(keys) - hits, bad_values=sum(bad.values()),
                    bytes_read=hits * codec.payload_bytes, coded_hits=coded_hits)
        return out

    def _decode(self, verdicts: list[str | None], found: list[tuple[int, bytes]], blocks: list[torch.Tensor],
                seconds: float, decoded: set[int]) -> int:
        """Decode, in place, each good compressed value whose stored bytes lie at its block's start
        and that was not decoded as it landed (``decoded``); one that does not decode becomes
        CORRUPT in ``verdicts``. Times raw batches for ``auto``. Returns how many were coded."""
        todo = [i for i, v in enumerate(verdicts)
                if v == OK and i not in decoded and self.codec.coded(found[i][1])]
        if not todo and not decoded:
            if self._auto is not None and any(v == OK for v in verdicts):
                self._auto.raw_read(sum(v == OK for v in verdicts) * self.codec.payload_bytes, seconds)
            return 0
        items = [(as_bytes(blocks[i])[:self.codec.stored_bytes(found[i][1])], self.codec.coded(found[i][1]),
                  as_bytes(blocks[i])) for i in todo]
        for i, good in zip(todo, self._decoder.decode_many(items)):
            if not good:
                verdicts[i] = CORRUPT
        return len(todo) + len(decoded)

    @property
    def _decoder(self) -> BlockCodec:
        """This tier's codec, or (compress off) one made on first use: any reader decodes."""
        if self._codec is not None:
            return self._codec
        if self._codec_read is None:
            self._codec_read = BlockCodec(self.layout.itemsize, self.layout.block_bytes)
        return self._codec_read

    def _decode_one(self, block: torch.Tensor, tail: bytes) -> bool:
        """Decode the compressed value (trailer ``tail``) lying at the start of ``block``, in place."""
        whole = as_bytes(block)
        return self._decoder.decode_into(whole[:self.codec.stored_bytes(tail)], self.codec.coded(tail), whole)

    def compression(self) -> dict:
        """``l4.compress`` as this tier runs it, and ``auto``'s current choice (None otherwise)."""
        choice = self._auto.choice if self._auto is not None else None
        return {"mode": self.compress, "auto": None if choice is None else {"on": choice.on, "gain": round(
            choice.gain, 3), "why": choice.why}}

    def _map_halves(self, fn: Callable[[int], object], n: int) -> list:
        """``[fn(i) for i in range(n)]`` with the second half on the MAC helper thread."""
        half = n // 2
        if half == 0:
            return [fn(i) for i in range(n)]
        later = self._mac_helper.submit(lambda: [fn(i) for i in range(half, n)])
        try:
            first = [fn(i) for i in range(half)]
        finally:
            rest = later.result()
        return first + rest

    def remove(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._call("delete", len(keys), self.backend.delete, [self.key_name(k) for k in keys])

    def stats(self) -> dict:
        """Call counters, breaker state and the backend's own description. Thread-safe snapshot."""
        with self._lock:
            out = dict(self.counts)
        out.update(breaker=self.breaker.state, breaker_opens=self.breaker.opens,
                   authenticated=self.codec.authenticated, compress=self.compression(), **self.backend.info())
        return out

    def close(self) -> None:
        self.backend.close()
        for codec in (self._codec, self._codec_read):
            if codec is not None:
                codec.close()
        if self._mac_helper is not None:
            self._mac_helper.shutdown(wait=True)


