"""One request's state: tokens, KV block table, store match, and its public Output."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from tierkv.engine.sampler import SamplingParams
from tierkv.hashing import BlockHash
from tierkv.store import Match
from tierkv.transfer import LoadHandle

_ids = itertools.count()


class SeqState(enum.Enum):
    WAITING = "waiting"      # queued; holds no blocks
    LOADING = "loading"      # admitted; lower-tier blocks are being copied into its L1 slots
    RUNNING = "running"      # prefilling (maybe in chunks) or decoding
    FINISHED = "finished"


@dataclass
class Output:
    """What a request produced so far (``stream``) or in the end (``generate``)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    ttft_s: float | None
    hit_tokens: dict[str, int] = field(default_factory=dict)


class Sequence:
    """A request inside the engine. Owned by the scheduler; not thread-safe.

    ``block_table[i]`` is the L1 slot holding tokens ``i*B .. i*B+B-1``;
    ``private[i]`` says whether the sequence owns that slot (it frees it at the
    end) or the store's index does (the block is cached and ``match`` pins it).
    ``num_computed`` tokens have their K/V in those slots; the first
    ``num_saved`` blocks are registered with the store.
    """

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, namespace: str | None,
                 max_model_len: int, extra_keys: tuple[str, ...] = ()) -> None:
        self.request_id = next(_ids)
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.namespace = namespace
        self.extra_keys = extra_keys  # seed parts beyond the namespace (``salt:<cache_salt>``)
        self.max_model_len = max_model_len
        self.state = SeqState.WAITING
        self.finish_reason: str | None = None
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.hit_tokens: dict[str, int] = {}
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.keys: list[BlockHash] = []
        self.reset_blocks()

    def reset_blocks(self) -> None:
        """Forget every block (after they were released): the sequence will be recomputed."""
        self.block_table: list[int] = []
        self.private: list[bool] = []
        self.num_computed = 0
        self.num_saved = 0
        self.match: Match | None = None
        self.load: LoadHandle | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.state is SeqState.FINISHED

    def append(self, token: int, eos: tuple[int, ...]) -> None:
        """Add a sampled token and decide whether the request is done."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.token_ids.append(token)
        p = self.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos):
            self.finish_reason = "stop"
        elif len(self.token_ids) - len(self.prompt_token_ids) >= p.max_tokens:
            self.finish_reason = "length"
        elif len(self.token_ids) >= self.max_model_len:
            self.finish_reason = "length"

    def output(self, text: str) -> Output:
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        return Output(self.request_id, list(self.prompt_token_ids), self.output_ids, text,
                      self.finish_reason, ttft, dict(self.hit_tokens))
