"""vLLM 0.32.0's KV cache, seen as tierkv's canonical layout (docs/design.md §2, §13).

vLLM 0.32.0 gives every attention layer a 4-D view ``[num_blocks, Hkv, B, 2*D]``
(logical [B, H, N, C], RFC #42082) into one allocation shared by all layers of
a cache group, each layer ``layer_stride`` bytes after the previous one. How K
and V share the ``2*D`` of a token depends on the attention backend:

- ``planes`` (the CPU backend, ``cpu_attn.py``): a (block, head) page
  ``[B, 2D]`` is read as ``[2B, D]``, K rows first, then V rows;
- ``tokens`` (the CUDA backends): each token's row is ``[K(D) | V(D)]``.

``cache_view`` turns the per-layer tensors into one strided view
``[L, num_blocks, 2, B, Hkv, D]`` that ``gather_blocks`` / ``scatter_blocks``
read and write in place, and refuses anything else with the shapes it saw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tierkv.layout import DTYPES, KVLayout

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def layout_from_kv_cache_config(kv_cache_config) -> tuple[KVLayout, list[str]]:
    """The canonical layout and the layer order (canonical layer l = ``layer_names[l]``).

    Supports one cache group of full attention layers with K and V of one head
    size; raises ValueError naming what it found otherwise.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise ValueError(
            f"kv_cache_config: tierkv supports one KV cache group (full attention), got {len(groups)}"
        )
    spec, names = groups[0].kv_cache_spec, list(groups[0].layer_names)
    if not isinstance(spec, FullAttentionSpec) or isinstance(spec, MLAAttentionSpec):
        raise ValueError(f"kv_cache_spec: tierkv supports FullAttentionSpec, got {type(spec).__name__}")
    if spec.head_size_v not in (None, spec.head_size):
        raise ValueError(f"kv_cache_spec: K and V head sizes differ ({spec.head_size} vs {spec.head_size_v})")
    if spec.dtype not in _DTYPE_NAMES:
        raise ValueError(f"kv_cache_spec.dtype: expected one of {sorted(DTYPES)}, got {spec.dtype}")
    if not names:
        raise ValueError("kv_cache_config: the cache group has no layers")
    layout = KVLayout(num_layers=len(names), num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                      block_size=spec.block_size, dtype=_DTYPE_NAMES[spec.dtype])
    return layout, names


def resolve_split(split: str, device: torch.device) -> str:
    if split != "auto":
        return split
    return "planes" if device.type == "cpu" else "tokens"


def cache_view(kv_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str], layout: KVLayout,
               split: str) -> torch.Tensor:
    """One strided view [L, num_blocks, 2, B, Hkv, D] over vLLM's per-layer caches (no copy).

    Raises ValueError when a layer is missing or the tensors are not vLLM
    0.32.0's layout: 4-D ``[num_blocks, Hkv, B, 2*D]`` of the layout's dtype,
    all in one allocation with one stride between consecutive layers.
    """
    missing = [n for n in layer_names if n not in kv_caches]
    if missing:
        raise ValueError(f"kv_caches: no cache for layers {missing[:4]}; got {sorted(kv_caches)[:4]}")
    caches = [kv_caches[n] for n in layer_names]
    first = caches[0]
    hkv, block, d = layout.num_kv_heads, layout.block_size, layout.head_dim
    for name, t in zip(layer_names, caches):
        _check_layer(name, t, first, layout)
    s_block, s_head, s_tok, s_c = first.stride()
    if split == "planes":
        if (s_tok, s_c) != (2 * d, 1):
            raise ValueError(
                f"kv_caches: the CPU layout needs each (block, head) page [B, 2D] contiguous, "
                f"got strides {first.stride()} for shape {tuple(first.shape)}"
            )
        kv_stride, tok_stride = block * d, d
    elif split == "tokens":
        if s_c != 1:
            raise ValueError(f"kv_caches: each token's [K|V] row must be contiguous, got strides {first.stride()}")
        kv_stride, tok_stride = d, s_tok
    else:
        raise ValueError(f"vllm.kv_split: expected 'planes' or 'tokens', got {split!r}")
    layer_stride = _layer_stride(layer_names, caches)
    return first.as_strided(
        (len(caches), first.shape[0], 2, block, hkv, d),
        (layer_stride, s_block, kv_stride, tok_stride, s_head, 1),
        first.storage_offset(),
    )


def _check_layer(name: str, t: torch.Tensor, first: torch.Tensor, layout: KVLayout) -> None:
    want = ("num_blocks", layout.num_kv_heads, layout.block_size, 2 * layout.head_dim)
    if t.dim() != 4 or tuple(t.shape[1:]) != want[1:]:
        raise ValueError(
            f"kv_caches[{name!r}]: unknown layout {tuple(t.shape)}; tierkv reads vLLM 0.32.0's "
            f"per-layer cache [{', '.join(map(str, want))}]"
        )
    if t.dtype != layout.torch_dtype:
        raise ValueError(f"kv_caches[{name!r}]: dtype {t.dtype}, the cache spec says {layout.torch_dtype}")
    if t.shape != first.shape or t.stride() != first.stride() or t.device != first.device:
        raise ValueError(
            f"kv_caches[{name!r}]: shape/strides/device {tuple(t.shape)} {t.stride()} {t.device} "
            f"differ from the first layer's {tuple(first.shape)} {first.stride()} {first.device}"
        )
    if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
        raise ValueError(
            f"kv_caches[{name!r}]: not in the same allocation as the first layer; vLLM 0.32.0 "
            "allocates one buffer per cache group"
        )


def _layer_stride(layer_names: Sequence[str], caches: Sequence[torch.Tensor]) -> int:
    if len(caches) == 1:
        return caches[0].numel()
    item = caches[0].element_size()
    steps = {(b.data_ptr() - a.data_ptr()) for a, b in zip(caches, caches[1:])}
    step = steps.pop()
    if steps or step <= 0 or step % item:
        raise ValueError(
            f"kv_caches: layers {list(layer_names)[:4]}... are not evenly spaced in their allocation"
        )
    return step // item
