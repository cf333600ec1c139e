"""tierkv as a vLLM v1 KV connector (DESIGN section 11).

Use it with::

    --kv-transfer-config '{"kv_connector":"TierKVConnector",
        "kv_connector_module_path":"tierkv.connectors.vllm","kv_role":"kv_both",
        "kv_connector_extra_config":{"l2":{"capacity":"8GiB"}}}'

Written against vLLM 0.32.0 (see docs/vllm.md); vLLM is not a dependency of
tierkv and is imported only here.
"""

try:
    import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        f"tierkv.connectors.vllm needs vLLM 0.32.0 installed beside tierkv ({exc}); see docs/vllm.md"
    ) from exc

from tierkv.connectors.vllm.connector import TierKVConnector

__all__ = ["TierKVConnector"]
