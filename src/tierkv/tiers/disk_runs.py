"""How L3 cuts a batch of slots into IO calls: runs of consecutive slots, pieces of a read.

Pure: items in, lists of items out. ``(slot, ...)`` tuples sorted by slot are cut where
the slots stop being consecutive or a run reaches its limit, so each run is one
``pwritev``/``preadv`` at one offset.
"""

from __future__ import annotations

from collections.abc import Iterator

MAX_RUN = 64  # blocks per preadv/pwritev (well under IOV_MAX; 32 MiB at 512 KiB blocks)
PIECE_BYTES = 4 << 20  # a read in flight: big enough that a thread hand-off costs nothing beside it
PACED_BYTES = 1 << 20  # a paced write slice: well under a millisecond of foreground delay


def runs(items: list[tuple], limit: int = MAX_RUN) -> Iterator[list[tuple]]:
    """Split (slot, ...) items sorted by slot into runs of at most ``limit`` consecutive slots."""
    run: list[tuple] = []
    for item in items:
        if run and (item[0] != run[-1][0] + 1 or len(run) == limit):
            yield run
            run = []
        run.append(item)
    if run:
        yield run


def pieces(items: list[tuple], stride: int) -> Iterator[list[tuple]]:
    """Runs of consecutive slots cut to about ``PIECE_BYTES`` each (at least one block)."""
    yield from runs(items, max(1, min(MAX_RUN, PIECE_BYTES // stride)))
