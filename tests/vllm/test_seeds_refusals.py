"""The connector's keys for LoRA adapters and cache salts, and what it refuses.

Keys: vLLM separates prefix caches by LoRA adapter and by ``cache_salt`` (a tenant's
secret); tierkv's chains must too, or one tenant would load another's KV. The adapter
and the salt enter the chain's seed (docs/design.md §3, §13) as ``lora:<name>`` and
``salt:<salt>``, so tierkv's own engine computes the same keys.

Refusals: tensor or pipeline parallelism (a block holds every layer and head), more
than one KV cache group, and requests whose KV is not a function of their token ids
(multimodal inputs, prompt embeddings), which are never looked up or saved.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import BLOCK, EOS, LAYERS, MODEL_DIR, blocks_hold, prompt
from vllm import SamplingParams
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_request_block_hasher
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.request import Request

from tierkv.connectors.vllm import TierKVConnector


def request(req_id: str, tokens: list[int], **kw) -> Request:
    sp = SamplingParams(max_tokens=2)
    sp.update_from_generation_config({}, EOS)
    return Request(req_id, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256), **kw)


def matched(e, req: Request) -> int:
    """What the connector offers vLLM for ``req`` with nothing computed yet; the pin is dropped again."""
    e.connector.on_new_request(req)
    tokens, _ = e.connector.get_num_new_matched_tokens(req, 0)
    e.connector.request_finished(req, [])
    return tokens


def stored_chain(e, tokens: list[int], extra: list[str]) -> list[bytes]:
    """Put ``tokens``' full blocks in the store under the chain seeded with ``extra``; their keys."""
    keys = e.store.hasher.hash_blocks(tokens, BLOCK, e.store.seed(None, extra))
    blocks = [torch.zeros(e.store.layout.block_shape, dtype=e.store.layout.torch_dtype) for _ in keys]
    assert all(e.store.put_blocks(keys, blocks))
    return keys


LORA_A, LORA_B = LoRARequest("adapter-a", 1, "/unused/a"), LoRARequest("adapter-b", 2, "/unused/b")


@pytest.mark.parametrize("extra,kw", [
    (["salt:tenant-1"], {"cache_salt": "tenant-1"}),
    (["lora:adapter-a"], {"lora_request": LORA_A}),
    (["lora:adapter-a", "salt:tenant-1"], {"lora_request": LORA_A, "cache_salt": "tenant-1"}),
], ids=["salt", "lora", "lora+salt"])
def test_only_the_same_adapter_and_salt_hit_a_chain(engine, extra, kw):
    e = engine()
    p = prompt(71, 3 * BLOCK + 5)
    stored_chain(e, p, extra)
    assert matched(e, request("same", p, **kw)) == 3 * BLOCK
    others = [{}, {"cache_salt": "tenant-2"}, {"lora_request": LORA_B},
              {**kw, "cache_salt": "tenant-2"}, {**kw, "lora_request": LORA_B}]
    for i, other in enumerate(o for o in others if o != kw):
        assert matched(e, request(f"other{i}", p, **other)) == 0, other
    assert e.store.lookup_keys(e.store.hash(p), pin=False).num_blocks == 0  # unsalted keys differ too


def test_a_salted_request_saves_under_its_salt_and_only_that_salt_loads_it(engine):
    """End to end through vLLM's scheduler: tenant 1 computes a prompt; after vLLM forgets its
    own cache, tenant 1 loads it from tierkv (right bytes), tenant 2 and no salt compute it."""
    e = engine(save_async=False)
    p = prompt(72, 100)
    first = request("t1", p, cache_salt="tenant-1")
    e.requests["t1"] = first
    e.scheduler.add_request(first)
    e.run()
    assert first.is_finished()
    salted = e.store.hasher.hash_blocks(p, BLOCK, e.store.seed(None, ["salt:tenant-1"]))[:3]
    assert e.store.lookup_keys(salted, pin=False).num_blocks == 3
    e.forget_local_cache()
    for req_id, salt, want in (("t2", "tenant-2", 0), ("plain", None, 0), ("t1-again", "tenant-1", 96)):
        req = request(req_id, p, cache_salt=salt)
        e.requests[req_id] = req
        e.scheduler.add_request(req)
        e.step()
        assert e.calls[-1] == ("matched", req_id, 0, (want, False)), e.calls[-1]
        if want:
            assert blocks_hold(e, req_id, p, 3) == [True, True, True]
        e.run()
        assert req.is_finished()


def test_multimodal_and_embedding_requests_are_never_looked_up_or_saved(engine):
    e = engine(save_async=False)
    p = prompt(73, 3 * BLOCK + 5)
    stored_chain(e, p, [])  # the token ids alone would hit 3 blocks
    assert matched(e, request("text", p)) == 3 * BLOCK
    image = MultiModalFeatureSpec(data=None, modality="image", identifier="img-0",
                                  mm_position=PlaceholderRange(offset=4, length=8), mm_hash="img-0")
    assert matched(e, request("mm", p, mm_features=[image])) == 0
    # Prompt embeddings (vLLM keeps the ids as placeholders): the KV is not the ids' KV either.
    assert matched(e, request("emb", p, prompt_embeds=torch.zeros(len(p), 64))) == 0
    fresh = prompt(74, 2 * BLOCK + 1)
    mm = request("mm-run", fresh, mm_features=[image])
    e.connector.on_new_request(mm)
    assert e.connector.get_num_new_matched_tokens(mm, 0) == (0, False)
    assert e.connector.request_finished(mm, []) == (False, None)  # nothing to save, nothing held
    assert e.store.lookup(fresh, pin=False).num_blocks == 0


def vllm_config(**parallel) -> tuple[VllmConfig, object]:
    """The harness's configuration (one cache group of full attention) with ``parallel`` set."""
    cfg = VllmConfig(
        model_config=ModelConfig(model=str(MODEL_DIR), dtype="float16", seed=42, skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=4096,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(kv_connector="TierKVConnector",
                                            kv_connector_module_path="tierkv.connectors.vllm",
                                            kv_role="kv_both", kv_connector_extra_config={"l3": {"capacity": 0}}),
        device_config=DeviceConfig("cpu"), attention_config=AttentionConfig(backend=None),
    )
    cfg.cache_config.kv_cache_layout = "LBHNC"  # as the harness: the CPU backend's layout
    cfg.cache_config.num_gpu_blocks_override = 16
    for name, value in parallel.items():
        setattr(cfg.parallel_config, name, value)
    return cfg, FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=32, dtype=torch.float16)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                      {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2", "tp4-pp2"])
@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER], ids=["scheduler", "worker"])
def test_tensor_or_pipeline_parallel_is_refused_naming_the_sizes(parallel, role):
    cfg, spec = vllm_config(**parallel)
    kv_cache_config = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(LAYERS, spec)], 1 << 30)
    tp = parallel.get("tensor_parallel_size", 1)
    pp = parallel.get("pipeline_parallel_size", 1)
    with pytest.raises(ValueError, match=rf"^parallel_config: .*tensor_parallel_size=1 and pipeline_parallel_size=1"
                                         rf".* got {tp} and {pp}$"):
        TierKVConnector(cfg, role, kv_cache_config)


def test_more_than_one_kv_cache_group_is_refused(tmp_path):
    cfg, spec = vllm_config()
    cfg.kv_transfer_config.kv_connector_extra_config = {"l3": {"path": str(tmp_path / "l3")}}
    # Two groups, as vLLM builds for hybrid models (one per attention kind or layer set).
    groups = [KVCacheGroupSpec(LAYERS[:1], spec), KVCacheGroupSpec(LAYERS[1:], dataclasses.replace(spec))]
    kv_cache_config = get_kv_cache_config_from_groups(cfg, groups, 1 << 30)
    with pytest.raises(ValueError, match=r"^kv_cache_config: tierkv supports one KV cache group .* got 2"):
        TierKVConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)
