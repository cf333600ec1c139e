"""L2: host DRAM, one slab of fixed-size slots (docs/design.md §5).

The slab is page-aligned anonymous memory, or a file in /dev/shm when
``shared_name`` is set so processes on one node share it (their key -> slot map
then lives in an LMDB environment beside the slab, and every read checks a
checksum because another process may reuse a slot at any time). With CUDA the
slab is registered for DMA with ``cudaHostRegister`` so host<->device copies
are asynchronous.

Thread-safety: map operations take an internal lock; the bytes of a slot are
only read while the store pins the block, so copies run outside the lock.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import threading
from collections.abc import Sequence

import torch

from tierkv.layout import KVLayout
from tierkv.tiers.base import Lineage, _memmove, checksum, copy_block

log = logging.getLogger("tierkv")
_SHARED_REC = struct.Struct("<IQ")  # slot, checksum


def _register_pinned(buf: torch.Tensor) -> bool:
    """Page-lock ``buf`` for async DMA when CUDA exists; True when it did."""
    if not torch.cuda.is_available():
        return False
    rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0)
    return int(rc) == 0


class HostTier:
    name = "l2"

    def __init__(self, layout: KVLayout, num_blocks: int, shared_name: str = "", pin: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"l2.capacity: holds no block of {layout.block_bytes} bytes; raise it or set 0 to disable L2")
        self.layout = layout
        self._capacity = num_blocks
        nbytes = num_blocks * layout.block_bytes
        self._shared = bool(shared_name)
        if self._shared:
            path = f"/dev/shm/tierkv-{shared_name}"
            fd = os.open(path + ".slab", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                # The first opener sizes the slab; later ones map it as it is, whatever they
                # asked for: another process's slots past a smaller mapping would be read and
                # written out of bounds. The lock orders racing creators.
                fcntl.flock(fd, fcntl.LOCK_EX)
                size = os.fstat(fd).st_size
                if size < layout.block_bytes:
                    os.ftruncate(fd, nbytes)
                elif size // layout.block_bytes != num_blocks:
                    log.warning("tierkv l2: shared slab %s holds %d blocks; using it as is (asked for %d)",
                                shared_name, size // layout.block_bytes, num_blocks)
                    num_blocks = self._capacity = size // layout.block_bytes
                    nbytes = num_blocks * layout.block_bytes
                self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: the mmap keeps the file open
                os.close(fd)
            self._slots = _SharedSlots(path + ".lmdb", num_blocks)
        else:
            # MAP_POPULATE: fault the slab in once now, not on the first put of every page.
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(-1, nbytes, flags)
            self._slots = _LocalSlots(num_blocks)
        flat = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.slab = flat.view(layout.torch_dtype).view(layout.pool_shape(num_blocks))
        self._base = self.slab.data_ptr()
        self._bb = layout.block_bytes
        self.pinned = pin and _register_pinned(self.slab)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def shared(self) -> bool:
        """True for a /dev/shm slab: other processes may free and reuse its slots at any time."""
        return self._shared

    @property
    def used(self) -> int:
        return self._slots.used()

    def block(self, slot: int) -> torch.Tensor:
        """A view of one slot (no copy); valid while the block stays pinned by the store."""
        return self.slab[slot]

    def slot_of(self, key: bytes) -> int | None:
        found = self._slots.find(key)
        return None if found is None else found[0]

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [self._slots.find(k) is not None for k in keys]

    def view(self, key: bytes) -> torch.Tensor | None:
        """The block's slot in place; None on a shared slab (another process may reuse the slot:
        ``get`` copies it out and checks it)."""
        if self._shared:
            return None
        found = self._slots.find(key)
        return None if found is None else self.slab[found[0]]

    def put(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
            lineage: Sequence[Lineage] | None = None) -> list[bool]:
        """Copy blocks into free slots; False for a key when the slab is full. Existing keys are kept."""
        if not self._shared:  # one lock section for the batch, then the copies
            out = []
            for (slot, fresh), src in zip(self._slots.reserve_many(keys), blocks):
                if slot is not None and fresh:
                    self._copy_in(slot, src)
                out.append(slot is not None)
            return out
        out = []
        for key, src in zip(keys, blocks):
            slot, fresh = self._slots.reserve(key)
            if slot is None:
                out.append(False)
                continue
            if fresh:
                self._copy_in(slot, src)
                if src.device.type != "cpu":  # the device->host copy above is asynchronous
                    torch.cuda.current_stream(src.device).synchronize()
                self._slots.commit(key, slot, checksum(key, self.slab[slot]))
            out.append(True)
        return out

    def get(self, keys: Sequence[bytes], dst: Sequence[torch.Tensor]) -> list[bool]:
        if not self._shared:
            out = []
            for slot, d in zip(self._slots.find_slots(keys), dst):
                if slot is not None:
                    self._copy_out(d, slot)
                out.append(slot is not None)
            return out
        out = []
        for key, d in zip(keys, dst):
            found = self._slots.find(key)
            if found is None:
                out.append(False)
                continue
            self._copy_out(d, found[0])
            if d.device.type != "cpu":
                torch.cuda.current_stream().synchronize()
                ok = checksum(key, d.cpu()) == found[1]
            else:
                ok = checksum(key, d) == found[1]
            out.append(ok)
        return out

    def _copy_in(self, slot: int, src: torch.Tensor) -> None:
        # Raw addresses: indexing the slab costs more than copying a small block (and
        # ``is_cpu`` is a fraction of ``device.type``'s cost: this runs once per block).
        if src.is_cpu and src.is_contiguous() and src.nbytes == self._bb:
            _memmove(self._base + slot * self._bb, src.data_ptr(), self._bb)
        else:
            copy_block(self.slab[slot], src)

    def _copy_out(self, dst: torch.Tensor, slot: int) -> None:
        if dst.is_cpu and dst.is_contiguous() and dst.nbytes == self._bb:
            _memmove(dst.data_ptr(), self._base + slot * self._bb, self._bb)
        else:
            copy_block(dst, self.slab[slot])

    def remove(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._slots.release(key)

    def keys(self) -> list[bytes]:
        return self._slots.keys()

    def close(self) -> None:
        """Unregister the slab and close a shared slab's map (so this process may open it again)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.slab.data_ptr())
            self.pinned = False
        self._slots.close()


class _LocalSlots:
    """key -> slot for one process."""

    def __init__(self, n: int) -> None:
        self._map: dict[bytes, int] = {}
        self._free = list(range(n - 1, -1, -1))
        self._lock = threading.Lock()

    def used(self) -> int:
        return len(self._map)

    def find(self, key: bytes):
        slot = self._map.get(key)
        return None if slot is None else (slot, 0)

    def find_slots(self, keys: Sequence[bytes]) -> list[int | None]:
        get = self._map.get
        return [get(k) for k in keys]

    def reserve_many(self, keys: Sequence[bytes]) -> list[tuple[int | None, bool]]:
        """``reserve`` for each key, in one lock section."""
        with self._lock:
            return [self._reserve(k) for k in keys]

    def reserve(self, key: bytes) -> tuple[int | None, bool]:
        with self._lock:
            return self._reserve(key)

    def _reserve(self, key: bytes) -> tuple[int | None, bool]:
        """Caller holds the lock."""
        slot = self._map.get(key)
        if slot is not None:
            return slot, False
        if not self._free:
            return None, False
        slot = self._free.pop()
        self._map[key] = slot
        return slot, True

    def commit(self, key: bytes, slot: int, checksum: int) -> None:
        pass

    def release(self, key: bytes) -> None:
        with self._lock:
            slot = self._map.pop(key, None)
            if slot is not None:
                self._free.append(slot)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._map)

    def close(self) -> None:
        pass


class _SharedSlots:
    """key -> (slot, checksum) in an LMDB environment in /dev/shm, shared by processes."""

    def __init__(self, path: str, n: int) -> None:
        import lmdb

        self._env = lmdb.open(path, map_size=max(64 << 20, n * 256), max_dbs=3, subdir=True,
                              sync=False, metasync=False, lock=True)
        self._keys = self._env.open_db(b"keys")
        self._free = self._env.open_db(b"free")
        self._meta = self._env.open_db(b"meta")
        self._n = n

    def used(self) -> int:
        with self._env.begin() as txn:
            return txn.stat(self._keys)["entries"]

    def find(self, key: bytes):
        with self._env.begin() as txn:
            raw = txn.get(key, db=self._keys)
        if raw is None or len(raw) != _SHARED_REC.size:
            return None
        slot, checksum = _SHARED_REC.unpack(raw)
        return None if checksum == 0 else (slot, checksum)

    def reserve(self, key: bytes) -> tuple[int | None, bool]:
        with self._env.begin(write=True) as txn:
            raw = txn.get(key, db=self._keys)
            if raw is not None:
                slot, checksum = _SHARED_REC.unpack(raw)
                # Checksum 0: reserved but never committed (its writer may have died);
                # writing the key's bytes again is safe, they are the same bytes.
                return slot, checksum == 0
            cur = txn.cursor(db=self._free)
            if cur.first():
                slot = struct.unpack(">I", cur.key())[0]
                cur.delete()
            else:
                raw = txn.get(b"next", db=self._meta)
                slot = 0 if raw is None else struct.unpack("<I", raw)[0]
                if slot >= self._n:
                    return None, False
                txn.put(b"next", struct.pack("<I", slot + 1), db=self._meta)
            txn.put(key, _SHARED_REC.pack(slot, 0), db=self._keys)  # checksum 0: not readable yet
            return slot, True

    def commit(self, key: bytes, slot: int, checksum: int) -> None:
        with self._env.begin(write=True) as txn:
            txn.put(key, _SHARED_REC.pack(slot, checksum or 1), db=self._keys)

    def release(self, key: bytes) -> None:
        with self._env.begin(write=True) as txn:
            raw = txn.pop(key, db=self._keys)
            if raw is not None:
                txn.put(struct.pack(">I", _SHARED_REC.unpack(raw)[0]), b"", db=self._free)

    def keys(self) -> list[bytes]:
        with self._env.begin() as txn:
            return [bytes(k) for k, _ in txn.cursor(db=self._keys)]

    def close(self) -> None:
        self._env.close()  # LMDB allows one open environment per path and process
