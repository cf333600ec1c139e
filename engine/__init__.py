"""tierkv.engine: a compact paged-attention engine whose KV pool is the L1 tier of the store."""

from tierkv.engine.config import EngineConfig
from tierkv.engine.llm import LLM
from tierkv.engine.sampler import SamplingParams
from tierkv.engine.sequence import Output

__all__ = ["LLM", "EngineConfig", "Output", "SamplingParams"]
