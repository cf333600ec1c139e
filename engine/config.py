"""EngineConfig: the engine's own knobs (the store has its StoreConfig). Frozen and validated."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


def _int(value, name: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"engine.{name}: expected an integer >= {lo}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How big the L1 pool is and how much work one engine step may do.

    ``num_blocks`` L1 slots of ``block_size`` tokens each form the KV pool (the
    store's L1 tier). One step runs at most ``max_num_seqs`` sequences and
    ``max_num_batched_tokens`` tokens; a prompt longer than what is left of that
    budget is prefilled in chunks when ``chunked_prefill`` is on, otherwise it
    waits for a step with room for all of it (a prompt longer than the whole
    budget then runs alone). ``max_model_len`` 0 means the model's
    ``max_position_embeddings``. ``num_threads`` 0 leaves torch's setting alone.
    ``load_wait_s`` bounds one wait for a load when nothing else can run (the
    engine then polls again). ``hf_overrides`` replaces top-level keys of the
    checkpoint's ``config.json`` (e.g. ``{"rope_theta": 1e6}``), as vLLM's
    option of that name does; it enters the model identity.
    """

    num_blocks: int = 1024
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunked_prefill: bool = True
    max_model_len: int = 0
    dtype: str = "float32"
    device: str = "auto"
    num_threads: int = 0
    load_wait_s: float = 30.0
    hf_overrides: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        _int(self.num_blocks, "num_blocks", 1)
        _int(self.block_size, "block_size", 1)
        _int(self.max_num_seqs, "max_num_seqs", 1)
        _int(self.max_num_batched_tokens, "max_num_batched_tokens", 1)
        _int(self.max_model_len, "max_model_len", 0)
        _int(self.num_threads, "num_threads", 0)
        if not isinstance(self.chunked_prefill, bool):
            raise ValueError(f"engine.chunked_prefill: expected true or false, got {self.chunked_prefill!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"engine.dtype: expected one of {list(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.device, str) or self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"engine.device: expected one of {list(DEVICES)} (or 'cuda:N'), got {self.device!r}")
        if self.hf_overrides is not None and (not isinstance(self.hf_overrides, Mapping)
                                              or not all(isinstance(k, str) for k in self.hf_overrides)):
            raise ValueError(f"engine.hf_overrides: expected a table of config.json keys, got {self.hf_overrides!r}")
        if isinstance(self.load_wait_s, bool) or not isinstance(self.load_wait_s, (int, float)) or self.load_wait_s <= 0:
            raise ValueError(f"engine.load_wait_s: expected a number of seconds > 0, got {self.load_wait_s!r}")
