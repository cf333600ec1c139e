"""Fixtures for the vLLM connector tests (run by ``make test-vllm`` in .venv-vllm).

``engine(l2=..., l3=..., policy=..., node=..., l4=..., write=..., **vllm)`` builds a
harness Engine whose store lives under the test's tmp dir; every engine is closed at
teardown. ``redis_server`` and ``mooncake_pool`` are the real pools of ``tests/_servers.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="the vLLM tests run in .venv-vllm (make test-vllm)")
sys.path.insert(0, str(Path(__file__).parent))

from _servers import mooncake_pool, redis_server  # noqa: E402, F401  (real pools for the two-node tests)
from harness import Engine, make_engine  # noqa: E402


@pytest.fixture
def engine(tmp_path: Path):
    made: list[Engine] = []

    def make(l2: str = "16MiB", l3: str = "16MiB", num_blocks: int = 64, policy: str | None = None,
             node: str = "", l4: dict | None = None, write: str | None = None, **vllm) -> Engine:
        """``node``: its own L3 directory (``tmp/<node>/l3``); ``l4``: the ``l4`` section;
        ``write``: ``policy.write``."""
        extra = {"namespace": tmp_path.name, "l2": {"capacity": l2},
                 "l3": {"path": str(tmp_path / node / "l3"), "capacity": l3}, "vllm": vllm}
        if policy is not None or write is not None:
            extra["policy"] = {k: v for k, v in (("name", policy), ("write", write)) if v is not None}
        if l4 is not None:
            extra["l4"] = l4
        e = make_engine(extra, num_blocks=num_blocks)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
