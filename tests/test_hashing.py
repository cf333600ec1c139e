"""Chained 128-bit block hashes exactly as docs/design.md §3, recomputed by hand."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from tierkv.hashing import HASH_BYTES, BlockHasher

KEY = bytes(range(1, 33))


def hasher(algorithm: str) -> BlockHasher:
    return BlockHasher(algorithm, KEY if algorithm == "blake2b" else None)


def reference_digest(algorithm: str, data: bytes) -> bytes:
    """H of docs/design.md §3, written from the spec with the libraries themselves."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128(data).digest()
    if algorithm == "sha256":
        return hashlib.sha256(data).digest()[:16]
    return hashlib.blake2b(data, digest_size=16, key=KEY).digest()


def reference_seed(algorithm: str, *parts: str) -> bytes:
    # Each part is length-prefixed and parts are joined with 0x1f, so no two tuples collide.
    text = "\x1f".join(f"{len(p)}:{p}" for p in ("tierkv-v1", *parts))
    return reference_digest(algorithm, text.encode())


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256", "blake2b"])
def test_chain_follows_design_section_3(algorithm):
    h = hasher(algorithm)
    seed = h.seed("meta/llama-3", "rev7", "00ff00ff00ff00ff", "tenant-a")
    assert seed == reference_seed(algorithm, "meta/llama-3", "rev7", "00ff00ff00ff00ff", "tenant-a")
    tokens = [1, 2, 3, 70000, -5, 2**31 - 1, 0, 9, 42, 43]  # two full blocks of 4 and a partial one
    hashes = h.hash_blocks(tokens, 4, seed)
    t0 = b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[0:4])
    t1 = b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[4:8])
    h0 = reference_digest(algorithm, seed + t0)
    h1 = reference_digest(algorithm, h0 + t1)
    assert hashes == [h0, h1]
    assert all(isinstance(x, bytes) and len(x) == HASH_BYTES == 16 for x in hashes)


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256", "blake2b"])
def test_extra_keys_enter_the_first_block_and_so_every_block(algorithm):
    h = hasher(algorithm)
    tokens = list(range(12))
    plain = h.hash_blocks(tokens, 4, h.seed("m", "r", "f", "ns"))
    lora = h.hash_blocks(tokens, 4, h.seed("m", "r", "f", "ns", ("lora:abc",)))
    assert h.seed("m", "r", "f", "ns", ("lora:abc",)) == reference_seed(algorithm, "m", "r", "f", "ns", "lora:abc")
    assert all(a != b for a, b in zip(plain, lora))


def test_seed_binds_every_part_without_ambiguity():
    h = BlockHasher()
    seeds = {
        h.seed("m", "r", "f", "ns"), h.seed("m2", "r", "f", "ns"), h.seed("m", "r2", "f", "ns"),
        h.seed("m", "r", "f2", "ns"), h.seed("m", "r", "f", "ns2"), h.seed("m", "r", "f", ""),
        # Shifting a separator between parts must not give the same seed.
        h.seed("mr", "", "f", "ns"), h.seed("m", "rf", "", "ns"),
    }
    assert len(seeds) == 8


def test_only_full_blocks_and_the_chain_extends_from_a_parent():
    h = BlockHasher()
    seed = h.seed("m", "r", "f")
    tokens = np.arange(4 * 5 + 3, dtype=np.int64)
    full = h.hash_blocks(tokens, 4, seed)
    assert len(full) == 5
    assert h.hash_blocks(tokens[:3], 4, seed) == []
    assert h.hash_blocks(tokens, 4, seed, start=2, parent=full[1]) == full[2:]
    assert h.hash_blocks(list(tokens[:8]) + [999] * 4, 4, seed)[:2] == full[:2]
    assert h.hash_blocks(list(tokens[:8]) + [999] * 4, 4, seed)[2] != full[2]


def test_numpy_and_list_tokens_hash_alike():
    h = BlockHasher("sha256")
    seed = h.seed("m", "r", "f")
    assert h.hash_blocks(np.array([5, 6, 7, 8], dtype=np.int32), 4, seed) == h.hash_blocks([5, 6, 7, 8], 4, seed)


def test_hashes_are_identical_in_another_process():
    code = (
        "import json; from tierkv.hashing import BlockHasher; out = {}\n"
        "for a in ('xxh3_128', 'sha256', 'blake2b'):\n"
        f"    h = BlockHasher(a, {KEY!r} if a == 'blake2b' else None)\n"
        "    s = h.seed('m', 'r', 'fp', 'ns', ('salt',))\n"
        "    out[a] = [x.hex() for x in h.hash_blocks(list(range(64)), 16, s)]\n"
        "print(json.dumps(out))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "4242"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=True)
    there = json.loads(out.stdout)
    for algorithm in ("xxh3_128", "sha256", "blake2b"):
        h = hasher(algorithm)
        here = [x.hex() for x in h.hash_blocks(list(range(64)), 16, h.seed("m", "r", "fp", "ns", ("salt",)))]
        assert there[algorithm] == here and len(here) == 4


def test_algorithms_differ_and_blake2b_is_keyed():
    tokens = list(range(16))
    outs = {}
    for algorithm in ("xxh3_128", "sha256", "blake2b"):
        h = hasher(algorithm)
        outs[algorithm] = h.hash_blocks(tokens, 16, h.seed("m", "r", "f"))[0]
    assert len(set(outs.values())) == 3
    other = BlockHasher("blake2b", b"another key")
    assert other.hash_blocks(tokens, 16, other.seed("m", "r", "f"))[0] != outs["blake2b"]


@pytest.mark.parametrize("algorithm,key,field", [
    ("md5", None, "hashing.algorithm"), ("xxh3_64", None, "hashing.algorithm"),
    ("blake2b", None, "hashing.key"), ("blake2b", b"", "hashing.key"), ("blake2b", b"k" * 65, "hashing.key"),
])
def test_bad_hasher_settings_name_the_field(algorithm, key, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        BlockHasher(algorithm, key)


def test_extending_a_chain_without_its_parent_is_an_error():
    h = BlockHasher()
    seed = h.seed("m", "r", "f")
    with pytest.raises(ValueError, match=r"^hash_blocks: start=2 needs the hash of block 1"):
        h.hash_blocks(list(range(16)), 4, seed, start=2)


def test_token_ids_outside_int32_are_refused():
    h = BlockHasher()
    with pytest.raises(ValueError, match=r"^token_ids: "):
        h.hash_blocks([0, 1, 2, 2**31], 4, h.seed("m", "r", "f"))


def test_native_sha256_chain_equals_the_python_chain():
    """The C loop (OpenSSL's low-level SHA-256) must give the Python path's keys exactly."""
    import random

    from tierkv import sha256_chain

    assert sha256_chain.available(), "the native sha256 chain did not build (needs cc and libcrypto)"
    native = BlockHasher("sha256")
    python = BlockHasher("sha256")
    python._native_chain = None
    seed = native.seed("m", "r", "fp", "ns")
    rng = random.Random(7)
    for block_size in (1, 16, 64, 1000, 20000):
        tokens = [rng.randrange(-2**31, 2**31) for _ in range(block_size * 5 + 3)]
        want = python.hash_blocks(tokens, block_size, seed)
        assert native.hash_blocks(tokens, block_size, seed) == want
        assert native.hash_blocks(tokens, block_size, seed, start=2, parent=want[1]) == want[2:]
    assert native.hash_blocks([1, 2, 3], 16, seed) == []


_NATIVE_PROBE = """
import hashlib, json, torch
from tierkv import sha256_chain
from tierkv.hashing import BlockHasher
from tierkv.kernels import cpu_block_copy, gather_blocks
h = BlockHasher("sha256")
keys = h.hash_blocks(list(range(1000)), 16, h.seed("m", "r", "fp", "ns"))
raw = torch.arange(2 * 6 * 4 * 2 * 2 * 8, dtype=torch.int16).view(torch.float16).view(2, 6, 4, 2, 2, 8)
kv = raw.permute(0, 1, 4, 2, 3, 5)  # [L, nb, 2, B, Hkv, D] through strides, as vLLM's caches
blocks = torch.empty(3, 2, 2, 4, 2, 8, dtype=torch.float16)
gather_blocks(kv, torch.tensor([5, 0, 3]), blocks)
print(json.dumps({"keys": [k.hex() for k in keys], "blocks": hashlib.sha256(blocks.view(torch.int16).numpy().tobytes()).hexdigest(),
                  "native": [sha256_chain.available(), cpu_block_copy.library() is not None]}))
"""


def test_native_code_can_be_turned_off_and_gives_the_same_keys_and_bytes(tmp_path):
    """TIERKV_NATIVE=0: nothing is built, sha256 chains and CPU block gathers run in Python /
    torch, and they give exactly the keys and bytes the native loops give."""
    out = {}
    for flag in ("0", "1"):
        cache = tmp_path / f"cache{flag}"
        env = {**os.environ, "TIERKV_NATIVE": flag, "TIERKV_CACHE_DIR": str(cache)}
        proc = subprocess.run([sys.executable, "-c", _NATIVE_PROBE], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[flag] = json.loads(proc.stdout.strip().splitlines()[-1])
        built = sorted(p.name.split("-")[0] for p in (cache / "native").glob("*.so"))
        assert built == ([] if flag == "0" else ["block_copy", "sha256_chain"]), built
    assert out["0"]["native"] == [False, False] and out["1"]["native"] == [True, True]
    assert out["0"]["keys"] == out["1"]["keys"] and len(out["0"]["keys"]) == 62
    assert out["0"]["blocks"] == out["1"]["blocks"]
    # and the keys are sha256's chain, as written in docs/design.md §3
    assert out["0"]["keys"] == [k.hex() for k in BlockHasher("sha256").hash_blocks(
        list(range(1000)), 16, BlockHasher("sha256").seed("m", "r", "fp", "ns"))]
