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

Data moves with ``batch_put_from`` / ``batch_get_into`` through one staging
buffer registered with the transfer engine once, at connect: a value (header +
block) is built there and sent from there, and read back there, verified, and
only then copied into the caller's block. Mooncake's RPCs retry for seconds
when the master is gone, so every call runs under ``tiers.remote.base.Deadline``
with ``l4.timeout_ms``; a late call keeps the staging buffer until it ends.
Transfers and membership calls have one worker thread each, so a lookup never
queues behind a batch of transfers.
Connecting is lazy and retried (through the tier's breaker) when it fails.
"""

from __future__ import annotations

import mmap
import socket
import threading
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

from tierkv.config import parse_size
from tierkv.tiers.remote import rdma
from tierkv.tiers.remote.base import HEADER_BYTES, Deadline, RemoteUnavailable

DEFAULT_METADATA_PORT = 8080
_OPTIONS = ("metadata", "segment", "buffer", "protocol", "devices", "local", "staging")
# Mooncake's ErrorCode values that mean "this key", not "the pool is gone".
_OBJECT_NOT_FOUND = -704
_OBJECT_ALREADY_EXISTS = -705
_BUFFER_TOO_SMALL = -600
_RPC_FAIL = -900


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

    Thread-safe: transfers run one at a time on their worker (they share the
    staging buffer), membership and removal calls on another.
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
        self._staging_ptr = _address(self._staging)

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
        """Worker thread: connect and register the staging buffer. A connect that finishes after
        its caller gave up is still adopted, so no connected client is ever left behind."""
        store = self._cls()
        o = self.opts
        rc = store.setup(o.local, o.metadata, o.segment, o.buffer, self.protocol, self.devices, o.master)
        if rc != 0:
            raise RemoteUnavailable(f"setup against master {o.master} failed with code {rc}")
        rc = store.register_buffer(self._staging_ptr, len(self._staging))
        if rc != 0:
            store.close()
            raise RemoteUnavailable(f"registering the staging buffer failed with code {rc}")
        self._store = store

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

    def write(self, names: list[str], header: Callable[[int], bytes], payloads: list[memoryview]) -> list[bool]:
        out: list[bool] = []
        for start, end in self._chunks(len(names)):
            out.extend(self._run(self._write_chunk, names[start:end], start, header, payloads[start:end]))
        return out

    def _write_chunk(self, names: list[str], start: int, header: Callable[[int], bytes],
                     payloads: list[memoryview]) -> list[bool]:
        ptrs, sizes, offset = [], [], 0
        for j, payload in enumerate(payloads):
            size = HEADER_BYTES + len(payload)
            if size > self.value_bytes:
                raise ValueError(f"l4 put: a {size}-byte value does not fit a {self.value_bytes}-byte staging slot")
            # Payload first: the header's checksum pass then finds it in cache.
            self._staging_view[offset + HEADER_BYTES:offset + size] = payload
            self._staging_view[offset:offset + HEADER_BYTES] = header(start + j)
            ptrs.append(self._staging_ptr + offset)
            sizes.append(size)
            offset += self.value_bytes
        codes = self._store.batch_put_from(names, ptrs, sizes)
        if codes and all(c == _RPC_FAIL for c in codes):
            raise RemoteUnavailable(f"put failed with code {_RPC_FAIL} (RPC_FAIL)")
        refused = sorted({c for c in codes if c not in (0, _OBJECT_ALREADY_EXISTS)})
        if refused:
            self.refused_codes = refused
        return [c == 0 or c == _OBJECT_ALREADY_EXISTS for c in codes]

    def read(self, names: list[str], size: int, sink: Callable[[int, memoryview | None], None]) -> None:
        if size > self.value_bytes:
            raise ValueError(f"l4 get: {size}-byte values do not fit {self.value_bytes}-byte staging slots")
        for start, end in self._chunks(len(names)):
            chunk = names[start:end]
            ptrs = [self._staging_ptr + j * size for j in range(len(chunk))]

            def deliver(codes: list[int], start: int = start) -> None:
                if codes and all(c == _RPC_FAIL for c in codes):
                    raise RemoteUnavailable(f"get failed with code {_RPC_FAIL} (RPC_FAIL)")
                for j, n in enumerate(codes):
                    if n > 0:
                        sink(start + j, self._staging_view[j * size:j * size + n])
                    elif n == _BUFFER_TOO_SMALL:
                        sink(start + j, None)

            sizes = [size] * len(chunk)
            self._run(lambda: self._store.batch_get_into(chunk, ptrs, sizes), after=deliver)

    def delete(self, names: list[str]) -> None:
        self._run_meta(lambda: self._store.batch_remove(names, True))

    def info(self) -> dict:
        return {"backend": "mooncake", "url": self.url, "protocol": self.protocol,
                "rdma_devices": self.devices, "rdma_reason": self.rdma_reason,
                "connected": self._store is not None, "refused_codes": self.refused_codes}

    def close(self) -> None:
        """Disconnect (the pool keeps what others contributed). Waits for a running call to end."""
        idle = all([self._deadline.close(), self._meta_deadline.close(), self._connect_deadline.close()])
        store, self._store = self._store, None
        if store is not None and idle:
            try:
                store.unregister_buffer(self._staging_ptr)
                store.close()
            except Exception:  # closing a client whose master is gone is best effort
                pass


def _address(buf: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))
