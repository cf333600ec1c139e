"""The serving loop: one thread owns the LLM and batches every in-flight HTTP request.

Callers ``submit`` a request and read what the loop delivers to it (its
``Request.outputs`` queue, or the ``sink`` callback they passed, e.g. one that
hands items to an asyncio loop); the loop thread drains its inbox between
steps (new sequences go to the scheduler, cancelled ones are aborted), runs
``LLM.step()``, and delivers each request's progress: a streaming request
gets a ``TokenDelta`` per step that gave it tokens (ids only: decoding is the
receiver's job, off the engine thread), every request gets its final
``Output`` (the one with a ``finish_reason``).
An exception from the engine fails the requests in flight (their queues get
the exception, their blocks go back to the store) and the loop serves the
next ones.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tierkv.engine.sampler import SamplingParams
from tierkv.engine.sequence import Output, Sequence


class PromptRejected(ValueError):
    """The engine refused the prompt before scheduling it (too long, ids outside the vocabulary)."""


class EngineStopped(RuntimeError):
    """The loop is stopping (server shutdown) or has stopped: the request was not run."""


@dataclass(frozen=True)
class TokenDelta:
    """Tokens a streaming request got since its previous delivery; the first delivery also says how many
    prompt tokens each tier served and the time to first token (later ones: None)."""

    token_ids: list[int]
    hit_tokens: dict[str, int] | None = None
    ttft_s: float | None = None


@dataclass(eq=False)
class Request:
    """One submitted request. It receives TokenDeltas (streaming), then its final Output or, at most once,
    an exception: into ``outputs``, or through ``sink(item)`` when one is given (called on the loop thread;
    it must not block). Written by the loop thread, read by the submitter."""

    prompt: Any
    params: SamplingParams
    namespace: str | None
    stream: bool
    sink: Callable[[Any], None] | None = None
    cache_salt: str | None = None
    outputs: queue.Queue = field(default_factory=queue.Queue)
    seq: Sequence | None = None
    sent: int = 0
    cancelled: bool = False

    def put(self, item) -> None:
        if self.sink is not None:
            self.sink(item)
        else:
            self.outputs.put(item)


@dataclass
class BatchStats:
    """Sequences that got a token per engine step, over the steps that produced any token."""

    steps: int = 0
    sequences: int = 0
    max_batch: int = 0
    aborted: int = 0  # requests cancelled by their client before they finished

    def add(self, n: int) -> None:
        self.steps += 1
        self.sequences += n
        self.max_batch = max(self.max_batch, n)

    @property
    def avg_batch(self) -> float:
        return self.sequences / self.steps if self.steps else 0.0


class EngineLoop:
    """Runs ``llm`` on its own thread with continuous batching across requests.

    ``submit`` and ``cancel`` are thread-safe; everything else touching the
    LLM happens on the loop thread, under ``lock`` (held for each step and
    each ``on_finish`` call, so a holder of ``lock`` sees the engine between
    steps). ``on_finish(output, namespace)`` runs on the loop thread after each
    request that finished normally.
    """

    def __init__(self, llm, on_finish: Callable[[Output, str | None], None] | None = None,
                 lock: threading.Lock | None = None) -> None:
        self.llm = llm
        self.on_finish = on_finish
        self.lock = lock or threading.Lock()
        self._batch = BatchStats()
        self._stats_lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self._active: list[Request] = []
        self._stopping = threading.Event()
        self._deadline_passed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierkv-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def batch_stats(self) -> dict:
        """Steps run, sequences per step (largest, average), requests aborted by their client; thread-safe."""
        with self._stats_lock:
            s = self._batch
            return {"steps": s.steps, "max_batch": s.max_batch, "avg_batch": s.avg_batch, "aborted": s.aborted}

    def submit(self, prompt, params: SamplingParams, namespace: str | None, stream: bool,
               sink: Callable[[Any], None] | None = None, cache_salt: str | None = None) -> Request:
        """Queue a request for the next step; thread-safe. EngineStopped once ``stop`` was called."""
        if self._stopping.is_set():
            raise EngineStopped("the server is shutting down")
        req = Request(prompt, params, namespace, stream, sink, cache_salt)
        self._inbox.put(req)
        return req

    def next_output(self, req: Request):
        """The next item of ``req.outputs`` (a TokenDelta, an Output or an exception); EngineStopped if the
        loop ended without answering. Called by the submitting thread (for requests without a sink)."""
        while True:
            try:
                return req.outputs.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive() and req.outputs.empty():
                    return EngineStopped("the server stopped before this request finished")

    def gauges(self) -> dict:
        """Requests in the engine now and what they hold: ``sequences`` (admitted, not finished),
        ``pinned_blocks`` (index entries with a reference; 0 when idle), ``free_l1_blocks``. Takes ``lock``
        (waits for the current step); call from any thread but the loop's."""
        with self.lock:
            store = self.llm.store
            pinned = sum(1 for e in store.index.entries() if e.ref_count)
            return {"sequences": len(self._active), "pinned_blocks": pinned, "free_l1_blocks": store.l1.num_free}

    def cancel(self, req: Request) -> None:
        """Abort ``req`` (its client went away); its blocks go back to the store. Thread-safe, idempotent."""
        req.cancelled = True
        self._inbox.put(req)

    def stop(self, drain_s: float = 30.0) -> None:
        """Refuse new requests, let those in flight finish for up to ``drain_s`` seconds, fail the rest
        with EngineStopped, and join the loop thread. Call from any thread but the loop's."""
        self._stopping.set()
        self._inbox.put(None)  # wakes an idle loop
        self._thread.join(drain_s)
        if self._thread.is_alive():
            self._deadline_passed.set()
            self._inbox.put(None)
            self._thread.join()

    # -- the loop thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._take_inbox(block=not self._active)
                if self._stopping.is_set() and (not self._active or self._deadline_passed.is_set()):
                    break
                if self._active:
                    self._step()
        finally:  # normal stop, or a bug in this loop: no submitter may wait forever
            self._stopping.set()
            self._deadline_passed.set()
            self._take_inbox(block=False)  # requests that raced with stop get EngineStopped
            with self.lock:
                self._fail(self._active, EngineStopped("the server stopped before this request finished"))

    def _take_inbox(self, block: bool) -> None:
        while True:
            try:
                req = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if req is None:
                continue
            if req.cancelled:
                self._abort(req)
            elif self._stopping.is_set() and self._deadline_passed.is_set():
                req.put(EngineStopped("the server is shutting down"))
            else:
                self._admit(req)

    def _admit(self, req: Request) -> None:
        try:
            req.seq = self.llm._sequence(req.prompt, req.params, req.namespace, req.cache_salt)
        except ValueError as exc:
            req.put(PromptRejected(str(exc)))
            return
        except Exception as exc:
            req.put(exc)
            return
        with self.lock:
            self.llm.scheduler.add(req.seq)
        self._active.append(req)

    def _abort(self, req: Request) -> None:
        if req in self._active:
            with self.lock:
                self.llm.scheduler.abort(req.seq)
            self._active.remove(req)
            with self._stats_lock:
                self._batch.aborted += 1

    def _step(self) -> None:
        with self.lock:
            try:
                stepped = self.llm.step()
            except Exception as exc:
                self._fail(self._active, exc)
                return
            if stepped:
                with self._stats_lock:
                    self._batch.add(len(stepped))
            self._publish()

    def _publish(self) -> None:
        """Push new tokens (streaming) and final Outputs; finished requests leave the active list."""
        llm, still = self.llm, []
        for req in self._active:
            seq = req.seq
            if seq.is_finished:
                out = llm._output(seq)
                if self.on_finish is not None:
                    try:
                        self.on_finish(out, req.namespace)
                    except Exception as exc:
                        req.put(exc)
                        continue
                req.put(out)
            else:
                n = len(seq.output_ids)
                if req.stream and n > req.sent:
                    first = req.sent == 0
                    req.put(TokenDelta(seq.token_ids[seq.num_prompt_tokens + req.sent:],
                                       dict(seq.hit_tokens) if first else None,
                                       seq.first_token_at - seq.arrival if first else None))
                    req.sent = n
                still.append(req)
        self._active = still

    def _fail(self, reqs: list[Request], exc: BaseException) -> None:
        """Fail ``reqs`` with ``exc`` and give every admitted block back (the scheduler may be mid-step)."""
        self.llm.scheduler.abort_all()
        for req in reqs:
            req.put(exc)
        self._active = []
