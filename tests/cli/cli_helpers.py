"""Helpers for the `tierkv` command tests: run the real command in a subprocess, fill an L3 directly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tierkv import KVLayout, StoreConfig, TierKVStore
from tierkv.catalog import Catalog

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4)
PROMPTS = {"a": [list(range(40)), list(range(20)) + [7] * 12], "b": [list(range(100, 116))]}


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


def run_tierkv(*args: str, env: dict | None = None, timeout: float = 120) -> Result:
    full_env = {**os.environ, "TIERKV_L3_CAPACITY": "4MiB", "COLUMNS": "160", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "tierkv.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def store_config(cache: Path, model_id: str = "m") -> StoreConfig:
    return StoreConfig.from_dict({"model_id": model_id, "l2": {"capacity": 0},
                                  "l3": {"path": str(cache / "l3"), "capacity": "4MiB"}})


def populate(cache: Path, layout: KVLayout = LAYOUT, model_id: str = "m") -> dict[str, list[list[bytes]]]:
    """Write the chains of PROMPTS straight into L3 (block i of a chain filled with i); returns their keys.

    Chain b has hits recorded: 2 on its first block, 1 on its second.
    """
    store = TierKVStore(store_config(cache, model_id), layout, l1_blocks=0)
    catalog = Catalog(cache / "l3")
    out: dict[str, list[list[bytes]]] = {}
    try:
        for ns, prompts in PROMPTS.items():
            for p in prompts:
                keys = store.hash(p, ns)
                blocks = [torch.full(layout.block_shape, float(i), dtype=layout.torch_dtype) for i in range(len(keys))]
                assert all(store.put_blocks(keys, blocks))
                catalog.label([keys[0]], ns)
                if ns == "b":
                    catalog.count_hits(keys[:2])
                    catalog.count_hits(keys[:1])
                out.setdefault(ns, []).append(keys)
    finally:
        catalog.close()
        store.close()
    return out


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


_MODELS: dict[str, Path] = {}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The seeded `tiny` checkpoint, written once per session through the real checkpoint writer.

    (No conftest.py here on purpose: other test directories import their own
    ``conftest`` by name, and a second module of that name would shadow theirs.)
    """
    if "tiny" not in _MODELS:
        out = tmp_path_factory.mktemp("models") / "tiny"
        subprocess.run([sys.executable, "-m", "tierkv.engine.checkpoint", str(out), "--preset", "tiny"],
                       check=True, capture_output=True, timeout=120)
        _MODELS["tiny"] = out
    return _MODELS["tiny"]
