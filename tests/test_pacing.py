"""Background IO paced against foreground work (tierkv.pacing, the store's use of it).

A manual clock decides the pauses, so no test depends on how fast this host is:
a gate that must wait waits on a pause that never ends by itself, and only the
event under test (the foreground ending, an urgent job) can release it.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tierkv.config import IOConfig, StoreConfig
from tierkv.index import Tier
from tierkv.pacing import BACKGROUND, COMPUTE, TRANSFER, Pacer
from tierkv.store import TierKVStore

from _kv import LAYOUT, block_for, key_of, same_bytes, store_config


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def gate_in_thread(p: Pacer) -> threading.Thread:
    t = threading.Thread(target=p.gate, daemon=True)
    t.start()
    return t


def test_piece_under_foreground_earns_a_pause_of_its_share() -> None:
    clock = Clock()
    p = Pacer(0.25, clock=clock)
    with p.foreground():
        with p.piece():
            clock.t += 2.0  # the piece took 2 s
        assert p.resume_at() == pytest.approx(clock.t + 6.0)  # 2 s at 25 %: 6 s of pause
    with p.piece():
        clock.t += 5.0  # no foreground: no pause earned
    assert p.resume_at() == pytest.approx(108.0)


def test_opening_a_section_pauses_lower_ranks_as_their_last_piece_would() -> None:
    clock = Clock()
    p = Pacer(0.25, clock=clock)
    with p.piece():
        clock.t += 1.0  # no foreground: nothing earned, but the piece's length is remembered
    assert p.resume_at() == 0.0
    clock.t += 50.0
    with p.foreground(TRANSFER):
        assert p.resume_at(BACKGROUND) == pytest.approx(clock.t + 3.0)
        assert p.resume_at(TRANSFER) == 0.0  # a put is not paced by another put


def test_nested_pieces_charge_each_second_once() -> None:
    clock = Clock()
    p = Pacer(0.5, clock=clock)
    with p.foreground():
        with p.piece():
            clock.t += 1.0
            with p.piece():
                clock.t += 3.0
            assert p.resume_at() == pytest.approx(clock.t + 3.0)
            clock.t += 1.0
        # the outer piece charges its own 2 s only: pause 2 s from now, not 5
        assert p.resume_at() == pytest.approx(clock.t + 2.0)


def test_gate_waits_only_while_foreground_runs() -> None:
    clock = Clock()
    p = Pacer(0.25, clock=clock)
    fg = p.foreground()
    fg.__enter__()
    with p.piece():
        clock.t += 1.0  # the clock never moves again: the pause only ends by the foreground ending
    t = gate_in_thread(p)
    t.join(0.3)
    assert t.is_alive(), "a gate returned inside the pause while foreground work ran"
    fg.__exit__(None, None, None)
    t.join(5)
    assert not t.is_alive(), "the gate did not open when the foreground ended"
    p.gate()  # no foreground: returns at once although the pause has not passed


def test_urgent_job_opens_the_gate_until_it_starts() -> None:
    clock = Clock()
    p = Pacer(0.25, clock=clock)
    with p.foreground():
        with p.piece():
            clock.t += 1.0
        t = gate_in_thread(p)
        t.join(0.3)
        assert t.is_alive()
        job = p.urgent(lambda x: x + 1)  # a read queued behind the paced piece
        t.join(5)
        assert not t.is_alive(), "an urgent job did not end the pause"
        p.gate()  # still urgent: no wait
        assert job(1) == 2  # the job started: urgency over
        t = gate_in_thread(p)
        t.join(0.3)
        assert t.is_alive(), "the pause did not resume once the urgent job started"
    t.join(5)
    assert not t.is_alive()


def test_ranks_yield_only_upwards() -> None:
    """A TRANSFER piece (a put's copies) is paced by an engine step, not by another put; a BACKGROUND
    piece is paced by either."""
    clock = Clock()
    p = Pacer(0.5, clock=clock)
    with p.foreground(TRANSFER):
        with p.piece(TRANSFER):
            clock.t += 1.0
        assert p.resume_at(TRANSFER) == 0.0  # nothing above a put: no pause earned
        with p.piece(BACKGROUND):
            clock.t += 1.0
        assert p.resume_at(BACKGROUND) == pytest.approx(clock.t + 1.0)
    with p.foreground(COMPUTE):
        # Opening the step pauses the put's copies as their last piece (1 s at 50 %) would have.
        assert p.resume_at(TRANSFER) == pytest.approx(clock.t + 1.0)
        clock.t += 1.0
        with p.piece(TRANSFER):
            clock.t += 2.0
        assert p.resume_at(TRANSFER) == pytest.approx(clock.t + 2.0)
        t = threading.Thread(target=p.gate, args=(TRANSFER,), daemon=True)
        t.start()
        t.join(0.3)
        assert t.is_alive(), "a put's copies did not yield to the engine's step"
    t.join(5)
    assert not t.is_alive()


def test_unpaced_is_a_no_op() -> None:
    p = Pacer(1.0)
    fn = len
    assert p.urgent(fn) is fn
    with p.foreground(), p.piece():
        pass
    assert p.resume_at() == 0.0 and not p.enabled


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, float("nan"), "half", True])
def test_share_is_checked(bad) -> None:
    with pytest.raises(ValueError, match=r"io\.background_share"):
        IOConfig(background_share=bad)
    assert StoreConfig.from_dict({"io": {"background_share": 0.5}}).io.background_share == 0.5
    assert StoreConfig.load(env={"TIERKV_IO_BACKGROUND_SHARE": "0.75"}).io.background_share == 0.75


def paced_store(tmp_path, share: float = 0.25) -> TierKVStore:
    return TierKVStore(store_config(LAYOUT, 8, 64, tmp_path / "l3", io=IOConfig(background_share=share)), LAYOUT)


def chain(n: int, seed: int) -> tuple[list[bytes], list[torch.Tensor]]:
    keys = [key_of("pacing", seed, i) for i in range(n)]
    return keys, [block_for(k, LAYOUT) for k in keys]


def hold_pause(store: TierKVStore) -> Clock:
    """Freeze the store's pacer inside a pause that never ends by itself."""
    clock = Clock()
    store.pacer._clock = clock
    with store.pacer.foreground():
        store.pacer.charge(1.0)  # a 1 s background piece just ended: 3 s of pause at 25 %
    return clock


def test_store_persist_waits_for_the_foreground_and_an_l3_load_does_not(tmp_path) -> None:
    store = paced_store(tmp_path)
    try:
        keys, blocks = chain(4, seed=1)
        assert store.put_blocks(keys[:2], blocks[:2]) == [True, True]
        store.persist(keys[:2], Tier.L3)  # on disk now, before any pause
        assert store.put_blocks(keys[2:], blocks[2:]) == [True, True]
        hold_pause(store)
        with store.foreground():
            done = threading.Event()
            t = threading.Thread(target=lambda: (store.persist(keys, Tier.L3), done.set()), daemon=True)
            t.start()
            assert not done.wait(0.3), "a persist's writes ran inside the pause while the foreground ran"
            # An L3 hit loaded meanwhile: queued on the IO thread behind the paused persist, it is
            # urgent, so it ends the pause and lands while the foreground still runs.
            store.l2.remove(keys[:2])
            with store._lock:
                for k in keys[:2]:
                    store.index.drop(k, Tier.L2)
            m = store.lookup_keys(keys[:2])
            assert m.tiers == [Tier.L3, Tier.L3]
            dst = [torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype) for _ in range(2)]
            result = store.load(m, dst).wait(10)
            assert result.ok == [True, True]
            assert all(same_bytes(d, b) for d, b in zip(dst, blocks[:2]))
            store.release(m)
        assert done.wait(10), "the persist did not finish once the foreground ended"
        assert all(store.index.get(k).in_tier(Tier.L3) for k in keys)
    finally:
        store.close()


def test_unpaced_store_writes_during_foreground(tmp_path) -> None:
    store = paced_store(tmp_path, share=1.0)
    try:
        keys, blocks = chain(3, seed=2)
        assert store.put_blocks(keys, blocks) == [True] * 3
        with store.foreground():
            assert store.persist(keys, Tier.L3) == 3
    finally:
        store.close()
