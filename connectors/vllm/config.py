"""The connector's settings: store keys as in the TOML config, plus a ``vllm`` table.

Layered as everywhere in tierkv, lowest first: defaults, vLLM's model name as
``model_id``, the TOML file named by ``config_file``, the rest of
``kv_connector_extra_config``, then ``TIERKV_*`` env (``TIERKV_VLLM_<FIELD>``
for the ``vllm`` table)::

    {"config_file": "/etc/tierkv.toml", "l2": {"capacity": "8GiB"},
     "vllm": {"load_async": "auto", "save_async": true}}

The connector has no L1: vLLM owns device memory, so ``l1.num_blocks`` is forced to 0.
Its default write policy is ``write_through`` (tierkv's own default is ``write_back``):
see ``shared_store.py`` for why the scheduler needs blocks in a tier it can read.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from tierkv.config import L1Config, StoreConfig, env_overrides, merge_settings
from tierkv.connectors.vllm.cpus import parse_cpus

LOAD_ASYNC = ("auto", "always", "never")
KV_SPLITS = ("auto", "planes", "tokens")
LOAD_BY_LAYER = ("auto", "never")
_ENV_PREFIX = "TIERKV_VLLM_"


@dataclass(frozen=True)
class VllmSettings:
    """How the connector drives loads and saves.

    ``load_async``: ``auto`` loads L3/L4 hits while other requests run and L2
    hits inside the step, ``always`` / ``never`` force one mode. ``save``: write
    full blocks to the store. ``save_async``: gather and write them on a
    background thread. ``kv_split``: how K and V share a page (``auto``:
    ``planes`` on CPU as vLLM's CPU backend does, ``tokens`` on CUDA).
    ``landing_blocks``: page-aligned CPU slots that loads land in, registered
    with the L4 client (``landing.py``); a load that finds no free run gets a
    fresh tensor; 0 turns them off. ``load_by_layer``: ``auto`` writes a
    synchronous load into a CPU cache layer by layer on a feed thread while the
    forward runs (``layer_feed.py``); ``never`` writes it whole before the
    forward. ``io_cpus``: the CPUs of the connector's threads (``cpus.py``:
    ``auto`` = those vLLM's thread binding leaves free, ``inherit``, or a list).
    """

    load_async: str = "auto"
    save: bool = True
    save_async: bool = True
    kv_split: str = "auto"
    landing_blocks: int = 256
    load_by_layer: str = "auto"
    io_cpus: str = "auto"

    def __post_init__(self) -> None:
        if self.load_async not in LOAD_ASYNC:
            raise ValueError(f"vllm.load_async: expected one of {list(LOAD_ASYNC)}, got {self.load_async!r}")
        if self.load_by_layer not in LOAD_BY_LAYER:
            raise ValueError(f"vllm.load_by_layer: expected one of {list(LOAD_BY_LAYER)}, got {self.load_by_layer!r}")
        if not isinstance(self.io_cpus, str):
            raise ValueError(f"vllm.io_cpus: expected 'auto', 'inherit' or a CPU list such as '2,3', got {self.io_cpus!r}")
        parse_cpus(self.io_cpus)
        if self.kv_split not in KV_SPLITS:
            raise ValueError(f"vllm.kv_split: expected one of {list(KV_SPLITS)}, got {self.kv_split!r}")
        for name in ("save", "save_async"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"vllm.{name}: expected true or false, got {getattr(self, name)!r}")
        if isinstance(self.landing_blocks, bool) or not isinstance(self.landing_blocks, int) or self.landing_blocks < 0:
            raise ValueError(f"vllm.landing_blocks: expected an integer >= 0, got {self.landing_blocks!r}")


@dataclass(frozen=True)
class ConnectorConfig:
    """``model_id_declared``: the user set ``model_id`` (extra config, TOML or ``TIERKV_MODEL_ID``)
    rather than it defaulting to vLLM's model name; only a declared one may stand in for weights
    whose files cannot be found (``identity.vllm_identity``)."""

    store: StoreConfig
    vllm: VllmSettings
    model_id_declared: bool = False


def load_config(extra: Mapping[str, Any] | None, model_id: str, model_revision: str | None,
                env: Mapping[str, str] | None = None) -> ConnectorConfig:
    """Build the connector config from ``kv_connector_extra_config`` and env. Errors name the field."""
    env = os.environ if env is None else env
    # Write-through by default: what the worker saves goes on to L3 (and L4) as it is saved, so the
    # scheduler, in whatever process, finds it in the durable index, and a restart finds it too.
    data: dict[str, Any] = {"model_id": model_id, "policy": {"write": "write_through"}}
    if model_revision:
        data["model_revision"] = model_revision
    extra = dict(extra or {})
    path = extra.pop("config_file", None)
    layers = [_read_toml(path)] if path is not None else []
    layers += [extra, env_overrides({k: v for k, v in env.items() if not k.startswith(_ENV_PREFIX)})]
    for layer in layers:
        merge_settings(data, layer)
    declared = any("model_id" in layer for layer in layers)
    vllm = data.pop("vllm", {})
    if not isinstance(vllm, Mapping):
        raise ValueError(f"vllm: expected a table of settings, got {vllm!r}")
    vllm = dict(vllm)
    allowed = {f.name: f.default for f in fields(VllmSettings)}
    for name, raw in env.items():
        if name.startswith(_ENV_PREFIX):
            key = name[len(_ENV_PREFIX):].lower()
            if key not in allowed:
                raise ValueError(f"{name}: unknown setting vllm.{key}; expected one of {sorted(allowed)}")
            default = allowed[key]
            vllm[key] = (_coerce_bool(raw) if isinstance(default, bool)
                         else _coerce_int(raw) if isinstance(default, int) else raw)
    for key in vllm:
        if key not in allowed:
            raise ValueError(f"vllm.{key}: unknown setting; expected one of {sorted(allowed)}")
    store = StoreConfig.from_dict(data)
    store = replace(store, l1=L1Config(num_blocks=0, device=store.l1.device))
    return ConnectorConfig(store, VllmSettings(**vllm), declared)


def _read_toml(path: Any) -> dict[str, Any]:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"config_file: expected a path to a TOML file, got {path!r}")
    try:
        with open(Path(path).expanduser(), "rb") as fh:
            return tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"config_file: cannot read {path}: {exc}") from None


def _coerce_bool(raw: str) -> bool | str:
    return {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}.get(raw.strip().lower(), raw)


def _coerce_int(raw: str) -> int | str:
    try:
        return int(raw.strip())
    except ValueError:
        return raw  # VllmSettings names the field and what it allows
