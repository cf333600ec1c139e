"""L3's write path: a put's blocks encoded, then written into the slots the index gave them.

``BlockWriter.encode`` turns blocks into their stored bytes where compression is on and
saves a page (byte planes + zstd, ``tierkv.compress``); it touches no file and no index, so
the tier runs it before its LMDB write transaction opens. ``write`` puts raw blocks into
their slots (one pwritev per run of consecutive aligned slots, checksummed on the verifier
thread while they are written) and compressed ones at the start of theirs, zero-padded to
whole pages; it returns each block's checksum over the bytes stored. Deciding which slot a
block takes is the tier's (under the write transaction); this file only moves bytes.
Thread-safe for distinct slots (the codec and the bounce buffers are per thread).
"""

from __future__ import annotations

import torch

from tierkv.compress import AutoChooser, BlockCodec
from tierkv.pacing import Pacer
from tierkv.tiers.base import as_bytes, checksum, round_up
from tierkv.tiers.disk_file import SlotFile
from tierkv.tiers.disk_record import ALIGN
from tierkv.tiers.disk_runs import MAX_RUN, PACED_BYTES, runs
from tierkv.tiers.disk_threads import checksums, submit, verifier


class BlockWriter:
    """Encodes and writes blocks into ``file``; ``codec`` None: compression off; ``auto``: ``auto``'s chooser."""

    def __init__(self, file: SlotFile, codec: BlockCodec | None, auto: AutoChooser | None) -> None:
        self.file = file
        self.codec = codec
        self.auto = auto

    def encode(self, blocks: list[torch.Tensor]) -> list[bytes | None]:
        """Each block's compressed bytes where it is stored compressed (it must save a page), else None.
        ``auto`` while off codes a sample block now and then instead (its ratio and decode time).
        CPU work only (zstd releases the GIL); no file or index is touched."""
        if self.codec is None:
            return [None] * len(blocks)
        views = [as_bytes(b if b.device.type == "cpu" and b.is_contiguous() else b.contiguous().cpu())
                 for b in blocks]
        if self.auto is not None and not self.auto.choice.on:
            if views and self.auto.needs_samples():
                self.auto.sample(views[0])
            return [None] * len(blocks)
        return self.codec.encode_many(views, limit=self.file.stride - ALIGN + 1)

    def write(self, slots: list[int], keys: list[bytes], blocks: list[torch.Tensor],
              stored: list[bytes | None], pacer: Pacer) -> list[int]:
        """Write each block (raw where ``stored`` is None, else its stored bytes) into its slot;
        returns each one's checksum over what was stored. Raises OSError (nothing is synced)."""
        sums = [0] * len(slots)
        plain = [k for k, c in enumerate(stored) if c is None]
        if plain:
            found = self._write_runs([(slots[k], blocks[k]) for k in plain], [keys[k] for k in plain], pacer)
            for k, crc in zip(plain, found):
                sums[k] = crc
        for k, coded in enumerate(stored):
            if coded is not None:
                sums[k] = self._write_coded(slots[k], keys[k], coded, pacer)
        return sums

    def _write_runs(self, items: list[tuple[int, torch.Tensor]], keys: list[bytes], pacer: Pacer) -> list[int]:
        """Write blocks to their slots (one pwritev per run of consecutive aligned slots); checksums.

        The checksums of the aligned blocks are taken on the verifier thread while they are written.
        """
        file = self.file
        sums = [0] * len(items)
        direct = []
        for j, ((slot, src), key) in enumerate(zip(items, keys)):
            src = src if src.device.type == "cpu" else src.cpu()
            view = file.aligned(src)
            if view is None:
                view = memoryview(file.bounce)
                view[: file.block_bytes] = as_bytes(src.contiguous())
                sums[j] = checksum(key, view[: file.block_bytes])
                file.pwrite(view, slot, 1)
            else:
                direct.append((slot, j, view))
        if not direct:
            return sums
        todo = [(keys[j], view) for _, j, view in direct]
        future = submit(verifier(), checksums, todo, pacer) if len(direct) > 1 else None
        direct.sort(key=lambda item: item[0])
        # Paced, a write goes in slices of about PACED_BYTES, each a piece that foreground work
        # waits at most one of; unpaced, in runs of up to MAX_RUN blocks.
        limit = max(1, PACED_BYTES // file.stride) if pacer.enabled else MAX_RUN
        try:
            for run in runs(direct, limit):
                with pacer.piece():
                    file.pwrite([item[2] for item in run], run[0][0], len(run))
        finally:
            found = future.result() if future is not None else checksums(todo, pacer)
        for (_, j, _), crc in zip(sorted(direct, key=lambda item: item[1]), found):
            sums[j] = crc
        return sums

    def _write_coded(self, slot: int, key: bytes, stored: bytes, pacer: Pacer) -> int:
        """Write compressed bytes, zero-padded to whole pages, at the start of ``slot``; their checksum."""
        size = round_up(len(stored), ALIGN)
        view = memoryview(self.file.bounce)
        view[: len(stored)] = stored
        view[len(stored): size] = bytes(size - len(stored))
        with pacer.piece():
            self.file.pwrite(view[:size], slot, 1, size)
        return checksum(key, stored)
