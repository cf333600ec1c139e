"""One real ``vllm.LLM`` with tierkv's connector, stepped by hand in one process, its scheduler watched.

``python step_driver.py SPEC_JSON`` (started by ``StepDriver``): the spec of ``e2e_driver.py``
(model, connector extra config, LLM keyword arguments). vLLM runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor): EngineCore, its Scheduler and
the worker, and both halves of the connector (sharing one store), live in this process, so
each engine step can be watched between ``schedule()`` and ``update_from_output()``. Commands,
one JSON line each, answered with one ``@@RESULT`` line as ``e2e_driver.py`` does:

- ``{"op": "run", "prompts": [[ids]...], "max_tokens": [n...], "abort": i}``: add every prompt
  (greedy, EOS ignored), then ``LLMEngine.step()`` until none is unfinished. Per request ``ids``
  and ``cached`` (``num_cached_tokens``); per step, requests named by their index in ``prompts``:
  ``remote`` (in WAITING_FOR_REMOTE_KVS once scheduled), ``loads`` (``[i, start, blocks,
  is_async]`` of the connector metadata), ``saves`` (``[i, blocks]``), ``preempted``,
  ``scheduled`` (tokens), and from the worker's connector output ``recving`` (finished loads,
  from ``get_finished``), ``invalid`` (block ids that failed to load). Once every output is in,
  it steps on while vLLM's scheduler still holds finished requests (blocks whose save or load
  runs), as EngineCore's own loop does. With ``abort``, request
  ``i`` is aborted (``LLMEngine.abort_request``, vLLM's own abort) in the first step whose
  schedule puts it in WAITING_FOR_REMOTE_KVS, right after that schedule: its load is promised
  and pinned, the worker has not started it yet, and it ends after the abort. ``at_abort``:
  the store blocks pinned then;
- ``{"op": "state"}``: what must be back to rest when nothing runs: store blocks still pinned
  (after the write-through copies land), the worker's loads in flight, landing slots out,
  requests either connector half or vLLM's scheduler still holds, vLLM blocks not free;
- ``{"op": "stored", "prompt": [ids]}``: how many leading full blocks of the prompt the store
  holds (its chain as the connector keys a request without salt or LoRA), once copies land;
- ``reset``, ``metrics``, ``exit``: as in ``e2e_driver.py``.
"""

from __future__ import annotations

import gc
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from _e2e import ENV, Driver


class StepDriver(Driver):
    """``_e2e.Driver`` running this file instead of ``e2e_driver.py`` (the same protocol)."""

    def __init__(self, spec: dict, log_path: Path, wait: bool = True) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self._results: queue.Queue = queue.Queue()
        env = {**os.environ, **ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        spec = {**spec, "llm": {**spec["llm"], "distributed_executor_backend": "uni"}}
        self.proc = subprocess.Popen([sys.executable, __file__, json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if wait:
            self.wait_ready()


class Watch:
    """Records each step of ``llm``'s in-process scheduler (the wrapped methods only observe)."""

    def __init__(self, llm) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.engine = llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        self.worker = get_kv_transfer_group()._worker
        self.store = self.worker.store
        self.index: dict[str, int] = {}  # vLLM's internal request id -> index in the run's prompts
        self.steps: list[dict] = []
        self.abort: tuple[int, str] | None = None
        self.at_abort: int | None = None
        schedule, update = self.scheduler.schedule, self.scheduler.update_from_output

        def watched_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self._scheduled(out)
            return out

        def watched_update(scheduler_output, model_output, *args, **kwargs):
            self._output(model_output.kv_connector_output if model_output is not None else None)
            return update(scheduler_output, model_output, *args, **kwargs)

        self.scheduler.schedule, self.scheduler.update_from_output = watched_schedule, watched_update

    def _ids(self, req_ids) -> list[int]:
        return sorted(self.index[r] for r in req_ids or () if r in self.index)

    def _scheduled(self, so) -> None:
        from vllm.v1.request import RequestStatus

        meta = so.kv_connector_metadata
        remote = [r for r, req in self.scheduler.requests.items() if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        self.steps.append({
            "remote": self._ids(remote),
            "loads": [[self.index[ld.req_id], ld.start, len(ld.block_ids), ld.is_async]
                      for ld in meta.loads if ld.req_id in self.index],
            "saves": [[self.index[s.req_id], len(s.block_ids)] for s in meta.saves if s.req_id in self.index],
            "preempted": self._ids(so.preempted_req_ids),
            "scheduled": {str(self.index[r]): n for r, n in so.num_scheduled_tokens.items() if r in self.index},
        })
        if self.abort is not None and self.abort[1] in remote:
            (i, req_id), self.abort = self.abort, None
            self.at_abort = self.pinned()
            self.engine.abort_request([req_id], internal=True)
            self.steps[-1]["aborted"] = i

    def _output(self, out) -> None:
        step = self.steps[-1] if self.steps else {}
        step["recving"] = self._ids(getattr(out, "finished_recving", None))
        step["invalid"] = len(getattr(out, "invalid_block_ids", None) or ())

    def pinned(self) -> int:
        """Store blocks pinned now (by either half's match); under the store's lock, as its IO threads
        change the index."""
        with self.store._lock:
            return sum(1 for e in self.store.index.entries() if e.ref_count)

    def run(self, cmd: dict) -> dict:
        from vllm import SamplingParams

        self.steps, self.index, self.at_abort = [], {}, None
        ids = []
        for i, (p, n) in enumerate(zip(cmd["prompts"], cmd["max_tokens"])):
            sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            ids.append(self.engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp))
            self.index[ids[-1]] = i
        if cmd.get("abort") is not None:
            self.abort = (cmd["abort"], ids[cmd["abort"]])
        outs: dict[int, dict] = {}
        while self.engine.has_unfinished_requests():
            for o in self.engine.step():
                if o.finished:
                    outs[int(o.request_id[1:])] = {"ids": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens}
        self._drain()
        return {"outputs": [outs.get(i) for i in range(len(ids))], "steps": self.steps, "at_abort": self.at_abort}

    def _drain(self, timeout: float = 60.0) -> None:
        """Step on while vLLM still holds finished requests (their blocks wait for a save, or an aborted
        one's for its load), as EngineCore's busy loop does in its own process; gives up after ``timeout``
        s, leaving them for ``state`` to show."""
        deadline = time.monotonic() + timeout
        while self.scheduler.has_requests() and time.monotonic() < deadline:
            self.engine.step()
            time.sleep(0.005)

    def stored(self, cmd: dict) -> int:
        self.store.flush()
        return self.store.lookup_keys(self.store.hash(cmd["prompt"]), pin=False).num_blocks

    def state(self) -> dict:
        self.store.flush()
        pool = self.scheduler.kv_cache_manager.block_pool
        return {"pinned": self.pinned(), "worker_loads": len(self.worker._async),
                "landing_out": self.worker.landing.slots.capacity - self.worker.landing.num_free,
                "connector_requests": len(self.scheduler.connector._scheduler._requests),
                "vllm_requests": len(self.scheduler.requests),
                "blocks_not_free": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()}


def main() -> None:
    spec = json.loads(sys.argv[1])
    from e2e_driver import _metrics, _reset
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    xfer = KVTransferConfig(kv_connector="TierKVConnector", kv_connector_module_path="tierkv.connectors.vllm",
                            kv_role="kv_both", kv_connector_extra_config=spec["connector"])
    llm = LLM(model=spec["model"], kv_transfer_config=xfer, **spec["llm"])
    watch = Watch(llm)
    ops = {"run": watch.run, "state": lambda cmd: watch.state(), "stored": watch.stored,
           "reset": lambda cmd: _reset(llm, SamplingParams), "metrics": lambda cmd: _metrics(llm)}
    print("@@READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            del watch, llm
            gc.collect()
            print("@@RESULT " + json.dumps({"ok": True}), flush=True)
            return
        print("@@RESULT " + json.dumps(ops[cmd["op"]](cmd)), flush=True)


if __name__ == "__main__":
    main()
