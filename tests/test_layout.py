"""KVLayout: the canonical block shape, its size, fingerprint and validation (docs/design.md §2)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
import xxhash

from tierkv.layout import KVLayout


def test_block_shape_bytes_and_pool_shape():
    lay = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    assert lay.block_shape == (4, 2, 16, 2, 64)
    assert lay.block_numel == 4 * 2 * 16 * 2 * 64
    assert lay.itemsize == 2
    assert lay.block_bytes == 4 * 2 * 16 * 2 * 64 * 2
    assert lay.pool_shape(7) == (7, 4, 2, 16, 2, 64)
    assert lay.torch_dtype is torch.bfloat16
    block = torch.empty(lay.block_shape, dtype=lay.torch_dtype)
    assert block.numel() * block.element_size() == lay.block_bytes


@pytest.mark.parametrize("dtype,itemsize", [("float16", 2), ("bfloat16", 2), ("float32", 4), ("float8_e4m3fn", 1)])
def test_itemsize_per_dtype(dtype, itemsize):
    lay = KVLayout(1, 1, 8, 4, dtype)
    assert lay.itemsize == itemsize
    assert lay.block_bytes == 1 * 2 * 4 * 1 * 8 * itemsize


def test_fingerprint_is_the_documented_xxh3_64_of_every_field():
    lay = KVLayout(32, 8, 128, 16, "float16")
    expected = xxhash.xxh3_64_hexdigest(b"tierkv-layout-v1|32|8|128|16|float16")
    assert lay.fingerprint == expected
    assert len(lay.fingerprint) == 16
    assert KVLayout(32, 8, 128, 16, "float16").fingerprint == expected


@pytest.mark.parametrize("change", [
    {"num_layers": 31}, {"num_kv_heads": 4}, {"head_dim": 64}, {"block_size": 32}, {"dtype": "bfloat16"},
])
def test_fingerprint_changes_with_every_field(change):
    base = KVLayout(32, 8, 128, 16, "float16")
    assert dataclasses.replace(base, **change).fingerprint != base.fingerprint


def test_fingerprint_is_stable_across_processes():
    lay = KVLayout(32, 8, 128, 16, "float16")
    code = "from tierkv.layout import KVLayout; print(KVLayout(32, 8, 128, 16, 'float16').fingerprint)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}, check=True)
    assert out.stdout.strip() == lay.fingerprint


@pytest.mark.parametrize("name", ["num_layers", "num_kv_heads", "head_dim", "block_size"])
@pytest.mark.parametrize("bad", [0, -1, 1.0, "8", True, None, 10**6])
def test_invalid_dimension_names_the_field(name, bad):
    kwargs = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4}
    kwargs[name] = bad
    with pytest.raises(ValueError, match=rf"^layout\.{name}: expected an integer"):
        KVLayout(**kwargs)


@pytest.mark.parametrize("bad", ["fp16", "float64", "", None, torch.float16])
def test_invalid_dtype_names_the_field_and_allowed_values(bad):
    with pytest.raises(ValueError, match=r"^layout\.dtype: expected one of .*'float16'"):
        KVLayout(2, 2, 8, 4, bad)


def test_layout_is_frozen_and_hashable():
    lay = KVLayout(2, 2, 8, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.num_layers = 3
    assert {lay: 1}[KVLayout(2, 2, 8, 4)] == 1
    assert lay.to_dict() == {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float16"}
    assert KVLayout(**lay.to_dict()) == lay


def test_a_shard_names_its_kv_heads_and_keeps_the_logical_layout():
    """Tensor parallelism: rank r's layout holds heads [r*H/T, (r+1)*H/T) of H (docs/design.md §13)."""
    full = KVLayout(32, 8, 128, 16, "float16")
    s0, s1 = full.shard(0, 4), full.shard(4, 4)
    assert s0.block_shape == (32, 2, 16, 4, 128) and s0.is_shard and not full.is_shard
    assert s0.logical == s1.logical == full and full.logical is full
    assert len({s0.fingerprint, s1.fingerprint, full.fingerprint, KVLayout(32, 4, 128, 16).fingerprint}) == 4
    assert s1.fingerprint == xxhash.xxh3_64_hexdigest(b"tierkv-layout-v1|32|4|128|16|float16|heads4:8/8")
    assert KVLayout(**s1.to_dict()) == s1 and "kv_heads_total" not in full.to_dict()
    assert full.shard(0, 8) == full  # every head: the unsharded layout, one fingerprint


@pytest.mark.parametrize(("fields", "message"), [
    ({"kv_heads_total": 8, "kv_head_start": 6}, r"^layout\.kv_head_start: heads 6\.\.10 do not fit in kv_heads_total=8$"),
    ({"kv_head_start": 2}, r"^layout\.kv_head_start: 2 needs kv_heads_total"),
    ({"kv_heads_total": -1}, r"^layout\.kv_heads_total: expected an integer >= 0, got -1$"),
    ({"kv_heads_total": 8, "kv_head_start": True}, r"^layout\.kv_head_start: expected an integer >= 0"),
])
def test_an_invalid_shard_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        KVLayout(32, 4, 128, 16, "float16", **fields)
    with pytest.raises(ValueError, match=r"^layout\.shard: already a shard"):
        KVLayout(32, 8, 128).shard(0, 4).shard(0, 2)
