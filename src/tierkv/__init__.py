"""tierkv: a hierarchical KV-cache store for LLM inference."""

from tierkv.config import StoreConfig
from tierkv.hashing import BlockHash, BlockHasher
from tierkv.index import Tier
from tierkv.layout import KVLayout
from tierkv.store import Match, OutOfBlocks, TierKVStore

__all__ = ["BlockHash", "BlockHasher", "KVLayout", "Match", "OutOfBlocks", "StoreConfig", "Tier", "TierKVStore"]
__version__ = "0.1.0"
