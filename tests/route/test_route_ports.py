"""`tierkv route --port 0` binds a port of the kernel's choosing and prints it; the helpers read it back.

Real processes: two routers on port 0 get two ports and serve on them; a third asked for a port in use
exits with one line naming --port; ``start_server`` fails within its timeout, naming the process, when a
server exits or never prints its address; a port kept by ``hold_port`` (a node's, while it restarts)
refuses connections and plain binds, and a router started on it takes it.
"""

from __future__ import annotations

import errno
import socket
import subprocess
import sys

import httpx
import pytest

from route_helpers import hold_port, start_server


def route(port: int | str) -> list[str]:
    # Nothing listens on port 9 (discard) here: the router starts with its node down.
    return [sys.executable, "-m", "tierkv.cli", "route", "--node", "http://127.0.0.1:9", "--port", str(port),
            "--timeout", "0.2", "--poll", "0.2"]


def test_port_0_binds_a_free_port_and_prints_it_and_a_port_in_use_is_one_line(tmp_path):
    procs = []
    try:
        for name in ("r1", "r2"):
            procs.append(start_server(name, route(0), tmp_path / f"{name}.log", health="/v1/route/status",
                                      timeout=120))
        (_, p1), (_, p2) = procs
        assert p1 != p2 and 0 < p1 < 65536 and 0 < p2 < 65536
        for port in (p1, p2):
            status = httpx.get(f"http://127.0.0.1:{port}/v1/route/status", timeout=5).json()
            assert [n["url"] for n in status["nodes"]] == ["http://127.0.0.1:9"]
        taken = subprocess.run(route(p1), capture_output=True, text=True, timeout=120)
        assert taken.returncode == 1
        assert taken.stderr.startswith(f"error: --port: cannot listen on 127.0.0.1:{p1}: Address already in use")
        assert taken.stdout == ""  # no address printed for a port it does not hold
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            proc.wait(timeout=30)


def test_start_server_names_a_server_that_exits_before_printing_its_port(tmp_path):
    with pytest.raises(AssertionError) as err:
        start_server("router-x", route(0) + ["--policy", "nope"], tmp_path / "x.log", timeout=120)
    msg = str(err.value)
    assert msg.startswith("router-x (") and "exited with 2 before printing http://HOST:PORT" in msg
    assert "--policy: expected one of" in msg  # its stderr, from the log


def test_a_held_port_refuses_connections_and_plain_binds_but_its_restarted_server_takes_it(tmp_path):
    holder = hold_port(0)
    port = holder.getsockname()[1]
    proc = None
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        proc, got = start_server("router-held", route(port), tmp_path / "held.log", health="/v1/route/status",
                                 timeout=120)
        assert got == port
    finally:
        holder.close()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


def test_start_server_gives_up_on_a_server_that_never_prints_its_port(tmp_path):
    cmd = [sys.executable, "-c", "import time; print('starting', flush=True); time.sleep(120)"]
    with pytest.raises(AssertionError) as err:
        start_server("sleeper", cmd, tmp_path / "s.log", timeout=2)
    msg = str(err.value)
    assert msg.startswith("sleeper (") and "printed no http://HOST:PORT line (the port it bound) within 2 s" in msg
    assert "stdout: 'starting\\n'" in msg
