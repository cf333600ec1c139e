"""`tierkv info` on compression: the configured l3/l4.compress, how the L3 directory's blocks are
stored, and what auto decided there."""

from __future__ import annotations

from cli_helpers import cache, run_tierkv  # noqa: F401
from _kv import key_of
from test_compress import SHAPES, layout_of, noise_block, put
from tierkv.compress import AutoChooser
from tierkv.tiers.disk import DiskTier


def test_info_says_how_l3_blocks_are_stored_and_what_auto_chose(cache):
    layout = layout_of(SHAPES[0], "bfloat16")
    tier = DiskTier(cache / "l3", layout, 64, meta={"model_id": "m"}, compress="auto")
    early = [key_of("info early", i) for i in range(AutoChooser.MIN_SAMPLES)]
    for k in early:  # one put per block: auto codes one sample each, and stays raw while deciding
        put(tier, [k])
    tier._auto.raw_read(AutoChooser.MIN_RAW_BYTES, 1000.0)  # a link of 8 KB/s: zstd wins
    late = [key_of("info late", i) for i in range(3)]
    put(tier, late)
    put(tier, [key_of("info noise")], noise_block)
    tier.close()
    env = {"TIERKV_L3_COMPRESS": "auto", "TIERKV_L3_CAPACITY": "64MiB"}
    r = run_tierkv("info", "--json", "--cache-dir", str(cache), env=env)
    assert r.code == 0, r.err
    info = r.json()["tiers"]
    assert info["l3"]["compress"]["mode"] == "auto"
    assert info["l3"]["compress"]["blocks"] == 8 and info["l3"]["compress"]["compressed_blocks"] == 3
    assert info["l3"]["compress"]["ratio"] > 1.0
    assert info["l3"]["compress"]["auto"].startswith("zstd: ratio")
    assert info["l4"]["compress"] == {"mode": "off"}
    text = run_tierkv("info", "--cache-dir", str(cache), env={**env, "TIERKV_L4_URL": "redis://127.0.0.1:1/0",
                                                            "TIERKV_L4_COMPRESS": "auto"}).out
    assert "l3 compress auto (zstd: ratio" in text and "3 of 8 blocks stored compressed" in text
    assert "l4 compress auto (each store decides" in text
