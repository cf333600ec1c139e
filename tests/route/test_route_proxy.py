"""`tierkv route` over two model-free store nodes (tests/route/store_node.py): real processes, HTTP and ZMQ.

Turn 2 goes to the node holding turn 1's prefix and is served from its cache; a SIGKILLed node costs no
request; restarted on its port (a new instance, new event ports) it is resynced and used again.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from route_helpers import hold_port, start_server, status, until

openai = pytest.importorskip("openai")
HERE = Path(__file__).resolve().parent
WORDS = " ".join(f"word{i}" for i in range(120))  # 120 tokens: 15 blocks of 8


class Nodes:
    """The two store nodes and the router; each binds a port of its own choosing (port 0) and reports it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ports: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.held: dict[str, socket.socket] = {}

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def start(self, name: str) -> None:
        """Start ``name`` on a free port, or on its old one if it ran before (the router knows it by URL)."""
        port = str(self.ports.get(name, 0))
        if name == "router":
            cmd = [sys.executable, "-m", "tierkv.cli", "route", "--node", self.url("a"), "--node", self.url("b"),
                   "--port", port, "--timeout", "1", "--poll", "0.1"]
        else:
            cmd = [sys.executable, str(HERE / "store_node.py"), port, str(self.tmp / name)]
        self.procs[name], self.ports[name] = start_server(name, cmd, self.tmp / f"{name}.log", env=dict(os.environ),
                                                          timeout=120)
        if name in self.held:
            self.held.pop(name).close()

    def kill(self, name: str) -> None:
        """SIGKILL ``name``; its port stays reserved (refusing connections) for its restart."""
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(timeout=30)
        self.held[name] = hold_port(self.ports[name])

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for s in self.held.values():
            s.close()


@pytest.fixture
def nodes(tmp_path):
    n = Nodes(tmp_path)
    try:
        yield n
    finally:
        n.close()


def chat(client, messages):
    raw = client.chat.completions.with_raw_response.create(model="words", messages=messages, max_tokens=4)
    return raw.headers["x-tierkv-node"], raw.parse()


def test_prefix_affinity_failover_and_restart(nodes):
    for name in ("a", "b", "router"):
        nodes.start(name)
    router = nodes.url("router")
    until("both nodes up and synced", lambda: all(n["up"] and n["events"] and n["events"]["synced"]
                                                  for n in status(router).values()))
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="none", max_retries=0, timeout=60)
    convo = [{"role": "system", "content": WORDS}, {"role": "user", "content": "first question"}]
    first, r1 = chat(client, convo)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    full = r1.usage.prompt_tokens // 8
    until("turn 1's blocks in the router's index", lambda: status(router)[first]["events"]["blocks"] >= full)
    convo += [{"role": "assistant", "content": r1.choices[0].message.content},
              {"role": "user", "content": "second question"}]
    second, r2 = chat(client, convo)
    assert second == first
    assert r2.usage.prompt_tokens_details.cached_tokens >= (full - 1) * 8

    victim = "a" if first == nodes.url("a") else "b"
    other = nodes.url("b" if victim == "a" else "a")
    old = status(router)[first]["instance_id"]
    nodes.kill(victim)
    # At once, before a status poll could notice: the router learns from the refused connection.
    for i in range(3):
        node, r = chat(client, convo + [{"role": "user", "content": f"retry {i}"}])
        assert node == other
    assert not status(router)[first]["up"]

    nodes.start(victim)
    until("the restarted node up with a new instance and synced",
          lambda: (lambda n: n["up"] and n["instance_id"] not in ("", old) and n["events"]["synced"])(
              status(router)[first]))
    until("the router's view of the restarted node equals its own inventory",
          lambda: status(router)[first]["events"]["blocks"]
          == httpx.get(f"{first}/v1/kv/status", timeout=5).json()["inventory_blocks"] > 0)
    fresh = [[{"role": "user", "content": f"{w} " * 40}] for w in ("zebra", "quartz", "mango", "violet")]
    with ThreadPoolExecutor(4) as pool:
        served = [node for node, _ in pool.map(lambda m: chat(client, m), fresh)]
    assert set(served) == {nodes.url("a"), nodes.url("b")}
