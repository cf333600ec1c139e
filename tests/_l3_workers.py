"""Worker processes for tests/test_l3_processes.py that drive a DiskTier directly (no store)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from _kv import key_of
from tierkv.layout import KVLayout

# 32 KiB blocks of fp16: a KV-like block codes to well under a page less than its slot.
CODED_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")


def coded_block(key: bytes) -> torch.Tensor:
    """KV-like values seeded by the key, on a coarse grid: every block compresses."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    return (torch.round(torch.randn(CODED_LAYOUT.block_shape, generator=g) * 4) / 16).to(torch.float16)


def coded_keys(worker: int, n: int) -> list[bytes]:
    return [key_of("coded", worker, i) for i in range(n)]


def coded_writer(path: str, worker: int, capacity: int, rounds: int, out_file: str, start, done) -> None:
    """Put batches of compressible blocks (``l3.compress = zstd``) into the L3 directory ``path`` beside
    another worker, removing random blocks (anyone's) when full, and read back blocks of both.

    Both start together (``start``); each sets ``done[worker - 1]`` once it has put ``rounds``
    batches and read a block the other one wrote, and keeps going until both are done (a 300 s
    safety stop only keeps a broken tier from hanging the test). Writes its counts to ``out_file``.
    """
    from tierkv.tiers.disk import DiskTier

    failures: list = []
    tier = DiskTier(path, CODED_LAYOUT, capacity, compress="zstd", compress_threads=2,
                    on_failure=lambda *a: failures.append(a[:3]))
    rng = random.Random(worker)
    mine, theirs = coded_keys(worker, 10_000), set(coded_keys(3 - worker, 10_000))
    counts = {"puts": 0, "stored": 0, "read": 0, "wrong": 0, "foreign": 0}
    buf = torch.empty(CODED_LAYOUT.block_shape, dtype=CODED_LAYOUT.torch_dtype)
    start.wait(120)
    safety, i = time.monotonic() + 300, 0
    while not all(event.is_set() for event in done) and time.monotonic() < safety:
        batch = mine[i:i + rng.randint(1, 4)]
        i += len(batch)
        listed = [r.key for r in tier.records()]
        for key in rng.sample(listed, max(0, len(listed) + len(batch) - capacity)):
            tier.remove([key])
        counts["stored"] += sum(tier.put(batch, [coded_block(k) for k in batch]))
        counts["puts"] += 1
        for key in rng.sample([r.key for r in tier.records()], 3) if tier.used >= 3 else []:
            if tier.get([key], [buf]) == [True]:  # another writer may remove it meanwhile: a miss
                counts["read"] += 1
                counts["wrong"] += not torch.equal(buf.view(torch.uint8), coded_block(key).view(torch.uint8))
                counts["foreign"] += key in theirs
        if counts["puts"] >= rounds and counts["foreign"] > 0:
            done[worker - 1].set()
    counts["failures"] = failures
    tier.close()
    Path(out_file).write_text(json.dumps(counts))
