"""L3: local disk — one preallocated slot file plus an LMDB index (docs/design.md §5).

All slots have one size, so slot k sits at offset k x stride (stride = block
bytes rounded up to 4 KiB): no fragmentation. Data moves with O_DIRECT through
page-aligned buffers, straight into the caller's buffer when it is aligned.
The LMDB environment maps key -> (slot, depth, checksum, created, [stored
bytes, flags,] parent). With ``compress`` on, a block that shrinks by at least a
page is stored as byte planes + zstd (``tierkv.compress``) at the start of its
slot, its stored size and flags in the record and its checksum over the stored
bytes, so damage is found before anything is decoded; raw records (the old
format, and blocks that do not shrink) sit beside them. A compressed block reads
fewer bytes; it still takes a whole slot (capacity is unchanged).

Write order is data, then fdatasync, then the LMDB commit, all inside one LMDB
write transaction — LMDB's writer lock serialises writers across processes, so
slot allocation needs no other coordination, and a crash (even SIGKILL) leaves
at worst a slot whose bytes nobody points at. Every read verifies a checksum
bound to the key; a bad block is a miss, is removed and is counted. Readers
never block (LMDB MVCC), and any number of processes may open one directory.

Damage found at open never stops the store: damaged files are moved into
``damaged-<UTC time>/`` beside them and an empty L3 starts in their place
(``disk_open.py`` checks and moves); records whose block cannot be in the slot
file are dropped. Both are counted.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import lmdb
import torch

from tierkv.compress import FLAG_SHUFFLE, FLAG_ZSTD, AutoChooser, BlockCodec
from tierkv.config import COMPRESS_MODES
from tierkv.identity import IDENTITY_PREFIX
from tierkv.layout import KVLayout
from tierkv.pacing import UNPACED, Pacer
from tierkv.tiers.base import FailureHook, Lineage, as_bytes, checksum, round_up
from tierkv.tiers.disk_open import (
    DAMAGE, Damaged, check_before_mapping, foreign_layout, has_data, open_checked, read_count,
)

log = logging.getLogger("tierkv")
ALIGN = 4096
_REC = struct.Struct("<IIQd")  # slot, depth, checksum, created; parent hash follows (0 or 16 bytes)
_REC_CODED = struct.Struct("<IIQdII")  # ... then stored bytes, compress flags; parent follows
_SLOT = struct.Struct(">I")    # free-list keys sort by slot number

class Record:
    """One block's index entry. ``flags`` 0: raw (``stored`` is the block's size); else the
    ``tierkv.compress`` flags of the ``stored`` bytes at the start of its slot."""

    __slots__ = ("key", "slot", "depth", "checksum", "created", "stored", "flags", "parent")

    def __init__(self, key: bytes, raw: bytes, block_bytes: int) -> None:
        self.key = key
        if len(raw) in (_REC_CODED.size, _REC_CODED.size + 16):
            self.slot, self.depth, self.checksum, self.created, self.stored, self.flags = _REC_CODED.unpack_from(raw)
            self.parent = bytes(raw[_REC_CODED.size:]) or None
        else:
            self.slot, self.depth, self.checksum, self.created = _REC.unpack_from(raw)
            self.stored, self.flags = block_bytes, 0
            self.parent = bytes(raw[_REC.size:]) or None


def _parse(key: bytes, raw: bytes, block_bytes: int) -> Record | None:
    """The record stored under ``key``, or None when ``raw`` cannot be one (a damaged index).
    Raw records are 24 or 40 bytes (with a parent), compressed ones 32 or 48."""
    head = {_REC.size: _REC.size, _REC.size + 16: _REC.size,
            _REC_CODED.size: _REC_CODED.size, _REC_CODED.size + 16: _REC_CODED.size}.get(len(raw))
    if head is None or (len(raw) > head and bytes(raw[head:]) == bytes(key)):
        return None
    rec = Record(bytes(key), raw, block_bytes)
    if head == _REC_CODED.size and not (rec.flags and 0 < rec.stored < block_bytes):
        return None  # a compressed record always has flags and fewer bytes than the block
    return rec


class DiskTier:
    name = "l3"
    pacer: Pacer = UNPACED  # the owning store's: a put's slices and checksums are background pieces

    def __init__(self, path: str | os.PathLike, layout: KVLayout, num_blocks: int,
                 meta: dict[str, str] | None = None, direct_io: bool = True,
                 on_failure: FailureHook | None = None, create: bool = True, read_depth: int = 4,
                 compress: str = "off", compress_level: int = 1, compress_threads: int = 1) -> None:
        """Open (or create) the L3 directory ``path``; openers in any process take turns on ``path/open.lock``.

        Damaged files (an index LMDB rejects, or that kills the process reading it; unreadable
        meta records; a slot file that is not a file) are moved into ``path/damaged-<UTC time>/``
        (never deleted) and an empty L3 starts in their place, reported once through
        ``on_failure`` as ("l3", "damaged_index" or "damaged_slots", blocks lost or 0). With
        ``create=False`` (the offline tools) damage raises instead. Records whose bytes cannot
        be in the slot file (malformed, or past its end) are dropped and counted as corrupt.
        Configuration errors raise ValueError naming ``l3.path``: a path that cannot be a
        directory, a directory of another layout, one already open in this process.

        ``compress`` (``l3.compress``): ``off`` writes raw blocks, ``zstd`` every block that
        shrinks by a page, ``auto`` only while ``AutoChooser`` finds the get faster by 1.2x.
        Compressed blocks are read whatever the setting.
        """
        if not isinstance(read_depth, int) or isinstance(read_depth, bool) or not 1 <= read_depth <= 64:
            raise ValueError(f"l3.read_depth: expected an integer in 1..64, got {read_depth!r}")
        if compress not in COMPRESS_MODES:
            raise ValueError(f"l3.compress: expected one of {list(COMPRESS_MODES)}, got {compress!r}")
        self.compress = compress
        self._codec = (BlockCodec(layout.itemsize, layout.block_bytes, compress_level, compress_threads)
                       if compress != "off" else None)
        self._auto = AutoChooser(self._codec) if compress == "auto" else None
        self._auto_noted = ""
        self.path = Path(path).expanduser()
        self.read_depth = read_depth  # preadv calls in flight per get
        self.layout = layout
        self.block_bytes = layout.block_bytes
        self.stride = round_up(layout.block_bytes, ALIGN)
        self._hooked = on_failure is not None
        self._on_failure = on_failure or (lambda *a: None)
        if not create and not (self.path / "index").exists():
            raise FileNotFoundError(f"l3.path: no tierkv L3 directory at {self.path}")
        open_checked(self.path, lambda: self._open(num_blocks, meta or {}, direct_io), create, self._report_damage)
        self._local = threading.local()  # per-thread page-aligned bounce buffer

    # -- setup ----------------------------------------------------------------

    def _open(self, num_blocks: int, meta: dict[str, str], direct_io: bool) -> None:
        """Open index and slot file. Raises Damaged for damaged files, ValueError for configuration."""
        index, slots = self.path / "index", self.path / "slots.bin"
        check_before_mapping(self.path)
        self._env, self._fd = None, None
        try:
            self._blocks = None
            # metasync=False: one fsync per commit instead of two. LMDB keeps its integrity; an
            # OS crash may undo the last commit, which only loses that batch's records (their
            # data was synced first and is then in slots nobody points at).
            self._env = lmdb.open(str(index), map_size=max(1 << 30, num_blocks * 512),
                                  max_dbs=4, max_readers=512, subdir=True, lock=True, metasync=False)
            self._blocks = self._env.open_db(b"blocks")
            self._free = self._env.open_db(b"free")
            self._meta = self._env.open_db(b"meta")
            self._capacity = self._init_meta(num_blocks, meta, slots)
            self.direct = self._open_file(slots, direct_io)
            self._drop_unusable()
            self._size_file()
        except DAMAGE as exc:
            lost = self._entries()
            self._close_files()
            raise Damaged("damaged_index", lost, f"{type(exc).__name__}: {exc}") from None
        except (lmdb.Error, OSError) as exc:  # e.g. a second store on this directory in one process
            self._close_files()
            raise ValueError(f"l3.path: cannot open the L3 files under {self.path}: {exc}") from None
        except BaseException:
            self._close_files()
            raise

    def _init_meta(self, num_blocks: int, meta: dict[str, str], slots: Path) -> int:
        with self._env.begin(write=True) as txn:
            entries = txn.stat(self._blocks)["entries"]
            found = txn.get(b"layout_fingerprint", db=self._meta)
            if found is None and (entries or has_data(slots)):
                raise Damaged("damaged_index", entries, "the index has lost its meta records "
                              f"but {'holds blocks' if entries else 'slots.bin holds data'}")
            if found is not None and found != self.layout.fingerprint.encode():
                raise foreign_layout(self.path, self.layout, found, txn.get(b"layout", db=self._meta), entries)
            capacity = max(num_blocks, read_count(txn, self._meta, b"capacity", entries))
            read_count(txn, self._meta, b"next_slot", entries)
            txn.put(b"layout_fingerprint", self.layout.fingerprint.encode(), db=self._meta)
            txn.put(b"layout", repr(self.layout.to_dict()).encode(), db=self._meta)
            txn.put(b"capacity", str(capacity).encode(), db=self._meta)
            for k, v in meta.items():  # identity records say who wrote here: updated each open
                if k.startswith(IDENTITY_PREFIX) or txn.get(k.encode(), db=self._meta) is None:
                    txn.put(k.encode(), str(v).encode(), db=self._meta)
        return capacity

    def _open_file(self, path: Path, direct_io: bool) -> bool:
        flags = os.O_RDWR | os.O_CREAT
        if direct_io and hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(path, flags | os.O_DIRECT, 0o644)
                return True
            except OSError:
                log.warning("tierkv l3: O_DIRECT refused on %s (tmpfs?); using buffered IO", self.path)
        self._fd = os.open(path, flags, 0o644)
        return False

    def _size_file(self) -> None:
        size = self._capacity * self.stride
        if os.fstat(self._fd).st_size < size:
            # A full disk or a file-size limit must not stop the store: puts past the
            # end then fail (counted) and reads past it are short (misses).
            try:
                os.ftruncate(self._fd, size)
                os.posix_fallocate(self._fd, 0, size)
            except OSError as exc:
                log.warning("tierkv l3: could not size %s to %d bytes (%s); puts past its end will fail",
                            self.path / "slots.bin", size, exc)

    def _drop_unusable(self) -> None:
        """Drop the records whose block cannot be in the slot file: malformed, or past its end."""
        size = os.fstat(self._fd).st_size
        suspects = []
        with self._env.begin() as txn:
            for key, raw in txn.cursor(db=self._blocks):
                rec = _parse(key, raw, self.block_bytes)
                if rec is None or rec.slot * self.stride + self.block_bytes > size:
                    suspects.append((key, raw, rec))
        if not suspects:
            return
        size = os.fstat(self._fd).st_size  # another process's block lands before its record does
        bad = [s for s in suspects if s[2] is None or s[2].slot * self.stride + self.block_bytes > size]
        if bad:
            malformed = sum(rec is None for _, _, rec in bad)
            self._drop_records(bad)
            self._on_failure("l3", "corrupt", len(bad), f"{self.path}: {len(bad) - malformed} records point past "
                             f"the end of slots.bin ({size} bytes), {malformed} are malformed; dropped")

    def _report_damage(self, reason: str, lost: int, detail: str) -> None:
        if not self._hooked:
            log.warning("tierkv l3 %s: %s", reason, detail)
        self._on_failure("l3", reason, lost, detail)

    def _entries(self) -> int:
        """Blocks the index lists, or 0 when it cannot say."""
        if self._env is None or self._blocks is None:
            return 0
        try:
            with self._env.begin() as txn:
                return txn.stat(self._blocks)["entries"]
        except lmdb.Error:
            return 0

    def _close_files(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._env is not None:
            self._env.close()

    def meta(self) -> dict[str, str]:
        """Every meta record: layout, capacity, the first model id, and one ``identity:<digest>``
        record per model identity that opened this directory (``identity.recorded``)."""
        with self._env.begin() as txn:
            return {bytes(k).decode(): bytes(v).decode() for k, v in txn.cursor(db=self._meta)}

    # -- protocol -------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Slots in the directory: the largest capacity any opener asked for (read fresh)."""
        return self._refresh_capacity()

    @property
    def used(self) -> int:
        with self._env.begin() as txn:
            return txn.stat(self._blocks)["entries"]

    def view(self, key: bytes) -> None:
        """Never: the bytes are on disk (``get`` reads them)."""
        return None

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            with self._env.begin() as txn:
                return [txn.get(k, db=self._blocks) is not None for k in keys]
        except lmdb.Error as exc:
            self._on_failure("l3", "index", len(keys), f"{self.path}: {exc}")
            return [False] * len(keys)

    def put(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
            lineage: Sequence[Lineage] | None = None) -> list[bool]:
        """Persist blocks: data, fdatasync, then one LMDB commit. False where full or on IO error."""
        lineage = lineage or [Lineage(None, 0)] * len(keys)
        out = [False] * len(keys)
        try:
            with self._env.begin(write=True) as txn:
                todo, batch = [], set()
                for i, key in enumerate(keys):
                    # A key twice in one batch must take one slot: the second record would
                    # overwrite the first and leak its slot for good.
                    if key in batch or txn.get(key, db=self._blocks) is not None:
                        out[i] = True
                        continue
                    batch.add(key)
                    slot = self._take_slot(txn)
                    if slot is None:
                        self._on_failure("l3", "full", len(keys) - i, str(self.path))
                        break
                    todo.append((i, slot))
                if not todo:
                    return out
                stored = self._encode([blocks[i] for i, _ in todo])
                plain = [k for k, c in enumerate(stored) if c is None]
                sums = [0] * len(todo)
                if plain:
                    found = self._write_runs([(todo[k][1], blocks[todo[k][0]]) for k in plain],
                                             [keys[todo[k][0]] for k in plain])
                    for k, crc in zip(plain, found):
                        sums[k] = crc
                for k, coded in enumerate(stored):
                    if coded is not None:
                        sums[k] = self._write_coded(todo[k][1], keys[todo[k][0]], coded)
                os.fdatasync(self._fd)
                now = time.time()
                for (i, slot), crc, coded in zip(todo, sums, stored):
                    parent, depth = lineage[i]
                    head = (_REC.pack(slot, depth, crc, now) if coded is None else
                            _REC_CODED.pack(slot, depth, crc, now, len(coded), self._codec.flags))
                    txn.put(keys[i], head + (parent or b""), db=self._blocks)
                    out[i] = True
                self._note_auto(txn)
        except OSError as exc:
            reason = "full" if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else "io"
            self._on_failure("l3", reason, len(keys), f"{self.path}: {exc}")
            return [False] * len(keys)
        except lmdb.Error as exc:
            self._on_failure("l3", "index", len(keys), f"{self.path}: {exc}")
            return [False] * len(keys)
        return out

    def get(self, keys: Sequence[bytes], dst: Sequence[torch.Tensor]) -> list[bool]:
        """Read and verify blocks into ``dst``; a missing, short or corrupt block is False.

        Aligned destinations on consecutive slots are read with one preadv per piece (a run of
        them, about 4 MiB), ``read_depth`` pieces in flight on the process's reader threads, each
        verified by the thread that read it. Returns when every read has finished.
        """
        plan = self._plan(keys, dst)
        if plan is None:
            return [False] * len(keys)
        out, direct, staged, malformed = plan
        pieces = list(_pieces(direct, self.stride))
        t0 = time.perf_counter()
        if self.read_depth > 1 and len(pieces) > 1:
            # Several preadv in flight: a virtio or NVMe queue moves more bytes at depth > 1 than
            # one request at a time does (measured here: 0.48-1.06 GB/s at depth 1 against
            # 1.2-1.5 GB/s at 2-8), and each thread checksums what it read while the others wait.
            results = list(_readers(self.read_depth).map(self._read_piece, pieces))
        else:
            results = [self._read_piece(piece) for piece in pieces]
        if self._auto is not None and direct:
            self._auto.raw_read(len(direct) * self.block_bytes, time.perf_counter() - t0)
        bad = []
        for piece, result in zip(pieces, results):
            if isinstance(result, OSError):
                self._on_failure("l3", "io", len(piece), f"{self.path}: {result}")
                continue
            for (_, rec, i, _), good in zip(piece, result):
                if good:
                    out[i] = True
                else:
                    bad.append(rec)
        return self._settle(out, dst, staged, malformed, bad)

    def get_in_parts(self, keys: Sequence[bytes], dst: Sequence[torch.Tensor], parts: int,
                     progress) -> list[bool]:
        """``get``, reading each block in ``parts`` equal slices, slice 0 of every block first;
        ``progress(n)`` (on a reader thread) once slices ``[0, n)`` of every block have landed,
        unverified. Each block is verified once all its slices are in; the result is ``get``'s.
        Without slices that are whole O_DIRECT units, or with a destination that is not aligned,
        it is ``get`` (no progress until the end). Returns when every read has finished.
        """
        part = self.block_bytes // parts
        if parts < 2 or part * parts != self.block_bytes or part % ALIGN or self.stride != self.block_bytes:
            return self.get(keys, dst)
        plan = self._plan(keys, dst)
        if plan is None:
            return [False] * len(keys)
        out, direct, staged, malformed = plan
        if staged or not direct:
            return self.get(keys, dst)
        pending = [len(direct)] * parts
        failed: dict[int, OSError | None] = {}  # index into direct -> its read's error (None: short)
        lock = threading.Lock()
        reported = [0]

        def read(p: int, k: int, offset: int, view: memoryview) -> None:
            short, error = False, None
            try:
                short = os.preadv(self._fd, [view], offset) != len(view)
            except OSError as exc:
                error = exc
            with lock:
                if short or error is not None:
                    failed.setdefault(k, error)
                pending[p] -= 1
                n_done = reported[0]
                while n_done < parts and pending[n_done] == 0:
                    n_done += 1
                advanced = n_done > reported[0]
                reported[0] = n_done
            if advanced and n_done < parts:
                progress(n_done)  # the last slice is reported by the caller, once verified

        pool = _readers(max(1, self.read_depth))
        futures = [_submit(pool, read, p, k, slot * self.stride + p * part, view[p * part:(p + 1) * part])
                   for p in range(parts) for k, (slot, _, _, view) in enumerate(direct)]
        for f in futures:
            f.result()

        def verify(k: int) -> bool:
            _, rec, _, view = direct[k]
            return k not in failed and checksum(rec.key, view) == rec.checksum

        bad = []
        ios = [k for k, e in failed.items() if e is not None]  # counted as IO failures, kept
        for k, good in enumerate(pool.map(verify, range(len(direct)))):
            if good:
                out[direct[k][2]] = True
            elif k not in ios:
                bad.append(direct[k][1])
        if ios:
            self._on_failure("l3", "io", len(ios), f"{self.path}: {failed[ios[0]]}")
        return self._settle(out, dst, staged, malformed, bad)

    def _plan(self, keys: Sequence[bytes], dst: Sequence[torch.Tensor]):
        """(out, direct, staged, malformed) for a read of ``keys`` into ``dst``; None if LMDB failed.
        direct: (slot, record, position, aligned view) sorted by slot; staged: (record, position)."""
        try:
            with self._env.begin() as txn:
                recs = [txn.get(k, db=self._blocks) for k in keys]
        except lmdb.Error as exc:
            self._on_failure("l3", "index", len(keys), f"{self.path}: {exc}")
            return None
        direct, staged, malformed = [], [], []
        for i, (key, raw) in enumerate(zip(keys, recs)):
            if raw is None:
                continue
            rec = _parse(key, raw, self.block_bytes)
            if rec is None:
                malformed.append((key, raw, None))
                continue
            view = self._aligned(dst[i]) if rec.slot < self._capacity and not rec.flags else None
            if view is None:
                staged.append((rec, i))
            else:
                direct.append((rec.slot, rec, i, view))
        direct.sort(key=lambda item: item[0])
        return [False] * len(keys), direct, staged, malformed

    def _settle(self, out: list[bool], dst: Sequence[torch.Tensor], staged: list, malformed: list,
                bad: list[Record]) -> list[bool]:
        """Read the staged blocks (compressed ones, and those whose destination is not aligned),
        ``read_depth`` at a time; count and remove bad and malformed records."""
        def read(item: tuple[Record, int]) -> bool | OSError:
            try:
                return self._read_one(item[0], dst[item[1]])
            except OSError as exc:
                return exc

        many = self.read_depth > 1 and len(staged) > 1
        results = list(_readers(self.read_depth).map(read, staged)) if many else [read(item) for item in staged]
        for (rec, i), ok in zip(staged, results):
            if isinstance(ok, OSError):
                self._on_failure("l3", "io", 1, f"{self.path}: {ok}")
                continue
            if ok:
                out[i] = True
            else:
                bad.append(rec)
        if bad:
            self._on_failure("l3", "corrupt", len(bad), f"{self.path}: checksum mismatch or short read")
            self._remove_if_unchanged(bad)
        if malformed:
            self._on_failure("l3", "corrupt", len(malformed), f"{self.path}: malformed records")
            self._drop_records(malformed)
        return out

    def remove(self, keys: Sequence[bytes]) -> None:
        try:
            with self._env.begin(write=True) as txn:
                for key in keys:
                    raw = txn.pop(key, db=self._blocks)
                    rec = _parse(key, raw, self.block_bytes) if raw is not None else None
                    if rec is not None:  # a malformed record's slot number means nothing
                        txn.put(_SLOT.pack(rec.slot), b"", db=self._free)
        except lmdb.Error as exc:
            self._on_failure("l3", "index", len(keys), f"{self.path}: {exc}")

    # -- inspection -----------------------------------------------------------

    def records(self) -> Iterator[Record]:
        """Every well-formed block record, in key order (a consistent snapshot).

        Never raises for a damaged index: a walk that LMDB cannot finish ends early, counted.
        """
        try:
            with self._env.begin() as txn:
                for key, raw in txn.cursor(db=self._blocks):
                    rec = _parse(key, raw, self.block_bytes)
                    if rec is not None:
                        yield rec
        except lmdb.Error as exc:
            self._on_failure("l3", "index", 0, f"{self.path}: the record walk stopped: {exc}")

    def verify(self, repair: bool = False) -> tuple[int, list[bytes]]:
        """Read every block and check it; returns (blocks checked, bad keys). ``repair`` removes the bad."""
        buf = torch.empty(self.layout.block_shape, dtype=self.layout.torch_dtype)
        checked, bad = 0, []
        for rec in list(self.records()):
            checked += 1
            try:
                ok = self._read_one(rec, buf)
            except OSError:
                ok = False
            if not ok:
                bad.append(rec)
        if repair and bad:
            self._remove_if_unchanged(bad)
        return checked, [r.key for r in bad]

    def read_raw(self, key: bytes) -> bytes | None:
        """The stored bytes of one block after verification (for export)."""
        buf = torch.empty(self.layout.block_shape, dtype=self.layout.torch_dtype)
        return bytes(as_bytes(buf)) if self.get([key], [buf])[0] else None

    def close(self) -> None:
        self._close_files()
        for codec in (self._codec, getattr(self, "_codec_read", None)):
            if codec is not None:
                codec.close()

    # -- internals ------------------------------------------------------------

    def _take_slot(self, txn) -> int | None:
        cur = txn.cursor(db=self._free)
        if cur.first():
            slot = _SLOT.unpack(cur.key())[0]
            cur.delete()
            return slot
        raw = txn.get(b"next_slot", db=self._meta)
        slot = int(raw) if raw else 0
        if slot >= self._capacity and slot >= self._refresh_capacity(txn):
            return None
        txn.put(b"next_slot", str(slot + 1).encode(), db=self._meta)
        return slot

    def _refresh_capacity(self, txn=None) -> int:
        # Another process may have opened the directory with more slots (and grown the
        # file): its blocks past our own capacity are valid, not corrupt.
        if getattr(self, "_fd", None) is None:  # closed
            return self._capacity
        if txn is None:
            with self._env.begin() as rtxn:
                raw = rtxn.get(b"capacity", db=self._meta)
        else:
            raw = txn.get(b"capacity", db=self._meta)
        if raw is not None and int(raw) > self._capacity:
            self._capacity = int(raw)
        return self._capacity

    @property
    def _bounce(self) -> mmap.mmap:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = mmap.mmap(-1, self.stride)
        return buf

    def _aligned(self, t: torch.Tensor) -> memoryview | None:
        """A byte view usable for O_DIRECT when ``t`` is page-aligned and stride-sized, else None."""
        if (t.device.type == "cpu" and t.is_contiguous() and self.stride == self.block_bytes
                and t.data_ptr() % ALIGN == 0):
            return as_bytes(t)
        return None

    def _write_runs(self, items: list[tuple[int, torch.Tensor]], keys: list[bytes]) -> list[int]:
        """Write blocks to their slots (one pwritev per run of consecutive aligned slots); checksums.

        The checksums of the aligned blocks are taken on the verifier thread while they are written.
        """
        sums = [0] * len(items)
        direct = []
        for j, ((slot, src), key) in enumerate(zip(items, keys)):
            src = src if src.device.type == "cpu" else src.cpu()
            view = self._aligned(src)
            if view is None:
                bounce = self._bounce
                view = memoryview(bounce)
                view[: self.block_bytes] = as_bytes(src.contiguous())
                sums[j] = checksum(key, view[: self.block_bytes])
                self._pwrite(view, slot, 1)
            else:
                direct.append((slot, j, view))
        if not direct:
            return sums
        todo = [(keys[j], view) for _, j, view in direct]
        pacer = self.pacer
        future = _submit(_verifier(), _checksums, todo, pacer) if len(direct) > 1 else None
        direct.sort(key=lambda item: item[0])
        # Paced, a write goes in slices of about _PACED_BYTES, each a piece that foreground work
        # waits at most one of; unpaced, in runs of up to _MAX_RUN blocks.
        limit = max(1, _PACED_BYTES // self.stride) if pacer.enabled else _MAX_RUN
        try:
            for run in _runs(direct, limit):
                with pacer.piece():
                    self._pwrite([item[2] for item in run], run[0][0], len(run))
        finally:
            found = future.result() if future is not None else _checksums(todo, pacer)
        for (_, j, _), crc in zip(sorted(direct, key=lambda item: item[1]), found):
            sums[j] = crc
        return sums

    def _encode(self, blocks: list[torch.Tensor]) -> list[bytes | None]:
        """Each block's compressed bytes where it is stored compressed (it must save a page), else None.
        ``auto`` while off codes a sample block now and then instead (its ratio and decode time)."""
        if self._codec is None:
            return [None] * len(blocks)
        views = [as_bytes(b if b.device.type == "cpu" and b.is_contiguous() else b.contiguous().cpu())
                 for b in blocks]
        if self._auto is not None and not self._auto.choice.on:
            if views and self._auto.needs_samples():
                self._auto.sample(views[0])
            return [None] * len(blocks)
        return self._codec.encode_many(views, limit=self.stride - ALIGN + 1)

    def _write_coded(self, slot: int, key: bytes, stored: bytes) -> int:
        """Write compressed bytes, zero-padded to whole pages, at the start of ``slot``; their checksum."""
        size = round_up(len(stored), ALIGN)
        view = memoryview(self._bounce)
        view[: len(stored)] = stored
        view[len(stored): size] = bytes(size - len(stored))
        with self.pacer.piece():
            self._pwrite(view[:size], slot, 1, size)
        return checksum(key, stored)

    def _note_auto(self, txn) -> None:
        """Record what ``auto`` decides in the meta records (``tierkv info`` shows it), when it changes."""
        if self._auto is None:
            return
        why = self._auto.choice.why
        if why != self._auto_noted:
            txn.put(b"compress_auto", why.encode(), db=self._meta)
            self._auto_noted = why

    @property
    def _decoder(self) -> BlockCodec:
        """The codec that reads compressed records: this tier's, or (compress off) one made on first use."""
        if self._codec is None:
            self._codec_read = getattr(self, "_codec_read", None) or BlockCodec(
                self.layout.itemsize, self.block_bytes)
            return self._codec_read
        return self._codec

    def compression(self) -> dict:
        """``l3.compress`` as this opener runs it, and ``auto``'s current choice (None otherwise)."""
        choice = self._auto.choice if self._auto is not None else None
        return {"mode": self.compress, "auto": None if choice is None else {"on": choice.on, "gain": round(
            choice.gain, 3), "why": choice.why}}

    def _pwrite(self, views, slot: int, count: int, total: int | None = None) -> None:
        views = views if isinstance(views, list) else [views]
        offset, total = slot * self.stride, count * self.stride if total is None else total
        done = os.pwritev(self._fd, views, offset)
        while done < total:  # a short write (a disk filling up): continue it, so a full disk says ENOSPC
            n = os.pwritev(self._fd, _skip(views, done), offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short write at slot {slot}: {done} of {total} bytes")
            done += n

    def _read_piece(self, piece: list[tuple]) -> list[bool] | OSError:
        """One preadv of consecutive slots into aligned views; whether each block arrived whole and
        verified. Any thread; an OSError is returned (not raised) for the caller to count."""
        try:
            n = os.preadv(self._fd, [item[3] for item in piece], piece[0][0] * self.stride)
        except OSError as exc:
            return exc
        return [n >= (j + 1) * self.stride and checksum(rec.key, view) == rec.checksum
                for j, (_, rec, _, view) in enumerate(piece)]

    def _read_one(self, rec: Record, dst: torch.Tensor) -> bool:
        if rec.slot >= self._capacity and rec.slot >= self._refresh_capacity():
            return False
        if rec.flags:
            return self._read_coded(rec, dst)
        on_cpu = dst.device.type == "cpu"
        view = self._aligned(dst) if on_cpu else None
        bounce = self._bounce
        target = view if view is not None else memoryview(bounce)
        n = os.preadv(self._fd, [target], rec.slot * self.stride)
        if n < self.block_bytes:
            return False
        if checksum(rec.key, target[: self.block_bytes]) != rec.checksum:
            return False
        if view is None:
            self._copy_out(torch.frombuffer(bounce, dtype=torch.uint8, count=self.block_bytes), dst)
        return True

    def _read_coded(self, rec: Record, dst: torch.Tensor) -> bool:
        """Read a compressed block's stored bytes (whole pages) into the bounce buffer, check them,
        then decode into ``dst`` (straight into it when it is a contiguous CPU block)."""
        if rec.flags & ~(FLAG_ZSTD | FLAG_SHUFFLE) or not rec.flags & FLAG_ZSTD:
            return False  # a format this version does not know: never guessed at
        target = memoryview(self._bounce)[: round_up(rec.stored, ALIGN)]
        if os.preadv(self._fd, [target], rec.slot * self.stride) < rec.stored:
            return False
        stored = target[: rec.stored]
        if checksum(rec.key, stored) != rec.checksum:
            return False
        direct = dst.device.type == "cpu" and dst.is_contiguous()
        out = dst if direct else torch.empty(self.block_bytes, dtype=torch.uint8)
        if not self._decoder.decode_into(stored, rec.flags, as_bytes(out)):
            return False
        if not direct:
            self._copy_out(out, dst)
        return True

    def _copy_out(self, staged: torch.Tensor, dst: torch.Tensor) -> None:
        """A block's bytes (a uint8 CPU tensor) into ``dst`` of any device and strides."""
        if dst.is_contiguous():
            on_cpu = dst.device.type == "cpu"
            dst.view(torch.uint8).view(-1).copy_(staged if on_cpu else staged.to(dst.device))
        else:  # a strided view cannot be reinterpreted as bytes
            dst.copy_(staged.view(dst.dtype).view(dst.shape))

    def _drop_records(self, items: list[tuple[bytes, bytes, Record | None]]) -> None:
        """Delete (key, raw value, parsed record) entries still stored unchanged; free their slots
        when the record names one that is in use (below next_slot and the capacity)."""
        try:
            with self._env.begin(write=True) as txn:
                raw_next = txn.get(b"next_slot", db=self._meta)
                limit = min(self._capacity, int(raw_next) if raw_next else 0)
                for key, raw, rec in items:
                    if txn.get(key, db=self._blocks) == raw:
                        txn.delete(key, db=self._blocks)
                        if rec is not None and rec.slot < limit:
                            txn.put(_SLOT.pack(rec.slot), b"", db=self._free)
        except lmdb.Error as exc:
            self._on_failure("l3", "index", len(items), f"{self.path}: {exc}")

    def _remove_if_unchanged(self, recs: list[Record]) -> None:
        """Delete records a read found bad, where the index still holds that very record, and
        free their slots. The same key put again since (by another process, after a remove) has
        the same checksum but another slot and time: it is a different record and stays, and
        the stale slot, which a newer block may hold, is not freed a second time."""
        try:
            with self._env.begin(write=True) as txn:
                for rec in recs:
                    raw = txn.get(rec.key, db=self._blocks)
                    now = _parse(rec.key, raw, self.block_bytes) if raw is not None else None
                    if now is not None and (now.slot, now.checksum, now.created) == (
                            rec.slot, rec.checksum, rec.created):
                        txn.delete(rec.key, db=self._blocks)
                        txn.put(_SLOT.pack(rec.slot), b"", db=self._free)
        except lmdb.Error as exc:
            self._on_failure("l3", "index", len(recs), f"{self.path}: {exc}")


def _skip(views: list, n: int) -> list[memoryview]:
    """The buffers ``views`` without their first ``n`` bytes."""
    out = []
    for v in views:
        v = memoryview(v).cast("B")
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


_MAX_RUN = 64  # blocks per preadv/pwritev (well under IOV_MAX; 32 MiB at 512 KiB blocks)
_PIECE_BYTES = 4 << 20  # a read in flight: big enough that a thread hand-off costs nothing beside it
_PACED_BYTES = 1 << 20  # a paced write slice: well under a millisecond of foreground delay


def _runs(items: list[tuple], limit: int = _MAX_RUN) -> Iterator[list[tuple]]:
    """Split (slot, ...) items sorted by slot into runs of at most ``limit`` consecutive slots."""
    run: list[tuple] = []
    for item in items:
        if run and (item[0] != run[-1][0] + 1 or len(run) == limit):
            yield run
            run = []
        run.append(item)
    if run:
        yield run


def _pieces(items: list[tuple], stride: int) -> Iterator[list[tuple]]:
    """Runs of consecutive slots cut to about ``_PIECE_BYTES`` each (at least one block)."""
    yield from _runs(items, max(1, min(_MAX_RUN, _PIECE_BYTES // stride)))


def _checksums(items: list[tuple[bytes, memoryview]], pacer: Pacer = UNPACED) -> list[int]:
    if not pacer.enabled:
        return [checksum(key, view) for key, view in items]
    out = []
    for key, view in items:
        with pacer.piece():
            out.append(checksum(key, view))
    return out


def _submit(pool: ThreadPoolExecutor, fn, *args) -> Future:
    """``pool.submit``, or, once the interpreter's exit has stopped the pool's thread (a store
    closing at exit still writes), ``fn`` run here: the same result, one thread."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:
            done.set_exception(exc)
        return done


_pool: tuple[int, ThreadPoolExecutor] | None = None  # (owning pid, pool): a forked child makes its own
_pool_lock = threading.Lock()


def _verifier() -> ThreadPoolExecutor:
    """One thread per process that checksums a put's blocks while they are written (xxh3 releases the GIL)."""
    global _pool
    pool = _pool
    if pool is None or pool[0] != os.getpid():
        with _pool_lock:
            if _pool is None or _pool[0] != os.getpid():
                _pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="tierkv-l3-verify"))
            pool = _pool
    return pool[1]


_read_pools: tuple[int, dict[int, ThreadPoolExecutor]] = (0, {})  # (owning pid, {depth: pool})


def _readers(depth: int) -> ThreadPoolExecutor:
    """The process's ``depth`` L3 reader threads, shared by its stores of that depth; preadv and xxh3
    release the GIL, so they read and verify in parallel. A forked child makes its own."""
    global _read_pools
    pid, pools = _read_pools
    pool = pools.get(depth) if pid == os.getpid() else None
    if pool is None:
        with _pool_lock:
            if _read_pools[0] != os.getpid():
                _read_pools = (os.getpid(), {})
            pools = _read_pools[1]
            if depth not in pools:
                pools[depth] = ThreadPoolExecutor(depth, thread_name_prefix="tierkv-l3-read")
            pool = pools[depth]
    return pool
