"""Cost model: depth-growing recompute, config overrides, Match cut on constructed tier costs."""

from __future__ import annotations

import pytest
from _kv import prompt, save_prompt

from tierkv.config import CostConfig, PolicyConfig, StoreConfig
from tierkv.cost import CostModel, calibrate, fit_prefill
from tierkv.index import Tier

L1, L2, L3, L4 = Tier.L1, Tier.L2, Tier.L3, Tier.L4


def model(l2: float, l3: float, recompute: float = 1.0, growth: float = 0.0, block_size: int = 1) -> CostModel:
    return CostModel((0.0, l2, l3, 5.0), recompute, growth, block_size, 64)


def test_recompute_grows_with_depth_linearly_in_context():
    m = CostModel((0.0, 0.0, 0.0, 0.0), 2.0, 0.01, 16, 1)
    assert m.recompute_block_us(0) == 2.0 * 16
    assert m.recompute_block_us(3) == pytest.approx(2.0 * 16 * (1 + 0.01 * 3 * 16))
    units = CostModel.units(0.5, 512)
    assert [round(units.recompute_block_us(d), 9) for d in range(4)] == [1.0, 1.5, 2.0, 2.5]


def test_cut_keeps_every_block_that_loads_faster_than_it_recomputes():
    assert model(0.5, 0.9).cut([L1, L2, L2, L3]) == 4


def test_a_tier_slower_than_recompute_is_ignored():
    m = model(0.5, 3.0)
    assert m.cut([L3, L3, L3]) == 0
    assert m.cut([L1, L2, L3, L3]) == 2  # the L3 tail costs more than recomputing it


def test_cut_loads_a_slow_block_when_deeper_blocks_pay_for_it():
    # Recompute of block d costs 1 + d (growth 1 per token of context, 1-token blocks).
    # L3 at 1.5: block 0 alone loses 0.5, block 1 gains 0.5, block 2 gains 1.5.
    m = model(0.5, 1.5, growth=1.0)
    assert m.cut([L3]) == 0
    assert m.cut([L3, L3]) == 0          # a tie: the shorter prefix wins
    assert m.cut([L3, L3, L3]) == 3
    load, rest = m.estimate_us([L3, L3, L3], 5)
    assert (load, rest) == (4.5, 4.0 + 5.0)
    assert m.saved_us([L3, L3, L3]) == pytest.approx(6.0 - 4.5)


def test_keep_benefit_is_recompute_or_the_cheaper_reload_below():
    m = model(0.5, 3.0, growth=1.0)
    assert m.keep_benefit_us(0, L1, None) == 1.0           # dropped: recompute 1
    assert m.keep_benefit_us(4, L1, L2) == 0.5             # reload from L2 (0.5) beats recompute (5)
    assert m.keep_benefit_us(0, L2, L3) == 0.5             # L3 (3) is slower than recompute (1): 1 - 0.5
    assert m.keep_benefit_us(0, L3, None) > 0              # never zero: policies rank in log/ratio space


def test_config_overrides_every_figure_and_estimates_fill_the_rest():
    cfg = CostConfig(recompute_us_per_token=7.0, l2_us_per_token=0.25, recompute_growth=0.0)
    m = CostModel.from_config(cfg, block_bytes=4096, block_size=16)
    assert m.recompute_us == 7.0 and m.growth == 0.0 and m.load_us[1] == 0.25
    assert m.load_us[2] == pytest.approx(4096 / 16 / 1e3)  # built-in 1 GB/s for L3
    default = CostModel.from_config(CostConfig(), 4096, 16)
    assert default.growth > 0 and default.recompute_us > 0
    measured = CostModel((0.0, 1.0, 2.0, 3.0), 9.0, 0.5, 16, 4096)
    mixed = CostModel.from_config(CostConfig(l3_us_per_token=0.125), 4096, 16, measured)
    assert mixed.load_us == (0.0, 1.0, 0.125, 3.0) and mixed.recompute_us == 9.0 and mixed.growth == 0.5


@pytest.mark.parametrize("field,value", [("recompute_growth", float("nan")), ("l2_us_per_token", -1.0),
                                         ("calibrate", 1)])
def test_bad_cost_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^cost\.{field}: "):
        CostConfig(**{field: value})


def test_fit_prefill_recovers_linear_and_attention_terms():
    a, g = 2.0, 0.01
    t = [a * n + a * g * n * n / 2 for n in (100, 400)]
    assert fit_prefill(100, t[0], 400, t[1]) == pytest.approx((2.0, 0.01))
    assert fit_prefill(100, 300.0, 400, 1000.0)[1] == 0.0  # sub-linear noise: no growth
    with pytest.raises(ValueError, match="fit_prefill"):
        fit_prefill(400, 1.0, 100, 1.0)


def test_calibrate_measures_host_and_disk_on_this_machine(tmp_path):
    """The real measurement runs here (a memmove, an uncached read, the prefill callable);
    its figures are finite and L3 includes the copy into L1. No timing is compared."""
    calls = []
    m = calibrate(4096, 16, disk_dir=str(tmp_path), prefill=calls.append, prefill_lengths=(8, 32), repeat=1)
    assert m.load_us[0] == 0.0 and 0 < m.load_us[1] < float("inf") and m.load_us[1] < m.load_us[2] < float("inf")
    assert m.recompute_us > 0 and m.growth >= 0 and calls == [8, 32]
    assert not list(tmp_path.iterdir())  # the probe file is gone


def test_calibrate_turns_what_it_timed_into_costs(tmp_path, monkeypatch):
    """On a clock the test controls: a memmove at 4 GB/s, a disk read at 0.5 GB/s and a prefill
    of t(n) = a n + a g n^2 / 2 µs must come out as exactly those figures, L3 = disk + copy."""
    import ctypes
    import os as os_module

    import tierkv.cost as cost

    now = [0.0]
    monkeypatch.setattr(cost.time, "perf_counter", lambda: now[0])
    real_memmove, real_pread = ctypes.memmove, os_module.pread

    def memmove(dst, src, n):
        now[0] += n / 4e9
        return real_memmove(dst, src, n)

    def pread(fd, n, offset):
        now[0] += n / 0.5e9
        return real_pread(fd, n, offset)

    monkeypatch.setattr(ctypes, "memmove", memmove)
    monkeypatch.setattr(cost.os, "pread", pread)
    a, g = 3.0, 0.002

    def prefill(n):
        now[0] += (a * n + a * g * n * n / 2) / 1e6

    block_bytes, block_size = 1 << 20, 16   # 1 MiB blocks: four of them are measured
    m = calibrate(block_bytes, block_size, disk_dir=str(tmp_path), prefill=prefill, repeat=2)
    per_token = block_bytes / block_size
    assert m.load_us[1] == pytest.approx(per_token / 4e9 * 1e6)
    assert m.load_us[2] == pytest.approx(per_token / 0.5e9 * 1e6 + m.load_us[1])
    assert m.load_us[2] > m.load_us[1] > m.load_us[0] == 0.0
    assert (m.recompute_us, m.growth) == (pytest.approx(a), pytest.approx(g))


def test_store_cuts_a_match_whose_l3_costs_more_than_recompute(make_store, layout):
    slow = CostConfig(recompute_us_per_token=1.0, recompute_growth=0.0, l2_us_per_token=0.5,
                      l3_us_per_token=2.0)
    store = make_store(l1=2, l2=0, l3=8, cost=slow, policy=PolicyConfig(name="lru"))
    tokens = prompt(11, 2, layout)
    save_prompt(store, tokens)
    save_prompt(store, prompt(12, 2, layout))  # pushes the first chain down to L3
    m = store.lookup(tokens)
    store.release(m)
    assert m.num_blocks == 0 and m.est_load_us == 0.0
    assert m.est_recompute_us == 2 * layout.block_size * 1.0


def test_store_keeps_a_match_whose_l3_is_cheap(make_store, layout):
    fast = CostConfig(recompute_us_per_token=1.0, recompute_growth=0.0, l3_us_per_token=0.25)
    store = make_store(l1=2, l2=0, l3=8, cost=fast, policy=PolicyConfig(name="lru"))
    tokens = prompt(13, 2, layout)
    save_prompt(store, tokens)
    save_prompt(store, prompt(14, 2, layout))
    m = store.lookup(tokens)
    store.release(m)
    assert m.tiers == [L3, L3] and m.est_load_us == 2 * layout.block_size * 0.25


def test_store_calibrates_at_start_when_asked_and_config_still_wins(make_store):
    store = make_store(l1=2, l2=2, l3=4, cost=CostConfig(calibrate=True, l3_us_per_token=9.0))
    assert store.cost.load_us[0] == 0.0 and store.cost.load_us[1] > 0  # measured
    assert store.cost.load_us[2] == 9.0                                 # set in config


def test_store_config_carries_the_cost_section():
    cfg = StoreConfig.from_dict({"cost": {"recompute_growth": 0.002, "calibrate": False}})
    assert cfg.cost.recompute_growth == 0.002
