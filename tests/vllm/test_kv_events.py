"""KV events under vLLM 0.32.0's real Scheduler: BlockStored when a save lands,
BlockRemoved when a block this connector announced leaves every local tier.

The stores are tiny (L2 and L3 hold 4 blocks of 32 KiB each, LRU), so each new
100-token prompt (3 full blocks) pushes the oldest blocks out of L3 with no L4
below: exactly those must be reported, and nothing the store still holds.
"""

from __future__ import annotations

import pytest
import torch
from harness import Engine, prompt
from vllm.v1.outputs import KVConnectorOutput

# 4 blocks each; write-back (not the connector's write-through default): blocks reach L3 only
# as L2 demotes them, which fixes the exact order of evictions the first test checks.
TINY = {"l2": "128KiB", "l3": "128KiB", "policy": "lru", "write": "write_back"}


def kv_events(e: Engine, names: dict[bytes, str]) -> list[tuple[str, list[str]]]:
    return [(type(ev).__name__, [names[h] for h in ev.block_hashes]) for ev in e.events]


def save_prompts(e: Engine, names: dict[bytes, str], seeds: dict[str, int]) -> None:
    """Compute one 100-token prompt per name, one after another; name its 3 blocks ``A0 A1 A2``."""
    for name, seed in seeds.items():
        p = prompt(seed, 100)
        for j, key in enumerate(e.store.hash(p)[:3]):
            names[key] = f"{name}{j}"
        req = e.add(f"{name}-{len(e.requests)}", p)
        e.run()
        assert req.is_finished()


def held(e: Engine, names: dict[bytes, str]) -> set[str]:
    return {name for key, name in names.items() if key in e.store.index}


@pytest.mark.parametrize("save_async", [False, True])
def test_blocks_evicted_out_of_every_tier_are_reported_removed(engine, save_async):
    e = engine(**TINY, save_async=save_async)
    names: dict[bytes, str] = {}
    save_prompts(e, names, {"A": 100, "B": 101})
    assert kv_events(e, names) == [("BlockStored", ["A0", "A1", "A2"]), ("BlockStored", ["B0", "B1", "B2"])]
    save_prompts(e, names, {"C": 102, "D": 103, "A": 100})  # A again: recomputed, stored again
    events = kv_events(e, names)
    if not save_async:  # a background save may report a removal before the store that caused it
        assert events[2:] == [
            ("BlockStored", ["C0", "C1", "C2"]), ("BlockRemoved", ["A2"]),
            ("BlockStored", ["D0", "D1", "D2"]), ("BlockRemoved", ["A1", "A0", "B2"]),
            ("BlockStored", ["A0", "A1", "A2"]), ("BlockRemoved", ["B1", "B0", "C2"]),
        ]
    removed = [n for kind, blocks in events if kind == "BlockRemoved" for n in blocks]
    assert sorted(removed) == ["A0", "A1", "A2", "B0", "B1", "B2", "C2"]
    assert held(e, names) == {"A0", "A1", "A2", "C0", "C1", "D0", "D1", "D2"}
    for name in removed:  # each removal follows a store of that block, and A is stored again after
        first_removed = next(i for i, (kind, b) in enumerate(events) if kind == "BlockRemoved" and name in b)
        assert any(kind == "BlockStored" and name in b for kind, b in events[:first_removed])
    last_a = max(i for i, (kind, b) in enumerate(events) if kind == "BlockStored" and "A0" in b)
    assert not any(kind == "BlockRemoved" and "A0" in b for kind, b in events[last_a:])
    assert all(ev.medium == "CPU" for ev in e.events)


def test_blocks_the_connector_never_announced_are_not_reported_removed(engine):
    e = engine(**TINY, save_async=False)
    names: dict[bytes, str] = {}
    foreign = e.store.hash(prompt(200, 100))[:3]  # stored by someone else: no BlockStored from us
    names.update({key: f"X{j}" for j, key in enumerate(foreign)})
    blocks = [torch.zeros(e.store.layout.block_shape, dtype=e.store.layout.torch_dtype) for _ in foreign]
    assert e.store.put_blocks(foreign, blocks) == [True] * 3
    save_prompts(e, names, {"A": 100, "B": 101})
    assert held(e, names) == {"X0", "X1", "A0", "A1", "A2", "B0", "B1", "B2"}  # X2 left every tier
    save_prompts(e, names, {"C": 102})
    assert held(e, names) == {"A0", "A1", "B0", "B1", "B2", "C0", "C1", "C2"}  # so did X1, X0, A2
    assert kv_events(e, names) == [
        ("BlockStored", ["A0", "A1", "A2"]), ("BlockStored", ["B0", "B1", "B2"]),
        ("BlockStored", ["C0", "C1", "C2"]), ("BlockRemoved", ["A2"]),
    ]


def test_a_block_evicted_while_its_own_save_runs_is_removed_after_it_is_stored(engine, monkeypatch):
    # L2 and L3 hold one block each: storing X2 pushes X1 down to L3, which pushes X0 out.
    # A worker report taken while put_blocks is still returning (as vLLM's step may take
    # one while a background save runs) must not carry X0's removal ahead of X0's store.
    e = engine(l2="32KiB", l3="32KiB", policy="lru", write="write_back", save_async=False)
    put_blocks = e.store.put_blocks

    def put_then_report(*args, **kwargs):
        flags = put_blocks(*args, **kwargs)
        mid = e.worker.build_connector_worker_meta()
        if mid is not None:
            e.connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=mid))
        return flags

    monkeypatch.setattr(e.store, "put_blocks", put_then_report)
    names: dict[bytes, str] = {}
    save_prompts(e, names, {"X": 300})
    assert held(e, names) == {"X1", "X2"}
    assert kv_events(e, names) == [("BlockStored", ["X0", "X1", "X2"]), ("BlockRemoved", ["X0"])]
