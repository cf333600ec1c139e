"""Byte-plane shuffle + zstandard for the lower tiers (L3, L4), and the rule ``auto`` decides by.

KV in bf16/fp16/fp32 compresses poorly as raw bytes: each element's exponent byte sits between
mantissa bytes that look random. Split into byte planes first (plane k holds byte k of every
element: the shuffle blosc uses) and the exponent planes compress; the mantissa planes of real KV do not
(measured: ratio 1.00), so each plane is its own zstd frame or, where zstd saves nothing, kept
raw, and decoding copies those. Stored layout with ``FLAG_SHUFFLE``: ``itemsize`` u32 lengths
(little-endian; a length equal to the plane's size is a raw plane), then the planes. Without it
(1-byte elements, or ``shuffled=False``): one zstd frame of the block. A block is stored
compressed only where that saves space (``BlockCodec.encode`` returns None otherwise); what was
stored says so (the flags in the L3 record or the L4 trailer), so raw and compressed blocks sit
side by side in one tier and the cache key never changes.

``choose`` is the pure rule ``auto`` applies: compression goes on only where the get bandwidth
it predicts from a measured ratio, decode speed and raw link speed wins by ``WIN`` (1.2x).
``AutoChooser`` gathers those figures from a tier's own traffic. Nothing here does IO.
Thread-safety: ``BlockCodec`` keeps one zstd context and scratch buffer per thread, so any
thread may call it; ``AutoChooser`` takes its own lock.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

FLAG_ZSTD = 1     # the stored bytes are zstd-coded
FLAG_SHUFFLE = 2  # ... as byte planes, each a frame or raw (the layout above)
WIN = 1.2         # auto turns compression on only for a predicted gain of at least this
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_PROBE = 16 << 10    # bytes of a plane zstd tries first: a plane that does not shrink there stays raw
_WORTH = 0.97        # a plane is coded only where its frame is at most this share of it


def _zstd():
    try:
        import zstandard
    except ImportError as exc:  # a declared dependency: only a broken install lacks it
        raise ImportError("compression needs zstandard; install it with pip install zstandard") from exc
    return zstandard


def shuffle(src: np.ndarray, itemsize: int, out: np.ndarray) -> np.ndarray:
    """Byte planes of ``src`` (uint8, a whole number of ``itemsize``-byte elements) into ``out``
    (uint8, same length): plane k, byte k of every element, lies at ``out[k * n:(k + 1) * n]``."""
    if itemsize == 1:
        np.copyto(out, src)
        return out
    planes = out.reshape(itemsize, -1)
    if itemsize in _UINT and sys.byteorder == "little":
        # Shifts over whole words: 2-4x faster than a strided byte copy (numpy's transpose).
        words = src.view(_UINT[itemsize])
        for k in range(itemsize):
            np.right_shift(words, 8 * k, out=planes[k], casting="unsafe")
    else:
        np.copyto(planes, src.reshape(-1, itemsize).T)
    return out


def unshuffle(planes, itemsize: int, out: np.ndarray) -> np.ndarray:
    """The inverse of ``shuffle``: elements rebuilt into ``out`` (uint8) from ``planes``, one
    array of all planes or a sequence of ``itemsize`` plane arrays (which may lie anywhere)."""
    rows = planes.reshape(itemsize, -1) if isinstance(planes, np.ndarray) else planes
    if itemsize == 1:
        np.copyto(out, rows[0])
        return out
    if itemsize in _UINT and sys.byteorder == "little":
        kind = _UINT[itemsize]
        words = out.view(kind)
        np.left_shift(rows[itemsize - 1], 8 * (itemsize - 1), out=words, dtype=kind)
        part = np.empty_like(words) if itemsize > 2 else None
        for k in range(itemsize - 1):
            if part is None:  # the low byte needs no shift: or it in
                np.bitwise_or(words, rows[k], out=words, casting="unsafe")
            else:
                np.left_shift(rows[k], 8 * k, out=part, dtype=kind)
                np.bitwise_or(words, part, out=words)
    else:
        for k in range(itemsize):
            out.reshape(-1, itemsize)[:, k] = rows[k]
    return out


class BlockCodec:
    """Encodes and decodes blocks of ``block_bytes`` bytes of ``itemsize``-byte elements.

    ``level``: zstd's (negative is faster, 1 is its fast default); ``threads``: blocks of a batch
    coded at once by ``encode_many`` / ``decode_many`` (zstd releases the GIL). Thread-safe.
    """

    def __init__(self, itemsize: int, block_bytes: int, level: int = 1, threads: int = 1,
                 shuffled: bool = True) -> None:
        if block_bytes % itemsize:
            raise ValueError(f"compress: {block_bytes} bytes is not a whole number of {itemsize}-byte elements")
        self.zstd = _zstd()
        self.itemsize = itemsize
        self.block_bytes = block_bytes
        self.level = level
        self.shuffled = shuffled and itemsize > 1
        self.flags = FLAG_ZSTD | (FLAG_SHUFFLE if self.shuffled else 0)
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tierkv-zstd") if threads > 1 else None

    def _ctx(self):
        local = self._local
        if getattr(local, "cctx", None) is None:
            local.cctx = self.zstd.ZstdCompressor(level=self.level, write_checksum=False)
            local.dctx = self.zstd.ZstdDecompressor()
            local.planes = np.empty(self.block_bytes, dtype=np.uint8)
        return local

    def encode(self, block, limit: int | None = None) -> bytes | None:
        """The stored bytes of ``block`` (a buffer of ``block_bytes``), or None where they would not
        be shorter than ``limit`` (default ``block_bytes``): such a block is stored raw."""
        ctx = self._ctx()
        src = np.frombuffer(block, dtype=np.uint8)
        if self.shuffled:
            rows = shuffle(src, self.itemsize, ctx.planes).reshape(self.itemsize, -1)
            parts = [self._plane(ctx.cctx, row) for row in rows]
            out = b"".join([b"".join(len(p).to_bytes(4, "little") for p in parts), *parts])
        else:
            out = ctx.cctx.compress(src)
        return out if len(out) < (self.block_bytes if limit is None else limit) else None

    @staticmethod
    def _plane(cctx, row: np.ndarray):
        """One plane's stored bytes: its zstd frame, or the plane itself where zstd saves nothing
        (tried on its first ``_PROBE`` bytes, then on all of it)."""
        if len(row) > 2 * _PROBE and len(cctx.compress(row[:_PROBE])) > _WORTH * _PROBE:
            return row
        frame = cctx.compress(row)
        return frame if len(frame) <= _WORTH * len(row) else row

    def decode_into(self, stored, flags: int, dst) -> bool:
        """Decode ``stored`` (written with ``flags``) into ``dst`` (a writable buffer of
        ``block_bytes``); False where it is not exactly one block. An unshuffled frame
        decompresses straight into ``dst``; byte planes into a per-thread plane buffer (raw
        planes are read where they lie). ``stored`` may lie at the start of ``dst`` itself (it is
        copied first)."""
        ctx = self._ctx()
        out = np.frombuffer(dst, dtype=np.uint8)
        if np.may_share_memory(np.frombuffer(stored, dtype=np.uint8), out):
            # Stored bytes at the start of their own destination (an L4 value): decoding writes
            # over them while raw planes and frames are still being read.
            stored = bytes(stored)
        try:
            if not flags & FLAG_SHUFFLE:
                return self._frame_into(ctx.dctx, stored, out)
            rows = self._planes_of(ctx, memoryview(stored).cast("B"))
        except self.zstd.ZstdError:
            return False
        if rows is None:
            return False
        unshuffle(rows, self.itemsize, out)
        return True

    def _planes_of(self, ctx, stored: memoryview) -> list[np.ndarray] | None:
        """The planes of a shuffled block: raw ones as views of ``stored``, coded ones decoded into
        the per-thread plane buffer. None where the lengths do not add up or a frame is bad."""
        size, head = self.block_bytes // self.itemsize, 4 * self.itemsize
        if len(stored) < head:
            return None
        lengths = [int.from_bytes(stored[4 * k:4 * k + 4], "little") for k in range(self.itemsize)]
        if head + sum(lengths) != len(stored) or any(n > size for n in lengths):
            return None
        rows, at, scratch = [], head, ctx.planes.reshape(self.itemsize, -1)
        for k, n in enumerate(lengths):
            part = stored[at:at + n]
            at += n
            if n == size:
                rows.append(np.frombuffer(part, dtype=np.uint8))
            elif self._frame_into(ctx.dctx, part, scratch[k]):
                rows.append(scratch[k])
            else:
                return None
        return rows

    def _frame_into(self, dctx, frame, out: np.ndarray) -> bool:
        """Decompress one zstd frame into ``out``; True when it filled ``out`` exactly."""
        reader = dctx.stream_reader(frame, read_size=len(frame))
        view, n = memoryview(out), 0
        while n < len(out):
            got = reader.readinto(view[n:])
            if not got:
                break
            n += got
        return n == len(out) and not reader.read(1)

    def encode_many(self, blocks: list, limit: int | None = None) -> list[bytes | None]:
        """``encode`` of each block, ``threads`` at a time."""
        if self._pool is None or len(blocks) < 2:
            return [self.encode(b, limit) for b in blocks]
        return list(self._pool.map(lambda b: self.encode(b, limit), blocks))

    def decode_many(self, items: list[tuple[object, int, object]]) -> list[bool]:
        """``decode_into`` of each (stored, flags, dst), ``threads`` at a time."""
        if self._pool is None or len(items) < 2:
            return [self.decode_into(*item) for item in items]
        return list(self._pool.map(lambda item: self.decode_into(*item), items))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


@dataclass(frozen=True)
class Choice:
    """What ``auto`` decided: compress or not, the predicted get-bandwidth gain, and why."""

    on: bool
    gain: float
    why: str


def effective_gbps(ratio: float, decode_gbps: float, link_gbps: float) -> float:
    """Get bandwidth in block bytes per second of compressed blocks: the stored bytes over the link,
    then decoded, one after the other. Conservative on purpose: L4 decodes each value while the
    next arrive, which wins more on a slow network, but on a fast or loopback link the same cores
    receive, check and decode, and assuming overlap there predicted gains that did not happen."""
    return 1.0 / (1.0 / (link_gbps * ratio) + 1.0 / decode_gbps)


def choose(ratio: float, decode_gbps: float, link_gbps: float) -> Choice:
    """Compress where the predicted get bandwidth beats the raw link's by ``WIN``. Pure."""
    if ratio <= 1.0 or decode_gbps <= 0 or link_gbps <= 0:
        return Choice(False, 1.0, f"off: ratio {ratio:.2f}x saves nothing")
    gain = effective_gbps(ratio, decode_gbps, link_gbps) / link_gbps
    verdict = "zstd" if gain >= WIN else "off"
    return Choice(gain >= WIN, gain, f"{verdict}: ratio {ratio:.2f}x, decode {decode_gbps:.2f} GB/s, raw "
                  f"{link_gbps:.2f} GB/s -> {gain:.2f}x the raw get (needs {WIN}x)")


class AutoChooser:
    """``auto`` for one tier: raw get speed seen on its reads, ratio and decode speed from sampled
    blocks, and ``choose`` over them. Until it has both it says off. Thread-safe."""

    MIN_RAW_BYTES = 8 << 20  # raw reads timed before deciding
    MIN_SAMPLES = 4          # blocks coded before deciding

    def __init__(self, codec: BlockCodec) -> None:
        self.codec = codec
        self._lock = threading.Lock()
        self._raw = [0, 0.0]         # bytes, seconds
        self._coded = [0, 0, 0.0, 0]  # block bytes, stored bytes, decode seconds, samples
        self._choice = Choice(False, 1.0, "off: measuring (no raw reads and samples yet)")

    def raw_read(self, nbytes: int, seconds: float) -> None:
        """A raw get of ``nbytes`` took ``seconds`` (the tier's IO, no decoding)."""
        with self._lock:
            self._raw[0] += nbytes
            self._raw[1] += seconds
            self._decide()

    def sample(self, block) -> None:
        """Code one block of real traffic: its ratio and decode time count."""
        stored = self.codec.encode(block, limit=self.codec.block_bytes * 4)
        scratch = bytearray(self.codec.block_bytes)
        t0 = time.perf_counter()
        ok = stored is not None and self.codec.decode_into(stored, self.codec.flags, scratch)
        seconds = time.perf_counter() - t0
        if not ok:
            return
        with self._lock:
            self._coded[0] += self.codec.block_bytes
            self._coded[1] += len(stored)
            self._coded[2] += seconds
            self._coded[3] += 1
            self._decide()

    def _decide(self) -> None:
        raw_bytes, raw_s = self._raw
        block, stored, decode_s, samples = self._coded
        if raw_bytes < self.MIN_RAW_BYTES or samples < self.MIN_SAMPLES or raw_s <= 0 or decode_s <= 0:
            return
        self._choice = choose(block / stored, block / decode_s / 1e9, raw_bytes / raw_s / 1e9)

    @property
    def choice(self) -> Choice:
        with self._lock:
            return self._choice

    def needs_samples(self) -> bool:
        with self._lock:
            return self._coded[3] < 64  # enough for a steady ratio; more only costs put time
