"""Decides what runs each step: continuous batching, chunked prefill, admission, preemption.

One step spends a token budget (``max_num_batched_tokens``) over at most
``max_num_seqs`` sequences. Running sequences go first, in admission order:
a decoding sequence takes one token, a prefilling one takes what is left of
the budget (chunked) or waits until its whole remaining prompt fits. Then
waiting sequences are admitted while L1 has room; one whose prefix sits in a
lower tier waits in LOADING while the others run. When a running sequence
cannot get a new block, the most recently admitted running sequence is
preempted: its blocks go back to the store (its saved blocks stay cached, so
its recompute mostly hits) and it rejoins the front of the queue.

Runs on the engine thread only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tierkv.engine.config import EngineConfig
from tierkv.engine.kv_cache import KVCacheManager
from tierkv.engine.sequence import Sequence, SeqState


@dataclass(frozen=True, slots=True)
class Scheduled:
    """``num_tokens`` new tokens of ``seq`` to compute this step, from ``seq.num_computed`` on."""

    seq: Sequence
    num_tokens: int


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, eos: tuple[int, ...]) -> None:
        self.config = config
        self.kv = kv
        self.eos = eos
        self.waiting: deque[Sequence] = deque()
        self.loading: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.loading or self.running)

    def schedule(self) -> list[Scheduled]:
        """This step's batch (possibly empty while every admitted sequence is still loading)."""
        for seq in list(self.loading):
            if self.kv.poll_load(seq):
                self.loading.remove(seq)
                self.running.append(seq)
            elif seq.state is SeqState.WAITING:
                self.loading.remove(seq)
                self.waiting.appendleft(seq)
        budget = self.config.max_num_batched_tokens
        batch: list[Scheduled] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget, bool(batch))
            if n == 0:
                i += 1
                continue
            while not self.kv.ensure_slots(seq, seq.num_computed + n):
                if len(self.running) == 1 and not self.loading:
                    self._out_of_room(seq)  # alone and still no room: L1 cannot hold it
                    break
                preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.state is not SeqState.RUNNING:
                break
            batch.append(Scheduled(seq, n))
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit(batch, budget)
        return batch

    def _admit(self, batch: list[Scheduled], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.kv.admit(seq):
                break
            self.waiting.popleft()
            if seq.state is SeqState.LOADING:
                self.loading.append(seq)
                continue
            self.running.append(seq)
            n = self._chunk(seq, budget, bool(batch))
            if n:
                batch.append(Scheduled(seq, n))
                budget -= n
        return budget

    def _chunk(self, seq: Sequence, budget: int, others: bool) -> int:
        left = seq.num_tokens - seq.num_computed
        if left <= budget or self.config.chunked_prefill:
            return min(left, budget)
        # Unchunked: a prompt that does not fit waits, unless it would run alone.
        return 0 if others else left

    def _out_of_room(self, seq: Sequence) -> None:
        """End a sequence that outgrew the whole L1 pool with what it has ("length")."""
        self.running.remove(seq)
        self.kv.release(seq)
        seq.state, seq.finish_reason = SeqState.FINISHED, "length"

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        seq.state = SeqState.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish_step(self, batch: list[Scheduled], tokens: list[int | None]) -> list[Sequence]:
        """Advance each scheduled sequence, save its full blocks, append sampled tokens.

        Returns the sequences that got a token; finished ones have released their blocks.
        """
        out = []
        for item, token in zip(batch, tokens):
            seq = item.seq
            seq.num_computed += item.num_tokens
            self.kv.commit(seq)
            if token is None:
                continue
            seq.append(token, self.eos)
            out.append(seq)
            if seq.finish_reason is not None:
                seq.state = SeqState.FINISHED
                self.running.remove(seq)
                self.kv.finished(seq)
                self.kv.release(seq)
        return out

    def abort(self, seq: Sequence) -> None:
        """Drop one request wherever it is (a client went away); its blocks go back to the store."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        for queue in (self.loading, self.running):
            if seq in queue:
                queue.remove(seq)
                self.kv.release(seq)
        seq.state, seq.finish_reason = SeqState.FINISHED, seq.finish_reason or "abort"

    def abort_all(self) -> None:
        """Release every admitted sequence (engine shutdown or an error mid-step)."""
        for seq in self.loading + self.running:
            self.kv.release(seq)
        self.loading, self.running = [], []
        self.waiting.clear()
