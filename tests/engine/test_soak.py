"""A short soak: an engine on SmolLM2 serving 60 prompts of distinct lengths keeps its memory flat.

Each distinct token count used to leave packed-linear state behind (oneDNN primitives, ~2-3 MiB
a length, measured: +118 MiB from prompt 20 to 60 with the caches uncapped); with the caps of
``engine/cpu_linear.py`` the same run grows ~20 MiB, the store's tiers filling included. The
run is a fresh process (tests/engine/soak_worker.py), so the RSS is the engine's alone.
bench/soak.py is the long one, through `tierkv serve`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _models import smollm2_dir  # noqa: F401  (fixture)

WORKER = Path(__file__).with_name("soak_worker.py")


def test_distinct_prompt_lengths_do_not_grow_the_engine(smollm2_dir, tmp_path):
    out = subprocess.run([sys.executable, str(WORKER), str(smollm2_dir), str(tmp_path), "60", "16", "400"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads(out.stdout.strip().splitlines()[-1])
    rss, lengths = run["rss_mib"], run["lengths"]
    assert len(set(lengths)) == 60
    growth = rss[-1] - rss[19]
    assert growth <= 40, f"RSS grew {growth:.0f} MiB over prompts 20-60 of distinct lengths: {rss}"
