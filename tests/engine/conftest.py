"""Engine fixtures: one tiny seeded checkpoint per session and an LLM factory that closes what it made.

Helpers (prompts, store configs) live in ``engine_helpers.py``: test files import
that module by name, never ``conftest``, which another directory's conftest could shadow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import store_config

from tierkv.config import StoreConfig
from tierkv.engine import LLM, EngineConfig
from tierkv.engine.checkpoint import write_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


@pytest.fixture
def make_llm(tiny_dir: Path):
    made: list[LLM] = []

    def make(store: StoreConfig | None = None, enable_cache: bool = True, model_dir: Path | None = None,
             **engine) -> LLM:
        engine.setdefault("num_blocks", 128)
        engine.setdefault("num_threads", 1)  # a shared 2-core host: threaded GEMMs of this size only contend
        llm = LLM(model_dir or tiny_dir, store or store_config(None), EngineConfig(**engine), enable_cache)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()
