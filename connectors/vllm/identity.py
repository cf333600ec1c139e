"""The model identity of a vLLM engine, and the table that says which of vLLM's fields enter it.

Every vLLM config field that can change the KV of a token sequence enters the
identity (``tierkv.identity.ModelIdentity``) that roots every block key; the
rest are classified with the reason they do not. ``FIELDS`` covers
``ModelConfig``, ``CacheConfig`` and ``ParallelConfig`` field by field, and
``tests/vllm/test_identity_table.py`` fails when the installed vLLM has a field
the table does not classify (an upgrade cannot silently widen a blind spot).

Classes:

- ``IDENTITY``: the field's value (or what it resolves to) is an identity field;
- ``LAYOUT``: already in the layout fingerprint the seed binds (block size,
  layers, heads, head size, KV dtype as stored);
- ``REFUSED``: a value other than the default makes the connector refuse to
  start (``layout.py`` takes one group of full-attention layers; ``connector.py``
  checks parallelism), so no KV under it is ever stored;
- ``IGNORED``: does not change the KV of a token sequence (the reason says why).

Weights are named by content: every checkpoint file vLLM would load, hashed in
full and remembered by stat (``tierkv.identity.file_digests``). When the files
cannot be found (a remote name with nothing in the local Hugging Face cache),
the identity cannot be known: ``vllm_identity`` returns ``known=False`` and the
connector turns off every tier another process could read, unless the user
declared ``model_id`` themselves (then the weights field is that declaration).
Computed once per connector half; pure function of the config and the files.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.identity import ModelIdentity, checkpoint_files, weights_digest

log = logging.getLogger("tierkv.connectors.vllm")

IDENTITY, LAYOUT, REFUSED, IGNORED = "identity", "layout", "refused", "ignored"
CLASSES = (IDENTITY, LAYOUT, REFUSED, IGNORED)

_SAMPLING = "sampling and outputs only: the KV of the prompt is computed before any of it"
_MEMORY = "memory management of the weights or the cache, not their values"
_TOPOLOGY = "process topology, networking or scheduling: the KV of a token is the same"
_TOKENS = "tokenisation decides the token ids, and the ids themselves are the key"
_VLLM_CACHE = "vLLM's own prefix cache (hashing, granularity, retention), not tierkv's keys"
_SIZES = "sizes of vLLM's cache, not the KV values"
_MAMBA = "Mamba/SSM state: layout.py takes one group of full-attention layers and refuses hybrids"
_SHARDING = ("sharding: a token's KV is the same whatever the split (connector.py refuses sizes it "
             "does not support)")

# name -> (class, how it enters / why not)
MODEL_FIELDS: dict[str, tuple[str, str]] = {
    "model": (IDENTITY, "as the content of its checkpoint files (weights), not the path"),
    "model_weights": (IDENTITY, "as the content of the files when it names a local directory"),
    "runner": (IDENTITY, "the runner picks the model class"),
    "convert": (IDENTITY, "an adapter converts the model class"),
    "tokenizer": (IGNORED, _TOKENS),
    "tokenizer_mode": (IGNORED, _TOKENS),
    "trust_remote_code": (IDENTITY, "remote code defines the model; its *.py files are hashed with the weights"),
    "dtype": (IDENTITY, "weight and activation dtype"),
    "seed": (IGNORED, _SAMPLING),
    "hf_config": (IDENTITY, "the effective config (after hf_overrides): rope, heads, norms, windows..."),
    "hf_text_config": (IGNORED, "a view of hf_config, which enters"),
    "is_submodel_config": (IDENTITY, "a submodel view has another architecture list"),
    "word_embeddings_untied_by_checkpoint": (IDENTITY, "which embedding the model reads"),
    "hf_config_path": (IGNORED, "a path: the config it names enters as hf_config"),
    "allowed_local_media_path": (IGNORED, "multimodal requests are not cached (scheduler._cacheable)"),
    "allowed_media_domains": (IGNORED, "multimodal requests are not cached (scheduler._cacheable)"),
    "revision": (IDENTITY, "names the weights (their content enters as well)"),
    "code_revision": (IDENTITY, "the remote code's revision"),
    "tokenizer_revision": (IGNORED, _TOKENS),
    "max_model_len": (IGNORED, "a limit on sequence length; rope reads max_position_embeddings from hf_config"),
    "spec_target_max_model_len": (IGNORED, "a limit on sequence length for speculative decoding"),
    "quantization": (IDENTITY, "quantization method"),
    "quantization_config": (IDENTITY, "quantization parameters"),
    "allow_deprecated_quantization": (IGNORED, "a permission, not a method (quantization enters)"),
    "enforce_eager": (IGNORED, "the same kernels, captured in a graph or not"),
    "return_sampling_mask": (IGNORED, _SAMPLING),
    "max_logprobs": (IGNORED, _SAMPLING),
    "logprobs_mode": (IGNORED, _SAMPLING),
    "use_fp64_gumbel": (IGNORED, _SAMPLING),
    "enable_trace_replay": (IGNORED, "forces decoded tokens, which are then ids like any other"),
    "disable_sliding_window": (IDENTITY, "a window changes the attention of every layer it applies to"),
    "disable_cascade_attn": (IGNORED, "a kernel choice for shared prefixes with the same result"),
    "skip_tokenizer_init": (IGNORED, _TOKENS),
    "enable_prompt_embeds": (IGNORED, "requests with prompt embeddings are not cached (scheduler._cacheable)"),
    "served_model_name": (IGNORED, "a label for the API"),
    "config_format": (IGNORED, "how the config is read; what it says enters as hf_config"),
    "hf_token": (IGNORED, "a credential (never recorded)"),
    "hf_overrides": (IDENTITY, "overrides of the config (also visible in hf_config)"),
    "model_class_overrides": (IDENTITY, "another model class for an architecture"),
    "generation_config": (IGNORED, _SAMPLING),
    "override_generation_config": (IGNORED, _SAMPLING),
    "enable_sleep_mode": (IGNORED, _MEMORY),
    "sleep_preserve_parameter_names": (IGNORED, _MEMORY),
    "sleep_mode_backend": (IGNORED, _MEMORY),
    "sleep_mode_offload_cudagraph": (IGNORED, _MEMORY),
    "enable_nccl_comm_suspend": (IGNORED, _MEMORY),
    "enable_cumem_allocator": (IGNORED, _MEMORY),
    "model_impl": (IDENTITY, "vLLM's or transformers' implementation of the model"),
    "logits_processors": (IGNORED, _SAMPLING),
    "io_processor_plugin": (IGNORED, "input/output processing around the model"),
    "renderer_num_workers": (IGNORED, _TOPOLOGY),
    "pooler_config": (IGNORED, "pooling reads hidden states after the KV is computed"),
    "multimodal_config": (IGNORED, "multimodal requests are not cached (scheduler._cacheable)"),
}

CACHE_FIELDS: dict[str, tuple[str, str]] = {
    "block_size": (LAYOUT, "tokens per block"),
    "user_specified_block_size": (IGNORED, "block_size, which is in the layout, is what counts"),
    "kv_cache_layout": (IGNORED, "vLLM's physical layout; the connector converts to tierkv's own"),
    "prefix_match_unit": (IGNORED, _VLLM_CACHE),
    "gpu_memory_utilization": (IGNORED, _SIZES),
    "cache_dtype": (IDENTITY, "the KV cache dtype (fp8 variants share a storage dtype, so it enters by name)"),
    "is_attention_free": (REFUSED, "an attention-free model has no KV group for layout.py"),
    "num_gpu_blocks_override": (IGNORED, _SIZES),
    "sliding_window": (IDENTITY, "the attention window"),
    "enable_prefix_caching": (IGNORED, _VLLM_CACHE),
    "prefix_caching_hash_algo": (IGNORED, _VLLM_CACHE),
    "prefix_cache_retention_interval": (IGNORED, _VLLM_CACHE),
    "kv_cache_dtype_skip_layers": (IDENTITY, "layers whose KV keeps full precision"),
    "mamba_page_size_padded": (IGNORED, _MAMBA),
    "skip_page_size_padded": (IGNORED, _SIZES),
    "mamba_block_size": (IGNORED, _MAMBA),
    "mamba_cache_dtype": (IGNORED, _MAMBA),
    "mamba_ssm_cache_dtype": (IGNORED, _MAMBA),
    "mamba_cache_mode": (IGNORED, _MAMBA),
    "enable_mamba_shared_prefix_checkpoint": (IGNORED, _MAMBA),
    "replayssm_buffer_len": (IGNORED, _MAMBA),
    "use_replayssm": (IGNORED, _MAMBA),
    "use_kda_recoverssm": (IGNORED, _MAMBA),
    "num_gpu_blocks": (IGNORED, _SIZES),
    "num_cpu_blocks": (IGNORED, _SIZES),
    "effective_attention_block_size": (LAYOUT, "block size including context parallelism"),
    "kv_cache_size_tokens": (IGNORED, _SIZES),
    "kv_cache_max_concurrency": (IGNORED, _SIZES),
    "hash_block_size": (IGNORED, _VLLM_CACHE),
    "cache_hit_alignment_tokens": (IGNORED, _VLLM_CACHE),
    "kv_sharing_fast_prefill": (IDENTITY, "layers that skip prefill tokens (YOCO) hold other KV"),
    "swa_bounded_replay": (IDENTITY, "which sliding-window KV is kept"),
    "kv_cache_memory_bytes": (IGNORED, _SIZES),
    "kv_offloading_size": (IGNORED, "vLLM's own offloading, a peer of this connector"),
    "kv_offloading_backend": (IGNORED, "vLLM's own offloading, a peer of this connector"),
    "_block_size_resolved": (IGNORED, "internal flag; block_size is in the layout"),
}

_PARALLEL_IGNORED = (
    "data_parallel_size data_parallel_size_local data_parallel_rank data_parallel_rank_local "
    "data_parallel_master_ip data_parallel_rpc_port dp_sync_interval data_parallel_master_port "
    "data_parallel_backend data_parallel_external_lb data_parallel_hybrid_lb is_moe_model enable_hc_sp "
    "enable_batch_sharded_sampling enable_ep_weight_filter all2all_backend "
    "max_parallel_loading_workers disable_custom_all_reduce enable_shm_tensor_arena enable_elastic_ep "
    "elastic_ep_max_dp_size enable_dbo ubatch_size dbo_decode_token_threshold dbo_prefill_token_threshold "
    "disable_nccl_for_dp_synchronization ray_workers_use_nsight ray_runtime_env placement_group "
    "distributed_executor_backend worker_cls worker_extension_cls master_addr master_port node_rank nnodes "
    "numa_bind numa_bind_nodes numa_bind_cpus assigned_physical_gpu_ids distributed_timeout_seconds "
    "cpu_distributed_timeout_seconds world_size rank _data_parallel_master_port_list _coord_store_port "
    "data_parallel_index _api_process_count _api_process_rank enable_fault_tolerance fault_tolerance_config"
).split()

PARALLEL_FIELDS: dict[str, tuple[str, str]] = {
    **{name: (IGNORED, _TOPOLOGY) for name in _PARALLEL_IGNORED},
    "tensor_parallel_size": (IGNORED, _SHARDING),
    "pipeline_parallel_size": (IGNORED, _SHARDING),
    "prefill_context_parallel_size": (REFUSED, "context parallelism splits a block's tokens across ranks"),
    "decode_context_parallel_size": (REFUSED, "context parallelism splits a block's tokens across ranks"),
    "dcp_kv_cache_interleave_size": (IGNORED, "used only with decode context parallelism, which is refused"),
    "dcp_comm_backend": (IGNORED, "used only with decode context parallelism, which is refused"),
    "dcp_q_replicate": (IGNORED, "used only with decode context parallelism, which is refused"),
    "cp_kv_cache_interleave_size": (IGNORED, "used only with context parallelism, which is refused"),
    "_allow_auto_resolve_cp_interleave_size": (IGNORED, "used only with context parallelism, which is refused"),
    "enable_expert_parallel": (IGNORED, "where experts run, not what they compute"),
    "enable_eplb": (IGNORED, "expert load balancing moves experts, not their weights' values"),
    "eplb_config": (IGNORED, "expert load balancing moves experts, not their weights' values"),
    "expert_placement_strategy": (IGNORED, "where experts run, not what they compute"),
}

FIELDS = {"ModelConfig": MODEL_FIELDS, "CacheConfig": CACHE_FIELDS, "ParallelConfig": PARALLEL_FIELDS}

# hf_config.to_dict() keys that name where or by what the config was read, not the model.
_CONFIG_NOISE = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation_autoset")


def config_field_names(cls) -> list[str]:
    """The fields of a vLLM config class (dataclass or pydantic), as the table must cover them."""
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return list(getattr(cls, "model_fields"))


@dataclass(frozen=True)
class VllmIdentity:
    """The identity of one vLLM engine; ``known`` is False when its weights could not be found
    (then ``reason`` says why and ``identity`` names the model only by its declaration)."""

    identity: ModelIdentity
    known: bool
    reason: str = ""
    files: tuple[str, ...] = ()


def vllm_identity(vllm_config, declared_model_id: str | None = None) -> VllmIdentity:
    """The identity of ``vllm_config``'s model: weights by content, the effective config, and every
    ``IDENTITY`` field of the table. ``declared_model_id`` (the user set ``model_id``) stands in for
    the weights when their files cannot be found. Reads and (first time) hashes the checkpoint."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    files, reason = _checkpoint(vllm_config)
    trust = bool(getattr(model, "trust_remote_code", False))
    if files:
        paths = list(files)
        if trust:
            paths += sorted(str(p) for p in Path(files[0]).parent.glob("*.py"))
        weights, known = weights_digest(paths), True
    elif declared_model_id:
        weights, known = f"declared:{declared_model_id}@{model.revision or ''}", True
        reason = ""
    else:
        weights, known = f"unknown:{model.model}", False
    values: dict[str, Any] = {
        "weights": weights,
        "config": _config_dict(model.hf_config),
        "hf_overrides": _plain(getattr(model, "hf_overrides", None) or {}),
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_dtype": str(cache.cache_dtype),
        "quantization": str(model.quantization or "none"),
        "quantization_config": _plain(getattr(model, "quantization_config", None)),
        "sliding_window": _plain([getattr(cache, "sliding_window", None), bool(model.disable_sliding_window)]),
        "runtime": "vllm",
        "model_class": _plain({k: getattr(model, k, None) for k in (
            "runner", "convert", "model_impl", "model_class_overrides", "is_submodel_config",
            "word_embeddings_untied_by_checkpoint", "trust_remote_code", "code_revision", "revision")}),
        "kv_variant": _plain({k: getattr(cache, k, None) for k in (
            "kv_cache_dtype_skip_layers", "kv_sharing_fast_prefill", "swa_bounded_replay")}),
    }
    return VllmIdentity(ModelIdentity.of(values), known, reason, tuple(files))


def _checkpoint(vllm_config) -> tuple[list[str], str]:
    """The checkpoint files vLLM loads for this model, or ``([], why not)``."""
    model = vllm_config.model_config
    for where in (getattr(model, "model_weights", "") or "", model.model):
        if where and Path(where).exists():
            try:
                return [str(p) for p in checkpoint_files(where)], ""
            except FileNotFoundError as exc:
                return [], str(exc)
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(model.model, revision=model.revision, cache_dir=download_dir,
                                  local_files_only=True)
        return [str(p) for p in checkpoint_files(local)], ""
    except Exception as exc:  # noqa: BLE001 - any failure means: the content cannot be known here
        return [], f"{model.model!r} is not a local path and is not in the local Hugging Face cache ({type(exc).__name__})"


def _config_dict(hf_config) -> Any:
    try:
        data = hf_config.to_dict()
    except Exception:  # noqa: BLE001 - a config without to_dict still names itself
        return repr(hf_config)
    for k in _CONFIG_NOISE:
        data.pop(k, None)
    return _plain(data)


def _plain(value: Any) -> Any:
    """``value`` as JSON-able data with no memory addresses (callables by qualified name)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if hasattr(value, "to_dict"):
        try:
            return _plain(value.to_dict())
        except Exception:  # noqa: BLE001
            pass
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    if hasattr(value, "value") and hasattr(type(value), "__members__"):  # an Enum
        return _plain(value.value)
    if dataclasses.is_dataclass(value):
        return _plain(dataclasses.asdict(value))
    return str(value)
