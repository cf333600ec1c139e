"""Helpers for the router tests that start real processes: servers that report their port, the router's status.

A server is started with ``--port 0`` (or ``PORT`` 0 for store_node.py): it binds a port the kernel picks
and prints its address, and ``start_server`` reads the port from that line. No port is picked here and
bound later by another process, so nothing else on the machine can take it in between. A node restarted
on its old port (the router knows it by URL) gets it through ``hold_port``.
"""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx

ADDRESS = re.compile(r"http://(?:\[[^\]]*\]|[^\s:/]+):(\d+)")


class _Stdout:
    """Drains a process's stdout on a thread (it never blocks writing) and finds the port in its first address."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.port: int | None = None
        self.done = threading.Event()  # the port was printed, or stdout closed (the process exited)
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line)
            if self.port is None and (m := ADDRESS.search(line)):
                self.port = int(m.group(1))
                self.done.set()
        self.done.set()


def _tail(log: Path, n: int = 2000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else ""


def start_server(name: str, cmd: list[str], log: Path, env: dict | None = None, timeout: float = 240,
                 health: str = "/health") -> tuple[subprocess.Popen, int]:
    """Start ``cmd``, a server that prints ``http://HOST:PORT`` once it has bound its port; return the process
    and that port once ``health`` answers 200. Its stderr goes to ``log``. Fails within ``timeout`` seconds
    with an error naming ``name``, its command and what it printed, if it exits or never says or serves."""
    deadline = time.monotonic() + timeout
    with open(log, "a") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True,
                                env=env)
    out = _Stdout(proc)

    def fail(why: str) -> None:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        raise AssertionError(f"{name} ({' '.join(cmd)}) {why}; stdout: {''.join(out.lines)[-1000:]!r}; "
                             f"stderr ({log}): {_tail(log)}")

    if not out.done.wait(max(0.0, deadline - time.monotonic())):
        fail(f"printed no http://HOST:PORT line (the port it bound) within {timeout:g} s")
    if out.port is None:
        fail(f"exited with {proc.wait(timeout=30)} before printing http://HOST:PORT")
    url = f"http://127.0.0.1:{out.port}{health}"
    while True:
        if proc.poll() is not None:
            fail(f"exited with {proc.returncode} after printing port {out.port}, before {health} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return proc, out.port
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            fail(f"bound port {out.port} but {url} did not answer 200 within {timeout:g} s")
        time.sleep(0.2)


def hold_port(port: int) -> socket.socket:
    """Bind ``port`` (SO_REUSEADDR, not listening) so the kernel hands it to no other process while its server
    is down: a bind to port 0 or an outgoing connection skips a bound port. Connections to it are still
    refused, as to a dead server, and the restarted server (which binds with SO_REUSEADDR and listens) can
    take it; close the holder once it has. Call it right after the old server has exited."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    return s


def status(router: str) -> dict:
    return {n["url"]: n for n in httpx.get(f"{router}/v1/route/status", timeout=5).json()["nodes"]}


def until(what, check, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
