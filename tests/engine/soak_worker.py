"""An engine on SmolLM2 serving prompts of many lengths, one process, RSS after each request.

``python soak_worker.py MODEL_DIR CACHE_DIR N LO HI`` serves N prompts of distinct lengths
spread over LO..HI tokens (2 tokens out each; fp32, one thread, L2 64 MiB, L3 256 MiB) and
prints one JSON line: the RSS in MiB after each request. A fresh process, so its RSS is the
engine's alone (tests/engine/test_soak.py; the figure issue 29 asks for: 200 over 20..700).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def main(model_dir: str, cache_dir: str, n: int, lo: int, hi: int) -> None:
    import psutil

    from tierkv.config import L2Config, L3Config, StoreConfig
    from tierkv.engine import LLM, EngineConfig, SamplingParams

    store = StoreConfig(l2=L2Config(capacity="64MiB"), l3=L3Config(path=str(Path(cache_dir) / "l3"), capacity="256MiB"))
    llm = LLM(model_dir, store, EngineConfig(num_blocks=128, num_threads=1, max_model_len=2048))
    rng = random.Random(29)
    lengths = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    rng.shuffle(lengths)
    me, rss = psutil.Process(), []
    try:
        for length in lengths:
            ids = [rng.randrange(1000, 40000) for _ in range(length)]
            out = llm.generate([ids], SamplingParams(max_tokens=2, ignore_eos=True))[0]
            assert len(out.token_ids) == 2
            rss.append(round(me.memory_info().rss / 2**20, 1))
    finally:
        llm.close()
    print(json.dumps({"rss_mib": rss, "lengths": lengths}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]))
