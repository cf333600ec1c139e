"""Shared fixtures: a small canonical layout, a temporary L3 directory and a store factory.

``shm_name`` is a unique shared-L2 name whose /dev/shm files are removed afterwards.
``_env.SHARED`` is the project's shared folder (``../shared`` beside the checkout, or
``$TIERKV_SHARED``): the trace lives there.

Strict mode: with ``TIERKV_REQUIRE_SERVERS=1`` (``.ci/run`` sets it) every test
that would skip — redis-server, mooncake_master, a C compiler, triton,
transformers or the shared trace missing — fails instead, saying what was
missing. The hooks below turn a skip of a test, of its fixtures or of a whole
module (``importorskip``) into a failure; an ``xfail`` stays an xfail.
``make_store(l1=4, l2=4, l3=16)`` builds a TierKVStore whose tier capacities
are given in blocks (0 disables L2/L3); every store it made is closed at
teardown. Helpers for deterministic blocks live in ``tests/_kv.py`` so that
subprocess workers can use them too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _env import STRICT  # noqa: E402
from _kv import LAYOUT, store_config  # noqa: E402

from tierkv.layout import KVLayout  # noqa: E402
from tierkv.store import TierKVStore  # noqa: E402


def _fail_a_skip(report) -> None:
    if STRICT and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"TIERKV_REQUIRE_SERVERS=1, so this skip is a failure: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_a_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_a_skip(outcome.get_result())


@pytest.fixture
def layout() -> KVLayout:
    return LAYOUT


@pytest.fixture
def l3_dir(tmp_path: Path) -> Path:
    return tmp_path / "l3"


@pytest.fixture
def make_store(layout: KVLayout, l3_dir: Path):
    opened: list[TierKVStore] = []

    def make(l1: int = 4, l2: int = 4, l3: int = 16, *, path: str | Path | None = None,
             layout: KVLayout = layout, **fields) -> TierKVStore:
        cfg = store_config(layout, l2, l3, path or l3_dir, **fields)
        store = TierKVStore(cfg, layout, l1_blocks=l1)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def shm_name():
    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    base = Path(f"/dev/shm/tierkv-{name}")
    for path in (base.with_name(base.name + ".slab"), base.with_name(base.name + ".lmdb")):
        if path.is_dir():
            for child in path.iterdir():
                child.unlink()
            path.rmdir()
        elif path.exists():
            path.unlink()
    assert not list(Path("/dev/shm").glob(f"tierkv-{name}*"))


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A 1 MiB tmpfs (root only), unmounted afterwards: a disk that fills up."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)
