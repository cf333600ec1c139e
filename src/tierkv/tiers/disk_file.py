"""slots.bin: L3's one preallocated slot file, read and written at slot offsets (docs/design.md §5).

Slot k sits at offset k x stride (stride = block bytes rounded up to 4 KiB). The file is
opened with O_DIRECT where the filesystem allows it (buffered IO otherwise, e.g. tmpfs), so
every transfer goes through page-aligned memory: the caller's block when it is aligned and
stride-sized, else a per-thread bounce buffer. ``SlotFile`` owns the file descriptor until
``close``; it knows nothing of keys or records. Thread-safe: positional IO only, and each
thread has its own bounce buffer.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from pathlib import Path

import torch

from tierkv.tiers.base import as_bytes, round_up
from tierkv.tiers.disk_record import ALIGN

log = logging.getLogger("tierkv")


class SlotFile:
    """The slot file at ``path`` of ``block_bytes`` blocks; ``direct`` says whether O_DIRECT is on."""

    def __init__(self, path: Path, block_bytes: int, direct_io: bool, label: Path) -> None:
        """Open (or create) ``path``; raises OSError where it cannot be opened. ``label`` names the
        L3 directory in log lines."""
        self.path = path
        self.block_bytes = block_bytes
        self.stride = round_up(block_bytes, ALIGN)
        self._label = label
        self._local = threading.local()
        self.fd: int | None = None
        flags = os.O_RDWR | os.O_CREAT
        self.direct = False
        if direct_io and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError:
                log.warning("tierkv l3: O_DIRECT refused on %s (tmpfs?); using buffered IO", label)
        if self.fd is None:
            self.fd = os.open(path, flags, 0o644)

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def grow(self, slots: int) -> None:
        """Make room for ``slots`` slots. A full disk or a file-size limit must not stop the store:
        it is logged, puts past the end then fail (counted) and reads past it are short (misses)."""
        size = slots * self.stride
        if self.size < size:
            try:
                os.ftruncate(self.fd, size)
                os.posix_fallocate(self.fd, 0, size)
            except OSError as exc:
                log.warning("tierkv l3: could not size %s to %d bytes (%s); puts past its end will fail",
                            self.path, size, exc)

    @property
    def bounce(self) -> mmap.mmap:
        """This thread's page-aligned buffer of one slot."""
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = mmap.mmap(-1, self.stride)
        return buf

    def aligned(self, t: torch.Tensor) -> memoryview | None:
        """A byte view usable for O_DIRECT when ``t`` is page-aligned and stride-sized, else None."""
        if (t.device.type == "cpu" and t.is_contiguous() and self.stride == self.block_bytes
                and t.data_ptr() % ALIGN == 0):
            return as_bytes(t)
        return None

    def pwrite(self, views, slot: int, count: int, total: int | None = None) -> None:
        """Write ``views`` (whole pages) from the start of ``slot``: ``count`` slots, or ``total``
        bytes. A short write is continued, so a full disk raises ENOSPC rather than losing bytes."""
        views = views if isinstance(views, list) else [views]
        offset, total = slot * self.stride, count * self.stride if total is None else total
        done = os.pwritev(self.fd, views, offset)
        while done < total:
            n = os.pwritev(self.fd, _skip(views, done), offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short write at slot {slot}: {done} of {total} bytes")
            done += n

    def read(self, views: list, slot: int) -> int:
        """One preadv into ``views`` from the start of ``slot``; the bytes read (short past the end)."""
        return os.preadv(self.fd, views, slot * self.stride)

    def read_at(self, view, offset: int) -> int:
        """One preadv into ``view`` at byte ``offset`` (a page multiple)."""
        return os.preadv(self.fd, [view], offset)

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def copy_out(staged: torch.Tensor, dst: torch.Tensor) -> None:
    """A block's bytes (a uint8 CPU tensor) into ``dst`` of any device and strides."""
    if dst.is_contiguous():
        on_cpu = dst.device.type == "cpu"
        dst.view(torch.uint8).view(-1).copy_(staged if on_cpu else staged.to(dst.device))
    else:  # a strided view cannot be reinterpreted as bytes
        dst.copy_(staged.view(dst.dtype).view(dst.shape))


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
