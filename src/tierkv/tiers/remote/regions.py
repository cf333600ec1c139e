"""Memory a transfer engine may move blocks to and from without staging: registered regions and trailer pages.

Deciding only: which caller buffers lie inside memory registered with the
pool's client, and which small registered page holds the 64-byte trailers of
one batch. Registering itself is the backend's call (it talks to the pool).
"""

from __future__ import annotations

import bisect
import mmap
import queue
import threading

import numpy as np

from tierkv.tiers.remote.base import RemoteUnavailable
from tierkv.tiers.remote.codec import TRAILER_BYTES


def address(buf: memoryview | mmap.mmap) -> int:
    """The address of the first byte of a buffer (read-only buffers included)."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data if len(buf) else 0


class Regions:
    """Registered ``[start, end)`` address ranges, some of them slots with trailer room. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._slots: list[int] = []  # slot size of a region whose slots have trailer room, else 0

    def add(self, ptr: int, nbytes: int, slot_bytes: int = 0) -> None:
        with self._lock:
            i = bisect.bisect(self._starts, ptr)
            self._starts.insert(i, ptr)
            self._ends.insert(i, ptr + nbytes)
            self._slots.insert(i, slot_bytes)

    def remove(self, ptr: int) -> None:
        with self._lock:
            if ptr in self._starts:
                i = self._starts.index(ptr)
                del self._starts[i], self._ends[i], self._slots[i]

    def all(self) -> list[tuple[int, int]]:
        """(ptr, nbytes) of every region, for registering them again with a new client."""
        with self._lock:
            return [(s, e - s) for s, e in zip(self._starts, self._ends)]

    def placement(self, ptrs: list[int], nbytes: int) -> str | None:
        """Where ``nbytes`` blocks at ``ptrs`` lie, in one pass: ``"room"`` when every one starts a
        slot whose block is followed by room for a trailer (a whole value may land and leave
        there), ``"plain"`` when every one lies inside a registered region, else None."""
        value = nbytes + TRAILER_BYTES
        room = True
        with self._lock:
            for ptr in ptrs:
                i = self._find(ptr, nbytes)
                if i < 0:
                    return None
                slot = self._slots[i]
                room = room and slot >= value and not (ptr - self._starts[i]) % slot and ptr + value <= self._ends[i]
        return "room" if room else "plain"

    def covers(self, ptrs: list[int], nbytes: int) -> bool:
        """True when every ``[ptr, ptr + nbytes)`` lies inside one registered region."""
        return self.placement(ptrs, nbytes) is not None

    def with_room(self, ptrs: list[int], nbytes: int) -> bool:
        """True when every ``ptr`` starts a slot with room for a trailer after its block."""
        return self.placement(ptrs, nbytes) == "room"

    def _find(self, ptr: int, nbytes: int) -> int:
        """The region holding ``[ptr, ptr + nbytes)``, or -1. Caller holds the lock."""
        i = bisect.bisect(self._starts, ptr) - 1
        return i if i >= 0 and ptr + nbytes <= self._ends[i] else -1


class TrailerPages:
    """``pages`` registered pages of ``per_page`` 64-byte trailer slots; a batch borrows one page.

    Borrowing blocks up to ``timeout_s`` when every page is out (that many
    direct calls already running), then raises RemoteUnavailable.
    """

    def __init__(self, pages: int, per_page: int, timeout_s: float) -> None:
        self.page_bytes = per_page * TRAILER_BYTES
        self.buf = mmap.mmap(-1, pages * self.page_bytes)
        self.view = memoryview(self.buf)
        self.ptr = address(self.buf)
        self.timeout_s = timeout_s
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for page in range(pages):
            self._free.put(page)

    def borrow(self) -> int:
        """A page's byte offset in ``buf``; give it back with ``give_back`` once the call has returned."""
        try:
            return self._free.get(timeout=self.timeout_s) * self.page_bytes
        except queue.Empty:
            raise RemoteUnavailable(f"busy: every trailer page still in use after {self.timeout_s:.3f}s") from None

    def give_back(self, offset: int) -> None:
        self._free.put(offset // self.page_bytes)

    def slots(self, offset: int, n: int) -> list[bytes]:
        """Copies of the first ``n`` trailer slots of the page at ``offset``."""
        page = bytes(self.view[offset:offset + n * TRAILER_BYTES])
        return [page[j * TRAILER_BYTES:(j + 1) * TRAILER_BYTES] for j in range(n)]

