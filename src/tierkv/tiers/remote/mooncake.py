"""L4 backend for Mooncake Store, through mooncake-transfer-engine's MooncakeDistributedStore.

URL: ``mooncake://MASTER_HOST:PORT[?option=value&...]``. Options:

- ``metadata``: the transfer engine's metadata service; default the master's
  built-in HTTP metadata server, ``http://MASTER_HOST:8080/metadata``
  (start the master with ``--enable_http_metadata_server``); ``P2PHANDSHAKE``
  works too.
- ``segment``: bytes of memory this client contributes to the pool (default
  0: the pool's memory belongs to dedicated ``mooncake_client`` processes or
  other nodes, so values outlive this process).
- ``buffer``: Mooncake's local transfer buffer (default 16 MiB).
- ``protocol``: ``auto`` (default: ``rdma`` when pyverbs finds a device with
  an active port, else ``tcp``), ``rdma`` or ``tcp``; ``devices``: RDMA device
  names, comma separated (default: those found).
- ``local``: the address peers reach this client at (default: the address
  this host uses to reach the master).
- ``staging``: values per batch in the registered staging buffer (default 32).

Blocks in memory registered with ``register`` (the store registers its L1
pool and L2 slab) move without a staging copy. Where each block is followed
by room for its trailer (the store's L1 pool when L4 is Mooncake:
``SlotPool(slot_room=...)``), a value moves in one piece: the trailer is
written into the room and ``batch_put_from`` sends block and trailer as one
value; ``batch_get_into`` lands the whole value in the slot, trailer in the
room. Elsewhere ``batch_put_from_multi_buffers`` sends a value as the block in
place plus its 64-byte trailer (from a small registered trailer page), and
``batch_get_into_multi_buffers`` lands the payload straight in the caller's
block and the trailer in a trailer page: a second transfer per value, which
costs 5-7 % over TCP. Either way the tier verifies the block in place.
(Payload first: Mooncake moves a value whose large piece starts it about 5 %
faster than one that starts with a small piece.) Such a direct call runs on
the caller's thread and returns only
when Mooncake is done with the caller's memory, so a late transfer can never
write into a block the caller has since reused; it is bounded by Mooncake's own
RPC and TCP timeouts, which tierkv sets from ``l4.timeout_ms`` unless the
environment already does (``MC_RPC_TIMEOUT_MS``, ``MC_RPC_CONNECT_TIMEOUT_MS``,
``MC_TCP_PROGRESS_TIMEOUT_SEC``, ``MC_TCP_STATUS_TIMEOUT_SEC``; process-wide,
read when the first client connects). A hung pool node can hold a direct call
for about two progress timeouts (whole seconds), a hung master for one RPC
timeout.

Blocks elsewhere go through one registered staging buffer: a value (block +
trailer) is built there and sent from there, or read back there, and its payload
copied into the caller's block. Those calls run under
``tiers.remote.base.Deadline`` with ``l4.timeout_ms``; a late call keeps the
staging buffer until it ends. Membership and removal calls have their own
worker thread, so a lookup never queues behind a batch of transfers.
Connecting is lazy and retried (through the tier's breaker) when it fails.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import socket
import threading
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

from tierkv.config import parse_size
from tierkv.tiers.remote import rdma
import torch

from tierkv.tiers.base import as_bytes
from tierkv.tiers.remote.base import Deadline, Landed, RemoteUnavailable
from tierkv.tiers.remote.codec import TRAILER_BYTES
from tierkv.tiers.remote.regions import TrailerPages, Regions, address

DEFAULT_METADATA_PORT = 8080
_OPTIONS = ("metadata", "segment", "buffer", "protocol", "devices", "local", "staging")
# Mooncake's ErrorCode values that mean "this key", not "the pool is gone".
_OBJECT_NOT_FOUND = -704
_OBJECT_ALREADY_EXISTS = -705
_BUFFER_TOO_SMALL = -600
_RPC_FAIL = -900
TRAILER_PAGES = 8  # direct calls that may run at once (each borrows one page of trailers)


def bound_client_timeouts(timeout_ms: int) -> None:
    """Mooncake's own RPC and TCP timeouts, 30-60 s by default, set from ``l4.timeout_ms``
    unless the environment already sets them: they bound the direct calls (see the module doc)."""
    seconds = str(max(1, math.ceil(timeout_ms / 1000)))
    for name, value in (("MC_RPC_TIMEOUT_MS", str(timeout_ms)), ("MC_RPC_CONNECT_TIMEOUT_MS", str(timeout_ms)),
                        ("MC_TCP_PROGRESS_TIMEOUT_SEC", seconds), ("MC_TCP_STATUS_TIMEOUT_SEC", seconds)):
        os.environ.setdefault(name, value)


def _import_store():
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(
            "l4.url: mooncake:// needs mooncake-transfer-engine; install it with "
            "pip install 'tierkv[mooncake]' (and apt-get install libibverbs1)") from exc
    return MooncakeDistributedStore


def _local_address(host: str, port: int) -> str:
    """The address of the interface this host uses to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class MooncakeOptions:
    """Parsed and validated ``mooncake://`` URL; errors name the option and what is allowed."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "mooncake" or not parts.hostname or not parts.port:
            raise ValueError(f"l4.url: expected mooncake://MASTER_HOST:PORT, got {url!r}")
        self.host, self.port = parts.hostname, parts.port
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        for name in query:
            if name not in _OPTIONS:
                raise ValueError(f"l4.url: unknown mooncake option {name!r}; expected one of {list(_OPTIONS)}")
        self.master = f"{self.host}:{self.port}"
        self.metadata = query.get("metadata") or f"http://{self.host}:{DEFAULT_METADATA_PORT}/metadata"
        self.segment = parse_size(query.get("segment", "0"), "l4.url segment")
        self.buffer = parse_size(query.get("buffer", "16MiB"), "l4.url buffer")
        self.protocol = query.get("protocol", "auto")
        if self.protocol not in ("auto", "rdma", "tcp"):
            raise ValueError(f"l4.url protocol: expected one of ['auto', 'rdma', 'tcp'], got {self.protocol!r}")
        self.devices = query.get("devices", "")
        self.local = query.get("local") or _local_address(self.host, self.port)
        staging = query.get("staging", "32")
        if not staging.isdigit() or not 1 <= int(staging) <= 4096:
            raise ValueError(f"l4.url staging: expected an integer in [1, 4096], got {staging!r}")
        self.staging = int(staging)
        self.url = f"mooncake://{self.master}"


class MooncakeBackend:
    """Batched exists/read/write/delete over a Mooncake Store pool.

    Thread-safe: direct transfers (registered memory) run on their callers'
    threads, up to TRAILER_PAGES at once; staged transfers one at a time on
    their worker (they share the staging buffer); membership and removal
    calls on another worker.
    """

    def __init__(self, url: str, timeout_ms: int, value_bytes: int) -> None:
        self.opts = MooncakeOptions(url)
        self._cls = _import_store()
        self.url = self.opts.url
        self.timeout_s = timeout_ms / 1000.0
        self.value_bytes = value_bytes
        self.errors: tuple[type[BaseException], ...] = (OSError,)
        self.protocol, self.devices, self.rdma_reason = self._pick_protocol()
        self._deadline = Deadline(self.timeout_s, "tierkv-mooncake")
        # Membership and removal touch no buffer: their own worker, so a lookup never waits behind a transfer.
        self._meta_deadline = Deadline(self.timeout_s, "tierkv-mooncake-meta")
        self._connect_deadline = Deadline(max(self.timeout_s, 5.0), "tierkv-mooncake-connect")
        self._store = None
        self.refused_codes: list[int] = []  # Mooncake error codes of the last refused puts, for stats
        self._connect_lock = threading.Lock()
        self._staging = mmap.mmap(-1, self.opts.staging * value_bytes)
        self._staging_view = memoryview(self._staging)
        self._staging_ptr = address(self._staging)
        self._regions = Regions()  # caller memory registered with the client (and again on reconnect)
        self._tails = TrailerPages(TRAILER_PAGES, self.opts.staging, self.timeout_s)
        self._direct = 0  # direct calls running, so close() waits for them
        self.calls = {"in_place": 0, "direct": 0, "staged": 0}  # transfer calls by path, for stats
        self._direct_done = threading.Condition()
        bound_client_timeouts(timeout_ms)

    def _pick_protocol(self) -> tuple[str, str, str]:
        want = self.opts.protocol
        if want == "tcp":
            return "tcp", "", "tcp requested"
        report = rdma.detect()
        devices = self.opts.devices or ",".join(report.usable)
        if devices:
            return "rdma", devices, ""
        if want == "rdma":
            raise ValueError(f"l4.url protocol: rdma requested but no RDMA device is usable ({report.reason})")
        return "tcp", "", report.reason

    # -- connection -----------------------------------------------------------

    def _master_reachable(self) -> None:
        try:
            socket.create_connection((self.opts.host, self.opts.port), timeout=self.timeout_s).close()
        except OSError as exc:
            raise RemoteUnavailable(f"master {self.opts.master} unreachable: {exc}") from None

    def _setup(self) -> None:
        """Worker thread: connect, register the staging buffer and trailer pages, then the caller
        memory passed to ``register`` (a region that fails is dropped: its blocks go staged).
        A connect that finishes after its caller gave up is still adopted, so no connected
        client is ever left behind."""
        store = self._cls()
        o = self.opts
        rc = store.setup(o.local, o.metadata, o.segment, o.buffer, self.protocol, self.devices, o.master)
        if rc != 0:
            raise RemoteUnavailable(f"setup against master {o.master} failed with code {rc}")
        for ptr, nbytes in ((self._staging_ptr, len(self._staging)), (self._tails.ptr, len(self._tails.buf))):
            rc = store.register_buffer(ptr, nbytes)
            if rc != 0:
                store.close()
                raise RemoteUnavailable(f"registering {nbytes} bytes of transfer memory failed with code {rc}")
        for ptr, nbytes in self._regions.all():
            if store.register_buffer(ptr, nbytes) != 0:
                self._regions.remove(ptr)  # its blocks go through staging instead
        self._store = store

    def register(self, ptr: int, nbytes: int, slot_bytes: int = 0) -> None:
        """Register caller memory now when connected (else at connect). A failure leaves it staged.
        ``slot_bytes`` > 0: slots of that size with trailer room after each block (one-piece values)."""
        with self._connect_lock:
            if self._store is not None:
                rc = self._connect_deadline.run(self._store.register_buffer, ptr, nbytes)
                if rc != 0:
                    raise RemoteUnavailable(f"registering {nbytes} bytes failed with code {rc}")
            self._regions.add(ptr, nbytes, slot_bytes)

    def unregister(self, ptr: int) -> None:
        """Forget the region registered at ``ptr``; blocks there go staged from now on. The caller
        makes sure no call moving data there is running (as for freeing any transfer memory)."""
        with self._connect_lock:
            self._regions.remove(ptr)
            if self._store is not None:
                self._connect_deadline.run(self._store.unregister_buffer, ptr)

    def _client(self):
        """The connected store, connecting first when needed (bounded by the connect deadline)."""
        store = self._store
        if store is not None:
            return store
        with self._connect_lock:
            if self._store is None:
                self._master_reachable()
                self._connect_deadline.run(self._setup)
            return self._store

    def _run(self, fn: Callable, *args, after: Callable | None = None):
        self._client()
        with self._direct_done:
            self.calls["staged"] += 1
        return self._deadline.run(fn, *args, after=after)

    def _run_meta(self, fn: Callable):
        self._client()
        return self._meta_deadline.run(fn)

    # -- protocol ---------------------------------------------------------------

    def exists(self, names: list[str]) -> list[bool]:
        codes = self._run_meta(lambda: self._store.batch_is_exist(names))
        if codes and all(c < 0 for c in codes):
            raise RemoteUnavailable(f"exists failed with codes {sorted(set(codes))}")
        return [c == 1 for c in codes]

    def _chunks(self, n: int):
        step = self.opts.staging
        for start in range(0, n, step):
            yield start, min(n, start + step)

    def _in_registered(self, blocks: list[torch.Tensor]) -> tuple[list[int] | None, bool]:
        """(the blocks' addresses, whether each has trailer room after it) when every one lies in
        registered memory, else (None, False)."""
        ptrs = [b.data_ptr() for b in blocks]
        where = self._regions.placement(ptrs, blocks[0].nbytes if blocks else 0)
        return (None if where is None else ptrs), where == "room"

    def _direct_call(self, fn: Callable, *args, in_place: bool = False):
        """``fn(page, *args)`` on this thread with one borrowed trailer page (none, -1, ``in_place``).

        Returns once Mooncake is done with the caller's memory; bounded by
        Mooncake's own timeouts (``bound_client_timeouts``), not by a Deadline.
        """
        self._client()
        page = -1 if in_place else self._tails.borrow()
        with self._direct_done:
            self._direct += 1
            self.calls["in_place" if in_place else "direct"] += 1
        try:
            return fn(page, *args)
        finally:
            if page >= 0:
                self._tails.give_back(page)
            with self._direct_done:
                self._direct -= 1
                self._direct_done.notify_all()

    def _pieces(self, page: int, ptrs: list[int], nbytes: int) -> tuple[list[list[int]], list[list[int]]]:
        """Per value: the block where it lies, then its trailer slot in ``page``."""
        base = self._tails.ptr + page
        return ([[q, base + j * TRAILER_BYTES] for j, q in enumerate(ptrs)],
                [[nbytes, TRAILER_BYTES]] * len(ptrs))

    # -- write ------------------------------------------------------------------

    def write(self, names: list[str], trailer: Callable[[int], bytes], blocks: list[torch.Tensor]) -> list[bool]:
        out: list[bool] = []
        for start, end in self._chunks(len(names)):
            ptrs, in_place = self._in_registered(blocks[start:end])
            if ptrs is None:
                out.extend(self._run(self._write_staged, names[start:end], start, trailer, blocks[start:end]))
                continue
            out.extend(self._direct_call(self._write_in_place if in_place else self._write_direct,
                                         names[start:end], start, trailer, blocks[start:end], ptrs,
                                         in_place=in_place))
        return out

    def _write_in_place(self, _page: int, names: list[str], start: int, trailer: Callable[[int], bytes],
                        blocks: list[torch.Tensor], ptrs: list[int]) -> list[bool]:
        """Each value goes out in one piece: its trailer written into the room after its block."""
        nbytes = blocks[0].nbytes
        for j, ptr in enumerate(ptrs):
            ctypes.memmove(ptr + nbytes, trailer(start + j), TRAILER_BYTES)
        return self._put_verdicts(self._store.batch_put_from(names, ptrs, [nbytes + TRAILER_BYTES] * len(ptrs)))

    def _write_direct(self, page: int, names: list[str], start: int, trailer: Callable[[int], bytes],
                      blocks: list[torch.Tensor], ptrs: list[int]) -> list[bool]:
        """Each value goes out as two pieces: its block where it lies, its trailer from the page."""
        view = self._tails.view
        for j in range(len(names)):
            view[page + j * TRAILER_BYTES:page + (j + 1) * TRAILER_BYTES] = trailer(start + j)
        nbytes = blocks[0].nbytes
        return self._put_verdicts(self._store.batch_put_from_multi_buffers(names, *self._pieces(page, ptrs, nbytes)))

    def _write_staged(self, names: list[str], start: int, trailer: Callable[[int], bytes],
                      blocks: list[torch.Tensor]) -> list[bool]:
        ptrs, sizes, offset = [], [], 0
        for j, block in enumerate(blocks):
            payload = as_bytes(block)
            size = len(payload) + TRAILER_BYTES
            if size > self.value_bytes:
                raise ValueError(f"l4 put: a {size}-byte value does not fit a {self.value_bytes}-byte staging slot")
            self._staging_view[offset:offset + len(payload)] = payload
            self._staging_view[offset + len(payload):offset + size] = trailer(start + j)
            ptrs.append(self._staging_ptr + offset)
            sizes.append(size)
            offset += self.value_bytes
        return self._put_verdicts(self._store.batch_put_from(names, ptrs, sizes))

    def _put_verdicts(self, codes: list[int]) -> list[bool]:
        if codes and all(c == _RPC_FAIL for c in codes):
            raise RemoteUnavailable(f"put failed with code {_RPC_FAIL} (RPC_FAIL)")
        refused = sorted({c for c in codes if c not in (0, _OBJECT_ALREADY_EXISTS)})
        if refused:
            self.refused_codes = refused
        return [c == 0 or c == _OBJECT_ALREADY_EXISTS for c in codes]

    # -- read -------------------------------------------------------------------

    def read_into(self, names: list[str], blocks: list[torch.Tensor],
                  landed: Landed | None = None) -> list[tuple[int, bytes]]:
        """Values land a batch at a time (one transfer), so ``landed`` is not called."""
        out: list[tuple[int, bytes]] = []
        for start, end in self._chunks(len(names)):
            chunk, dst = names[start:end], blocks[start:end]
            ptrs, in_place = self._in_registered(dst)
            if ptrs is None:
                out.extend(self._read_staged(chunk, dst))
                continue
            found = self._direct_call(self._read_in_place if in_place else self._read_direct, chunk, dst, ptrs,
                                      in_place=in_place)
            # Values of another size (Mooncake reports only a failed transfer for those):
            # read them again through staging, which sees their real size and trailer.
            odd = [j for j, (length, _) in enumerate(found) if length is None]
            if odd:
                for j, result in zip(odd, self._read_staged([chunk[j] for j in odd], [dst[j] for j in odd])):
                    found[j] = result
            out.extend(found)
        return out

    def _read_direct(self, page: int, names: list[str], blocks: list[torch.Tensor],
                     ptrs: list[int]) -> list[tuple[int | None, bytes]]:
        """Payloads straight into the caller's blocks, trailers into the page. Length None: read it again staged."""
        nbytes = blocks[0].nbytes
        codes = self._store.batch_get_into_multi_buffers(names, *self._pieces(page, ptrs, nbytes))
        if codes and all(c < 0 and c != _OBJECT_NOT_FOUND for c in codes):
            raise RemoteUnavailable(f"get failed with codes {sorted(set(codes))}")
        tails = self._tails.slots(page, len(codes))
        want = nbytes + TRAILER_BYTES
        return [(code, tail) if code == want else (-1, b"") if code == _OBJECT_NOT_FOUND else (None, b"")
                for code, tail in zip(codes, tails)]

    def _read_in_place(self, _page: int, names: list[str], blocks: list[torch.Tensor],
                       ptrs: list[int]) -> list[tuple[int | None, bytes]]:
        """Whole values into the slots, each trailer into the room after its block. A shorter value
        is judged from its own last bytes; length None (longer, or failed): read it again staged."""
        nbytes = blocks[0].nbytes
        want = nbytes + TRAILER_BYTES
        codes = self._store.batch_get_into(names, ptrs, [want] * len(ptrs))
        if codes and all(c < 0 and c not in (_OBJECT_NOT_FOUND, _BUFFER_TOO_SMALL) for c in codes):
            raise RemoteUnavailable(f"get failed with codes {sorted(set(codes))}")
        out: list[tuple[int | None, bytes]] = []
        for code, ptr in zip(codes, ptrs):
            if code == _OBJECT_NOT_FOUND:
                out.append((-1, b""))
            elif 0 < code <= want:
                out.append((code, ctypes.string_at(ptr + code - TRAILER_BYTES, TRAILER_BYTES)
                            if code >= TRAILER_BYTES else b""))
            else:
                out.append((None, b""))
        return out

    def _read_staged(self, names: list[str], blocks: list[torch.Tensor]) -> list[tuple[int, bytes]]:
        """Whole values into staging slots on the Deadline worker; back on this thread (gate still held),
        payloads of the right size are copied out. A call that timed out never touches ``blocks``."""
        size = self.value_bytes
        ptrs = [self._staging_ptr + j * size for j in range(len(names))]

        def deliver(codes: list[int]) -> list[tuple[int, bytes]]:
            if codes and all(c == _RPC_FAIL for c in codes):
                raise RemoteUnavailable(f"get failed with code {_RPC_FAIL} (RPC_FAIL)")
            out = []
            for j, (n, block) in enumerate(zip(codes, blocks)):
                value = self._staging_view[j * size:j * size + max(n, 0)]
                payload = as_bytes(block)
                if n == len(payload) + TRAILER_BYTES:
                    payload[:] = value[:len(payload)]
                if n > 0:
                    out.append((n, bytes(value[-TRAILER_BYTES:])))
                elif n == _BUFFER_TOO_SMALL:
                    out.append((size + 1, b""))  # larger than a block of this layout: another layout's
                else:
                    out.append((-1, b""))
            return out

        return self._run(lambda: self._store.batch_get_into(names, ptrs, [size] * len(names)), after=deliver)

    def delete(self, names: list[str]) -> None:
        self._run_meta(lambda: self._store.batch_remove(names, True))

    def info(self) -> dict:
        return {"backend": "mooncake", "url": self.url, "protocol": self.protocol,
                "rdma_devices": self.devices, "rdma_reason": self.rdma_reason,
                "connected": self._store is not None, "refused_codes": self.refused_codes,
                "in_place_calls": self.calls["in_place"], "direct_calls": self.calls["direct"],
                "staged_calls": self.calls["staged"],
                "registered_bytes": sum(n for _, n in self._regions.all())}

    def close(self) -> None:
        """Disconnect (the pool keeps what others contributed). Waits for running calls to end."""
        idle = all([self._deadline.close(), self._meta_deadline.close(), self._connect_deadline.close()])
        with self._direct_done:
            idle = self._direct_done.wait_for(lambda: self._direct == 0, timeout=5.0) and idle
        store, self._store = self._store, None
        if store is not None and idle:
            try:
                for ptr, _ in ((self._staging_ptr, 0), (self._tails.ptr, 0), *self._regions.all()):
                    store.unregister_buffer(ptr)
                store.close()
            except Exception:  # closing a client whose master is gone is best effort
                pass
