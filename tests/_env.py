"""Where the tests find what lives outside the checkout, and whether CI's strict mode is on.

``SHARED`` is the project's shared folder: ``$TIERKV_SHARED`` (the Makefile passes its
``SHARED``), else ``../shared`` beside the checkout; ``SYNTHETIC_TRACE`` the Mooncake-format
trace in it; ``load_tool(name)`` imports ``tools/NAME.py`` (a script, not a package).
``STRICT`` is ``TIERKV_REQUIRE_SERVERS=1`` (``.ci/run`` sets it): a test that would skip fails instead (tests/conftest.py).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TIERKV_SHARED") or ROOT.parent / "shared")
STRICT = os.environ.get("TIERKV_REQUIRE_SERVERS") == "1"
SYNTHETIC_TRACE = SHARED / "data" / "traces" / "mooncake_synthetic_trace.jsonl"


def load_tool(name: str):
    """``tools/<name>.py`` as a module (registered in ``sys.modules``, so its dataclasses pickle)."""
    spec = importlib.util.spec_from_file_location(f"tierkv_{name}_tool", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def write_trace(path: Path, requests: list[list[int]]) -> Path:
    """A Mooncake-format trace of ``requests`` (one list of hash ids each, one request per second)."""
    import json

    with open(path, "w") as fh:
        for t, ids in enumerate(requests):
            fh.write(json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 1,
                                 "hash_ids": ids}) + "\n")
    return path
