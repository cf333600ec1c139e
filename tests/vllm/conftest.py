"""Fixtures for the vLLM connector tests (run by ``make test-vllm`` in .venv-vllm).

``engine(l2=..., l3=..., policy=..., **vllm)`` builds a harness Engine whose store lives
under the test's tmp dir; every engine is closed at teardown.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="the vLLM tests run in .venv-vllm (make test-vllm)")
sys.path.insert(0, str(Path(__file__).parent))

from harness import Engine, make_engine  # noqa: E402


@pytest.fixture
def engine(tmp_path: Path):
    made: list[Engine] = []

    def make(l2: str = "16MiB", l3: str = "16MiB", num_blocks: int = 64, policy: str | None = None,
             **vllm) -> Engine:
        extra = {"namespace": tmp_path.name, "l2": {"capacity": l2},
                 "l3": {"path": str(tmp_path / "l3"), "capacity": l3}, "vllm": vllm}
        if policy is not None:
            extra["policy"] = {"name": policy}
        e = make_engine(extra, num_blocks=num_blocks)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
