"""A test engine around vLLM 0.32.0's real v1 ``Scheduler`` with tierkv's connector.

The scheduler, its requests and block hashes are vLLM's own. The KV cache is
allocated by vLLM's ``allocate_kv_cache`` in the CPU backend's layout
(LBHNC, per layer ``[num_blocks, Hkv, B, 2*D]``). What stands in for the
model runner is small and follows ``KVConnectorModelRunnerMixin``'s order:
handle_preemptions, bind metadata, start_load_kv (before the forward when a
load is synchronous, after it otherwise), the forward writing K/V for the
scheduled tokens and calling save_kv_layer per layer, wait_for_save, then
transfer results, load errors and worker metadata into ``KVConnectorOutput``.

The "model" writes K/V that are a pure function of (token id, position,
layer, K|V, head, dim), so a test can check any vLLM block holds exactly what
a real forward would have written there, whether computed or loaded.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_kv_cache_config_from_groups,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from tierkv.connectors.vllm import TierKVConnector  # noqa: E402

MODEL_DIR = Path(__file__).parent / "tiny-llama"
BLOCK = 32
HEADS = 4
HEAD_DIM = 32
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
EOS = 2


def prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids drawn from ``seed``: distinct seeds give distinct blocks."""
    return random.Random(seed).choices(range(3, 1000), k=n)


def kv_values(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[T, L, 2, Hkv, D] fp16 K/V for tokens at positions: small exact integers."""
    t = tokens.view(-1, 1, 1, 1, 1) * 31 + positions.view(-1, 1, 1, 1, 1) * 7
    layer = torch.arange(len(LAYERS)).view(1, -1, 1, 1, 1) * 13
    kv = torch.arange(2).view(1, 1, 2, 1, 1) * 5
    head = torch.arange(HEADS).view(1, 1, 1, -1, 1) * 3
    dim = torch.arange(HEAD_DIM).view(1, 1, 1, 1, -1)
    return ((t + layer + kv + head + dim) % 1021).to(torch.float16)


@dataclass
class Step:
    output: object
    connector_output: KVConnectorOutput


@dataclass
class Engine:
    scheduler: Scheduler
    worker: TierKVConnector
    caches: dict[str, torch.Tensor]
    calls: list[tuple] = field(default_factory=list)
    events: list = field(default_factory=list)
    requests: dict[str, Request] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)

    @property
    def connector(self) -> TierKVConnector:
        return self.scheduler.connector

    @property
    def store(self):
        return self.worker.store

    # -- requests -------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 3) -> Request:
        sp = SamplingParams(max_tokens=max_tokens)
        sp.update_from_generation_config({}, EOS)
        req = Request(req_id, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                      mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.requests[req_id] = req
        self.scheduler.add_request(req)
        return req

    # -- one engine step ------------------------------------------------------

    def step(self) -> Step:
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        if so.has_sync_kv_loads:
            w.start_load_kv(None)
        sampled = self._forward(so)
        if not so.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        results = w.get_transfer_results(so.finished_req_ids)
        out = KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            failed_recving=results.failed_recving, invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        ids = list(sampled)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[sampled[r] for r in ids], kv_connector_output=out)
        self.scheduler.update_from_output(so, mro)
        step = Step(so, out)
        self.steps.append(step)
        return step

    def _forward(self, so) -> dict[str, list[int]]:
        before = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        sampled = {}
        for name in LAYERS:  # as vLLM's attention layers do before they read or write the cache
            self.worker.wait_for_layer_load(name)
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            start = before[req_id]
            positions = torch.arange(start, start + n)
            tokens = torch.tensor(req.all_token_ids[start : start + n])
            block_ids = torch.tensor(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])
            self.write_kv(block_ids[positions // BLOCK], positions % BLOCK, kv_values(tokens, positions))
            done = start + n >= req.num_tokens
            sampled[req_id] = [100 + (start + n) % 800] if done else []
        for name in LAYERS:
            self.worker.save_kv_layer(name, self.caches[name], None)
        return sampled

    def layer_kv(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V caches [num_blocks, Hkv, B, D] of one layer, split as vLLM's CPU backend does."""
        cache = self.caches[name]
        num_blocks, hkv, block, _ = cache.shape
        return cache.view(num_blocks, hkv, 2 * block, -1).chunk(2, dim=2)

    def write_kv(self, blocks: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> None:
        for layer, name in enumerate(LAYERS):
            key_cache, value_cache = self.layer_kv(name)
            key_cache[blocks, :, offsets] = values[:, layer, 0]
            value_cache[blocks, :, offsets] = values[:, layer, 1]

    # -- driving and checking -------------------------------------------------

    def run(self, max_steps: int = 1000) -> None:
        """Step until every request finished and vLLM freed its blocks (async saves included)."""
        for _ in range(max_steps):
            if not self.scheduler.requests:
                return
            step = self.step()
            if not step.output.total_num_scheduled_tokens:
                time.sleep(0.01)
        raise AssertionError(f"requests still open after {max_steps} steps: {list(self.scheduler.requests)}")

    def step_until(self, cond, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if cond():
                return
            step = self.step()
            if not step.output.total_num_scheduled_tokens:
                time.sleep(0.01)
        raise AssertionError("condition not reached")

    def block_matches(self, block_id: int, tokens: list[int], first_position: int) -> bool:
        """Whether vLLM block ``block_id`` holds the K/V of ``tokens`` (a full block) at their positions."""
        positions = torch.arange(first_position, first_position + BLOCK)
        want = kv_values(torch.tensor(tokens), positions)
        for layer, name in enumerate(LAYERS):
            key_cache, value_cache = self.layer_kv(name)
            if not torch.equal(key_cache[block_id].transpose(0, 1), want[:, layer, 0]):
                return False
            if not torch.equal(value_cache[block_id].transpose(0, 1), want[:, layer, 1]):
                return False
        return True

    def forget_local_cache(self) -> None:
        """Drop vLLM's own prefix cache and wipe the KV tensors: any later hit must come from tierkv."""
        assert self.scheduler.reset_prefix_cache()
        for cache in self.caches.values():
            cache.zero_()

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()


def blocks_hold(e: Engine, req_id: str, tokens: list[int], n_blocks: int) -> list[bool]:
    """Per leading block of ``req_id``: vLLM's block holds what the model writes for ``tokens`` there."""
    ids = e.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
    return [e.block_matches(ids[i], tokens[i * BLOCK:(i + 1) * BLOCK], i * BLOCK) for i in range(n_blocks)]


def no_pins(e: Engine) -> bool:
    """No block of the store is pinned any more (every load's match was released), once the
    write-through copies queued so far have landed (each pins its block until then)."""
    e.store.flush()
    return all(entry.ref_count == 0 for entry in e.store.index.entries())


def make_engine(extra: dict, num_blocks: int = 64, max_batched: int = 512) -> Engine:
    """A real Scheduler with TierKVConnector on both sides and vLLM-allocated CPU caches.

    ``tiny-llama`` has a config and no weights (the harness writes K/V itself), so its identity
    cannot be named by content: the harness declares ``model_id`` (as a user vouching for a name
    does), unless ``extra`` sets one."""
    init_none_hash(sha256)
    extra = {"model_id": "tiny-llama-harness", **extra}
    cfg = VllmConfig(
        model_config=ModelConfig(model=str(MODEL_DIR), dtype="float16", seed=42, skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_batched, max_model_len=4096,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(kv_connector="TierKVConnector",
                                            kv_connector_module_path="tierkv.connectors.vllm",
                                            kv_role="kv_both", kv_connector_extra_config=extra),
        device_config=DeviceConfig("cpu"), attention_config=AttentionConfig(backend=None),
    )
    cfg.cache_config.kv_cache_layout = "LBHNC"  # the only layout vLLM's CPU attention backend reads
    cfg.cache_config.num_gpu_blocks_override = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16)
    kv_cache_config = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(LAYERS, spec)], 1 << 40)
    cfg.cache_config.num_gpu_blocks = num_blocks
    # The worker's connector first, as vLLM builds them (the worker's KV cache set-up precedes the
    # Scheduler): in one process the scheduler then shares the worker's full store.
    worker = TierKVConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)
    scheduler = Scheduler(vllm_config=cfg, kv_cache_config=kv_cache_config, log_stats=True,
                          structured_output_manager=StructuredOutputManager(cfg), block_size=BLOCK)
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
    worker.register_kv_caches(caches)
    engine = Engine(scheduler, worker, caches)
    _spy(engine)
    return engine


def _spy(engine: Engine) -> None:
    """Record the scheduler's connector calls and the KV events it takes."""
    conn = engine.connector
    matched, take = conn.get_num_new_matched_tokens, conn.take_events

    def get_num_new_matched_tokens(request, num_computed_tokens):
        result = matched(request, num_computed_tokens)
        engine.calls.append(("matched", request.request_id, num_computed_tokens, result))
        return result

    def take_events():
        events = list(take())
        engine.events.extend(events)
        return events

    conn.get_num_new_matched_tokens = get_num_new_matched_tokens
    conn.take_events = take_events
