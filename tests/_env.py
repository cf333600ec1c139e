"""Where the tests find what lives outside the checkout, and whether CI's strict mode is on.

``SHARED`` is the project's shared folder: ``$TIERKV_SHARED`` (the Makefile passes its
``SHARED``), else ``../shared`` beside the checkout. ``STRICT`` is ``TIERKV_REQUIRE_SERVERS=1``
(``.ci/run`` sets it): a test that would skip fails instead (tests/conftest.py).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TIERKV_SHARED") or ROOT.parent / "shared")
STRICT = os.environ.get("TIERKV_REQUIRE_SERVERS") == "1"
