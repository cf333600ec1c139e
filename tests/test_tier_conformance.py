"""Every tier through the same cases: L1, L2 private and shared, L3, L4 on Redis and on Mooncake.

The store routes by tier and never branches on which one it holds, so each
must keep the one ``BlockTier`` contract: batched put/get/contains/remove,
per-key False (never an exception) for a missing block, the first bytes kept
for a key put twice, ``view`` either None or the block in place, usage and
capacity reported by the tier itself.
"""

from __future__ import annotations

import pytest
import torch
from _kv import LAYOUT, block_for, key_of, same_bytes
from _servers import mooncake_pool, redis_server  # noqa: F401

from tierkv.config import L4Config
from tierkv.tiers.base import BlockTier, Lineage
from tierkv.tiers.device import DeviceTier
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.host import HostTier
from tierkv.tiers.remote import open_remote

CAPACITY = 8
KINDS = ["l1", "l2", "l2_shared", "l3", "l4_redis", "l4_mooncake"]


@pytest.fixture(params=KINDS)
def tier(request, tmp_path, shm_name):
    kind = request.param
    if kind == "l1":
        t = DeviceTier(LAYOUT, CAPACITY, "cpu")
    elif kind == "l2":
        t = HostTier(LAYOUT, CAPACITY, pin=False)
    elif kind == "l2_shared":
        t = HostTier(LAYOUT, CAPACITY, shared_name=shm_name, pin=False)
    elif kind == "l3":
        t = DiskTier(tmp_path / "l3", LAYOUT, CAPACITY)
    else:
        server = request.getfixturevalue("redis_server" if kind == "l4_redis" else "mooncake_pool")
        t = open_remote(L4Config(url=server.url, timeout_ms=5000, key_prefix=f"conf-{tmp_path.name}"), LAYOUT)
    t.kind = kind
    yield t
    t.close()


def blocks(keys):
    return [block_for(k, LAYOUT) for k in keys]


def empty(n):
    return [torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype) for _ in range(n)]


def lineage(n):
    return [Lineage(None, i) for i in range(n)]


def test_is_a_block_tier_reporting_its_usage(tier):
    assert isinstance(tier, BlockTier) and tier.name == tier.kind[:2]
    assert tier.capacity >= CAPACITY
    keys = [key_of(tier.kind, "usage", i) for i in range(3)]
    assert tier.put(keys, blocks(keys), lineage(3)) == [True] * 3
    assert tier.used == (-1 if tier.name == "l4" else 3)
    tier.remove(keys[:1])
    assert tier.used == (-1 if tier.name == "l4" else 2)


def test_put_then_get_returns_the_same_bytes(tier):
    keys = [key_of(tier.kind, "rt", i) for i in range(4)]
    assert tier.contains(keys) == [False] * 4
    assert tier.put(keys, blocks(keys), lineage(4)) == [True] * 4
    assert tier.contains(keys) == [True] * 4
    dst = empty(4)
    assert tier.get(keys, dst) == [True] * 4
    assert all(same_bytes(d, b) for d, b in zip(dst, blocks(keys)))


def test_a_missing_key_is_a_false_not_an_error(tier):
    here, gone = key_of(tier.kind, "here"), key_of(tier.kind, "gone")
    assert tier.put([here], blocks([here]), lineage(1)) == [True]
    dst = empty(2)
    assert tier.get([gone, here], dst) == [False, True]
    assert same_bytes(dst[1], block_for(here, LAYOUT))
    assert tier.contains([gone]) == [False] and tier.view(gone) is None
    tier.remove([gone])  # unknown keys are ignored


def test_a_key_put_twice_keeps_its_bytes(tier):
    key, other = key_of(tier.kind, "twice"), key_of(tier.kind, "other")
    assert tier.put([key], blocks([key]), lineage(1)) == [True]
    assert tier.put([key], blocks([other]), lineage(1)) == [True]
    dst = empty(1)
    assert tier.get([key], dst) == [True]
    if tier.name != "l4":  # a pool overwrites a name (same key, same bytes in real use)
        assert same_bytes(dst[0], block_for(key, LAYOUT))


def test_remove_forgets_the_block(tier):
    keys = [key_of(tier.kind, "rm", i) for i in range(3)]
    assert tier.put(keys, blocks(keys), lineage(3)) == [True] * 3
    tier.remove(keys[1:2])
    assert tier.contains(keys) == [True, False, True]
    assert tier.get(keys[1:2], empty(1)) == [False]


def test_view_is_none_or_the_block_in_place(tier):
    key = key_of(tier.kind, "view")
    assert tier.put([key], blocks([key]), lineage(1)) == [True]
    view = tier.view(key)
    if tier.kind in ("l1", "l2"):
        assert view is not None and same_bytes(view, block_for(key, LAYOUT))
    else:  # on disk, remote, or in a slab another process may reuse
        assert view is None


@pytest.mark.parametrize("tier", [k for k in KINDS if not k.startswith("l4")], indirect=True)
def test_a_full_local_tier_refuses_the_excess(tier):
    """(Not L4: a remote pool evicts on its own and has no capacity to run out of.)"""
    keys = [key_of(tier.kind, "full", i) for i in range(tier.capacity + 2)]
    ok = tier.put(keys, blocks(keys), lineage(len(keys)))
    assert ok == [True] * tier.capacity + [False, False]
    assert tier.used == tier.capacity
