"""tierkv as a vLLM v1 KV connector (docs/design.md §13).

Use it with::

    --kv-transfer-config '{"kv_connector":"TierKVConnector",
        "kv_connector_module_path":"tierkv.connectors.vllm","kv_role":"kv_both",
        "kv_connector_extra_config":{"l2":{"capacity":"8GiB"}}}'

Written against vLLM 0.32.0 (see docs/vllm.md). vLLM is not a dependency of
tierkv: ``TierKVConnector`` imports it on first access, so the layout helpers
in ``tierkv.connectors.vllm.layout`` work (and are benchmarked) without it.
"""

from __future__ import annotations

__all__ = ["TierKVConnector"]


def __getattr__(name: str):
    if name != "TierKVConnector":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from tierkv.connectors.vllm.connector import TierKVConnector
    except ImportError as exc:
        raise ImportError(
            f"tierkv.connectors.vllm needs vLLM 0.32.0 installed beside tierkv ({exc}); see docs/vllm.md"
        ) from exc
    return TierKVConnector
