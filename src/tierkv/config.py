"""Typed, frozen configuration, loaded in one place: defaults < TOML file < TIERKV_* env.

Every field is validated at construction and errors name the field and what is
allowed, e.g. ``l2.capacity: expected a size like '8GiB' or a byte count >= 0, got 'lots'``.
Env overrides use ``TIERKV_<SECTION>_<FIELD>`` (``TIERKV_L2_CAPACITY=8GiB``) or
``TIERKV_<FIELD>`` for top-level fields (``TIERKV_MODEL_ID=...``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")

# The names config accepts. This module is a leaf (it imports nothing from tierkv),
# so the registries that implement these names (tierkv.policy.POLICIES,
# tierkv.hashing.ALGORITHMS) are checked against them by tests/test_imports.py.
POLICY_NAMES = ("cost_aware", "hit_density", "lfu", "lru")
HASH_ALGORITHMS = ("xxh3_128", "sha256", "blake2b")


def parse_size(value: Any, name: str) -> int:
    """Bytes from an int or a string like ``"8GiB"``, ``"512 MiB"``, ``"1.5GB"``."""
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a size like '8GiB' or a byte count >= 0, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}: expected a size like '8GiB' or a byte count >= 0, got {value!r}")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m and m.group(2).lower() in _UNITS:
            size = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if size < 2**63:  # also rejects the inf that hundreds of digits parse to
                return int(size)
    raise ValueError(
        f"{name}: expected a size like '8GiB' or a byte count >= 0 (units {', '.join(k for k in _UNITS if k)}), got {value!r}"
    )


def _check_int(value: Any, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}: expected an integer {bound}, got {value!r}")
    return value


def _check_float(value: Any, name: str, lo: float, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name}: expected a number {'>' if strict else '>='} {lo}, got {value!r}")
    if isinstance(value, int) and abs(value) >= 2**1023:  # float() of it would raise OverflowError
        raise ValueError(f"{name}: expected a number {'>' if strict else '>='} {lo}, got an integer of {value.bit_length()} bits")
    if value < lo or (strict and value == lo):
        raise ValueError(f"{name}: expected a number {'>' if strict else '>='} {lo}, got {value!r}")
    return float(value)


def _check_choice(value: Any, name: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {list(allowed)}, got {value!r}")
    return value


def _check_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name}: expected a string, got {value!r}")
    return value


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected true or false, got {value!r}")
    return value


COMPRESS_MODES = ("off", "zstd", "auto")


def _check_compress(section: Any, name: str) -> None:
    """The compress fields of ``l3`` / ``l4``: mode, zstd level (negative: faster), threads."""
    _check_choice(section.compress, f"{name}.compress", COMPRESS_MODES)
    _check_int(section.compress_level, f"{name}.compress_level", -7, 22)
    _check_int(section.compress_threads, f"{name}.compress_threads", 1, 64)


@dataclass(frozen=True)
class L1Config:
    """L1: the device block pool. ``num_blocks`` 0 means no L1 tier (e.g. under vLLM)."""

    num_blocks: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        _check_int(self.num_blocks, "l1.num_blocks", 0)
        if not (isinstance(self.device, str) and re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device)):
            raise ValueError(f"l1.device: expected one of ['auto', 'cpu', 'cuda', 'cuda:<index>'], got {self.device!r}")


@dataclass(frozen=True)
class L2Config:
    """L2: host DRAM slab. ``shared_name`` puts it in /dev/shm so processes on a node share it."""

    capacity: int | str = "1GiB"
    shared_name: str = ""
    pin: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity", parse_size(self.capacity, "l2.capacity"))
        if not re.fullmatch(r"[A-Za-z0-9_.-]{0,64}", _check_str(self.shared_name, "l2.shared_name")):
            raise ValueError(f"l2.shared_name: expected up to 64 of [A-Za-z0-9_.-], got {self.shared_name!r}")
        _check_bool(self.pin, "l2.pin")


@dataclass(frozen=True)
class L3Config:
    """L3: local disk, one preallocated slot file plus an LMDB index under ``path``.

    ``read_depth``: reads in flight per load (about 4 MiB each, on the process's reader threads).
    ``compress``: ``off`` (raw blocks), ``zstd`` (byte planes + zstandard, each block that
    shrinks) or ``auto`` (zstd only while the measured get bandwidth wins by >= 1.2x);
    ``compress_level`` is zstd's level, ``compress_threads`` the blocks of a batch coded at once.
    """

    path: str = "~/.cache/tierkv/l3"
    capacity: int | str = "8GiB"
    direct_io: bool = True
    read_depth: int = 4
    compress: str = "off"
    compress_level: int = 1
    compress_threads: int = 1

    def __post_init__(self) -> None:
        if not _check_str(self.path, "l3.path"):
            raise ValueError("l3.path: expected a directory path, got ''")
        object.__setattr__(self, "capacity", parse_size(self.capacity, "l3.capacity"))
        _check_bool(self.direct_io, "l3.direct_io")
        _check_int(self.read_depth, "l3.read_depth", 1, 64)
        _check_compress(self, "l3")


@dataclass(frozen=True)
class L4Config:
    """L4: a remote pool chosen by URL scheme; empty URL means no L4.

    ``compress`` / ``compress_level`` / ``compress_threads``: as ``l3``'s (``zstd`` and ``auto``
    need a Redis-protocol pool: Mooncake values have one fixed size).
    """

    url: str = ""
    auth_key: str = ""
    timeout_ms: int = 200
    key_prefix: str = "tierkv"
    breaker_failures: int = 3
    breaker_reset_s: float = 5.0
    compress: str = "off"
    compress_level: int = 1
    compress_threads: int = 1

    SCHEMES = ("mooncake", "redis", "rediss", "valkey", "redis+cluster")

    def __post_init__(self) -> None:
        url = _check_str(self.url, "l4.url")
        if url and ("://" not in url or url.split("://")[0] not in self.SCHEMES):
            raise ValueError(f"l4.url: expected a URL with scheme one of {list(self.SCHEMES)}, got {url!r}")
        _check_str(self.auth_key, "l4.auth_key")
        _check_int(self.timeout_ms, "l4.timeout_ms", 1, 60_000)
        _check_str(self.key_prefix, "l4.key_prefix")
        _check_int(self.breaker_failures, "l4.breaker_failures", 1)
        _check_float(self.breaker_reset_s, "l4.breaker_reset_s", 0.0, strict=True)
        _check_compress(self, "l4")
        if self.compress != "off" and url.startswith("mooncake://"):
            raise ValueError(f"l4.compress: expected 'off' with a mooncake:// pool (its values have one "
                             f"fixed size), got {self.compress!r}")


@dataclass(frozen=True)
class PolicyConfig:
    """Eviction policy by name, the write policy, and reuse decay (half-life in lookups).

    ``reuse_exponent``: cost_aware's power-law decay of the reuse hazard with a
    block's age (see docs/replay.md; ``tools/replay.py --reuse-exponent`` tries others).
    ``metadata_share``: the most of a tier's bytes the policy's per-block state may take
    (hit_density's ghosts; 0..1, default 1 %): ``hit_density.ghosts_for`` turns it into ghosts
    per block for the store's block size.
    """

    name: str = "hit_density"
    write: str = "write_back"
    half_life: float = 2000.0
    reuse_exponent: float = 0.75
    metadata_share: float = 0.01

    WRITES = ("write_back", "write_through", "write_through_selective")

    def __post_init__(self) -> None:
        _check_choice(self.name, "policy.name", POLICY_NAMES)
        _check_choice(self.write, "policy.write", self.WRITES)
        _check_float(self.half_life, "policy.half_life", 0.0, strict=True)
        _check_float(self.reuse_exponent, "policy.reuse_exponent", 0.0, strict=True)
        if _check_float(self.metadata_share, "policy.metadata_share", 0.0) > 1.0:
            raise ValueError(f"policy.metadata_share: expected a share of the tier's bytes in 0..1, "
                             f"got {self.metadata_share!r}")


@dataclass(frozen=True)
class HashingConfig:
    """Block hash algorithm; ``key`` (hex) is required for keyed blake2b."""

    algorithm: str = "xxh3_128"
    key: str = ""

    def __post_init__(self) -> None:
        _check_choice(self.algorithm, "hashing.algorithm", HASH_ALGORITHMS)
        try:
            raw = bytes.fromhex(_check_str(self.key, "hashing.key"))
        except ValueError:
            raise ValueError(f"hashing.key: expected hex digits (blake2b: 1..64 bytes), got {self.key!r}") from None
        if self.algorithm == "blake2b" and not 1 <= len(raw) <= 64:
            raise ValueError(f"hashing.key: blake2b needs 1..64 bytes of hex key, got {self.key!r}")


@dataclass(frozen=True)
class CostConfig:
    """Cost model figures in µs per token; 0 means 'calibrate or use the built-in estimate'.

    ``recompute_growth`` is the relative extra recompute cost per token of
    context (attention); negative means 'calibrate or use the built-in
    estimate'. ``calibrate`` measures tier bandwidths when the store starts.
    """

    recompute_us_per_token: float = 0.0
    l1_us_per_token: float = 0.0
    l2_us_per_token: float = 0.0
    l3_us_per_token: float = 0.0
    l4_us_per_token: float = 0.0
    recompute_growth: float = -1.0
    calibrate: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name.endswith("_per_token"):
                _check_float(getattr(self, f.name), f"cost.{f.name}", 0.0)
        growth = self.recompute_growth
        if isinstance(growth, bool) or not isinstance(growth, (int, float)) or not -float("inf") < growth < float("inf"):
            raise ValueError(f"cost.recompute_growth: expected a finite number (< 0 for the estimate), got {growth!r}")
        _check_bool(self.calibrate, "cost.calibrate")


@dataclass(frozen=True)
class IOConfig:
    """Background IO against foreground work (``tierkv.pacing``).

    ``background_share``: while foreground work runs (the engine's forward, a
    caller's put, a load), background IO (demotions written behind,
    write-through, persist, L4 sends) is spaced to fill at most this share of
    wall time; with no foreground work it runs flat out. 1.0 turns pacing off.

    ``shutdown_flush_s``: how long ``close`` (and a process exiting without
    it, or a vLLM worker told to stop) may spend landing the writes queued so
    far and writing the blocks that live only in L1/L2 down to L3; what is left
    at the deadline is dropped and counted in one log line (a cache may lose
    blocks, L3 stays consistent). 0 writes nothing more and drops the queue.
    """

    background_share: float = 0.15
    shutdown_flush_s: float = 10.0

    def __post_init__(self) -> None:
        _check_float(self.shutdown_flush_s, "io.shutdown_flush_s", 0.0)
        share = _check_float(self.background_share, "io.background_share", 0.0, strict=True)
        if share > 1.0:
            raise ValueError(f"io.background_share: expected a number in (0, 1], got {self.background_share!r}")


@dataclass(frozen=True)
class StoreConfig:
    """Everything a TierKVStore needs besides its layout."""

    model_id: str = "unknown-model"
    model_revision: str = "main"
    namespace: str = ""
    l1: L1Config = field(default_factory=L1Config)
    l2: L2Config = field(default_factory=L2Config)
    l3: L3Config = field(default_factory=L3Config)
    l4: L4Config = field(default_factory=L4Config)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    hashing: HashingConfig = field(default_factory=HashingConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    io: IOConfig = field(default_factory=IOConfig)
    l3_enabled: bool = True

    def __post_init__(self) -> None:
        _check_str(self.model_id, "model_id")
        _check_str(self.model_revision, "model_revision")
        _check_str(self.namespace, "namespace")
        _check_bool(self.l3_enabled, "l3_enabled")
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"{name}: expected a {cls.__name__}, got {getattr(self, name)!r}")

    # -- loading -------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StoreConfig:
        """Build from nested dicts (TOML tables, vLLM extra config). Unknown keys are errors."""
        sections = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in sections:
                raise ValueError(f"{key}: unknown setting; expected one of {sorted(sections)}")
            sub = _SECTIONS.get(key)
            if sub is None:
                kwargs[key] = value
                continue
            if not isinstance(value, Mapping):
                raise ValueError(f"{key}: expected a table of settings, got {value!r}")
            allowed = {f.name for f in fields(sub)}
            for name in value:
                if name not in allowed:
                    raise ValueError(f"{key}.{name}: unknown setting; expected one of {sorted(allowed)}")
            kwargs[key] = sub(**value)
        return cls(**kwargs)

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
             overrides: Mapping[str, Any] | None = None) -> StoreConfig:
        """Defaults, then the TOML file at ``path``, then ``TIERKV_*`` env, then ``overrides``."""
        data: dict[str, Any] = {}
        if path is not None:
            with open(Path(path).expanduser(), "rb") as fh:
                try:
                    data = tomllib.load(fh)
                except tomllib.TOMLDecodeError as exc:
                    raise ValueError(f"{path}: not valid TOML: {exc}") from None
        merge_settings(data, env_overrides(os.environ if env is None else env))
        if overrides:
            merge_settings(data, dict(overrides))
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS: dict[str, type] = {
    "l1": L1Config, "l2": L2Config, "l3": L3Config, "l4": L4Config,
    "policy": PolicyConfig, "hashing": HashingConfig, "cost": CostConfig, "io": IOConfig,
}


def merge_settings(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    """Merge nested settings ``extra`` into ``base`` in place (later sources win)."""
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            merge_settings(base[key], value)
        else:
            base[key] = dict(value) if isinstance(value, Mapping) else value


def _coerce(raw: str, current: Any) -> Any:
    if isinstance(current, bool):
        low = raw.strip().lower()
        return {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}.get(low, raw)
    if isinstance(current, int):
        try:
            return int(raw)
        except ValueError:
            return raw
    if isinstance(current, float):
        try:
            return float(raw)
        except ValueError:
            return raw
    return raw


# TIERKV_* variables other parts read (the CLI, the kernels, the native copy loop, the model
# cache, the test suite's strict mode and its shared/ path); TIERKV_VLLM_* belong to the vLLM
# connector's config.
_NOT_STORE_VARS = ("TIERKV_CACHE_DIR", "TIERKV_LOG_LEVEL", "TIERKV_CONFIG", "TIERKV_KERNELS", "TIERKV_NATIVE",
                   "TIERKV_MODELS_DIR", "TIERKV_REQUIRE_SERVERS", "TIERKV_SHARED", "TIERKV_DIGEST_CACHE")


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """``TIERKV_*`` variables as a nested dict; unknown names fail naming the variable."""
    out: dict[str, Any] = {}
    top = {f.name: f for f in fields(StoreConfig) if f.name not in _SECTIONS}
    for name, raw in env.items():
        if not name.startswith("TIERKV_") or name in _NOT_STORE_VARS or name.startswith("TIERKV_VLLM_"):
            continue
        rest = name[len("TIERKV_"):].lower()
        section, _, field_name = rest.partition("_")
        if rest in top:  # before sections: TIERKV_L3_ENABLED is the top-level l3_enabled
            out[rest] = _coerce(raw, top[rest].default)
        elif section in _SECTIONS and field_name:
            sub = _SECTIONS[section]
            default = {f.name: f.default for f in fields(sub)}
            if field_name not in default:
                raise ValueError(f"{name}: unknown setting {section}.{field_name}; expected one of {sorted(default)}")
            out.setdefault(section, {})[field_name] = _coerce(raw, default[field_name])
        else:
            raise ValueError(f"{name}: unknown setting; expected TIERKV_<section>_<field> with section in {sorted(_SECTIONS)}")
    return out
