"""The connector's keys for LoRA adapters and cache salts, and what it refuses.

Keys: vLLM separates prefix caches by LoRA adapter and by ``cache_salt`` (a tenant's
secret); tierkv's chains must too, or one tenant would load another's KV. The adapter
(by name and by the content of its files) and the salt enter the chain's seed
(docs/design.md §3, §13); an adapter with no local files is never cached.

Refusals: pipeline parallelism, tensor parallelism that does not shard the KV heads evenly
(``shards.py``), more
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


def adapter(root, name: str, lora_id: int, weights: bytes) -> LoRARequest:
    """A LoRA adapter directory as PEFT writes one (config + weights file) and its request."""
    path = root / f"{name}-{lora_id}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return LoRARequest(name, lora_id, str(path))


@pytest.mark.parametrize("case", ["salt", "lora", "lora+salt"])
def test_only_the_same_adapter_and_salt_hit_a_chain(engine, tmp_path, case):
    e = engine()
    lora_a = adapter(tmp_path, "adapter-a", 1, b"a" * 64)
    lora_b = adapter(tmp_path, "adapter-b", 2, b"b" * 64)
    same_name = adapter(tmp_path, "adapter-a", 3, b"c" * 64)  # another adapter under the same name
    kw = {"salt": {"cache_salt": "tenant-1"}, "lora": {"lora_request": lora_a},
          "lora+salt": {"lora_request": lora_a, "cache_salt": "tenant-1"}}[case]
    extra = []
    if "lora_request" in kw:
        extra.append(e.connector._scheduler._lora_key(lora_a))
    if "cache_salt" in kw:
        extra.append("salt:tenant-1")
    p = prompt(71, 3 * BLOCK + 5)
    stored_chain(e, p, extra)
    assert matched(e, request("same", p, **kw)) == 3 * BLOCK
    others = [{}, {"cache_salt": "tenant-2"}, {"lora_request": lora_b}, {"lora_request": same_name},
              {**kw, "cache_salt": "tenant-2"}, {**kw, "lora_request": lora_b}, {**kw, "lora_request": same_name}]
    for i, other in enumerate(o for o in others if o != kw):
        assert matched(e, request(f"other{i}", p, **other)) == 0, other
    assert e.store.lookup_keys(e.store.hash(p), pin=False).num_blocks == 0  # unsalted keys differ too


def test_an_adapter_without_local_files_is_never_cached(engine):
    e = engine()
    p = prompt(75, 3 * BLOCK + 5)
    ghost = LoRARequest("remote-adapter", 9, "/nonexistent/adapter")
    assert e.connector._scheduler._lora_key(ghost) is None
    stored_chain(e, p, ["lora:remote-adapter"])  # what a name-only key would have found
    assert matched(e, request("ghost", p, lora_request=ghost)) == 0


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


@pytest.mark.parametrize("parallel", [{"pipeline_parallel_size": 2},
                                      {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}],
                         ids=["pp2", "tp2-pp2"])
@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER], ids=["scheduler", "worker"])
def test_pipeline_parallel_is_refused_naming_the_field(parallel, role):
    cfg, spec = vllm_config(**parallel)
    kv_cache_config = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(LAYERS, spec)], 1 << 30)
    with pytest.raises(ValueError, match=r"^parallel_config.pipeline_parallel_size: tierkv's connector supports 1, "
                                         r"got 2 "):
        TierKVConnector(cfg, role, kv_cache_config)


@pytest.mark.parametrize(("tp", "heads", "message"), [
    (6, 1, r"^parallel_config.tensor_parallel_size: 4 KV heads over 6 ranks split unevenly"),
    (3, 1, r"^parallel_config.tensor_parallel_size: 4 KV heads over 3 ranks split unevenly"),
    (2, 4, r"^kv_cache_spec.num_kv_heads: 4 per rank, expected 4 / 2 = 2$"),
    (8, 2, r"^kv_cache_spec.num_kv_heads: 2 per rank, expected 1 \(4 KV heads replicated over 8 ranks\)$"),
], ids=["uneven-6", "uneven-3", "spec-not-sharded", "spec-not-replicated"])
def test_tensor_parallel_that_does_not_shard_kv_heads_evenly_is_refused(tp, heads, message):
    """tiny-llama has 4 KV heads: TP must divide them, or be a multiple of them (replicas)."""
    cfg, spec = vllm_config(tensor_parallel_size=tp)
    spec = dataclasses.replace(spec, num_kv_heads=heads)
    kv_cache_config = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(LAYERS, spec)], 1 << 30)
    with pytest.raises(ValueError, match=message):
        TierKVConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config)


@pytest.mark.parametrize("name", ["prefill_context_parallel_size", "decode_context_parallel_size"])
def test_context_parallel_is_refused_naming_the_field(name):
    cfg, spec = vllm_config()
    kv_cache_config = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(LAYERS, spec)], 1 << 30)
    setattr(cfg.parallel_config, name, 2)
    with pytest.raises(ValueError, match=rf"^parallel_config.{name}: .*supports 1 .* got 2$"):
        TierKVConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)


def test_a_model_without_local_weights_gets_no_persistent_tier_unless_model_id_is_declared(tmp_path, caplog):
    """tiny-llama has a config and no weights: its identity cannot be named by content, so L3 (and
    L4, a shared L2) are off with a warning saying what to set; a declared model_id turns them on."""
    cfg, spec = vllm_config()
    cfg.kv_transfer_config.kv_connector_extra_config = {"l3": {"path": str(tmp_path / "l3")}}
    kv_cache_config = get_kv_cache_config_from_groups(cfg, [KVCacheGroupSpec(LAYERS, spec)], 1 << 30)
    with caplog.at_level("WARNING", logger="tierkv.connectors.vllm"):
        c = TierKVConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)
    try:
        assert not c.identity.known and c.store.l3 is None
        assert "cannot be named by content" in caplog.text and "model_id" in caplog.text
    finally:
        c.shutdown()
    cfg.kv_transfer_config.kv_connector_extra_config = {"l3": {"path": str(tmp_path / "l3")}, "model_id": "tiny"}
    c = TierKVConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)
    try:
        assert c.identity.known and c.store.l3 is not None
        assert c.identity.identity.get("weights") == "declared:tiny@"
    finally:
        c.shutdown()


def test_more_than_one_kv_cache_group_is_refused(tmp_path):
    cfg, spec = vllm_config()
    cfg.kv_transfer_config.kv_connector_extra_config = {"l3": {"path": str(tmp_path / "l3")}}
    # Two groups, as vLLM builds for hybrid models (one per attention kind or layer set).
    groups = [KVCacheGroupSpec(LAYERS[:1], spec), KVCacheGroupSpec(LAYERS[1:], dataclasses.replace(spec))]
    kv_cache_config = get_kv_cache_config_from_groups(cfg, groups, 1 << 30)
    with pytest.raises(ValueError, match=r"^kv_cache_config: tierkv supports one KV cache group .* got 2"):
        TierKVConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)
