"""`tierkv route` in front of two real `tierkv serve` nodes (SmolLM2), driven by the official openai client.

Real processes, real HTTP and ZMQ: the second turn of a conversation goes to the node that holds its
prefix and is served from cache; a node killed with SIGKILL costs no request; restarted (a new
instance id, new event ports) it is resynced and used again.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from route_helpers import hold_port, start_server, status, until

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

SYSTEM = ("You are a terse assistant for a hardware store. Answer in one short sentence. "
          "The store sells hammers, nails, screws, saws, drills, paint, brushes, ladders, rope, tape, glue, "
          "light bulbs, batteries, extension cords, wrenches, pliers, screwdrivers and garden hoses. ") * 3


class Fleet:
    """Two `tierkv serve` nodes and a router; each binds a port of its own choosing (--port 0) and prints it."""

    def __init__(self, tmp: Path, model: Path) -> None:
        self.tmp, self.model = tmp, model
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.held: dict[str, socket.socket] = {}
        self.env = {**os.environ, "TIERKV_L3_CAPACITY": "64MiB", "TIERKV_L2_CAPACITY": "32MiB"}

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def start_node(self, name: str) -> None:
        """Start node ``name`` on a free port, or on its old one if it ran before (the router knows it by URL)."""
        cmd = [sys.executable, "-m", "tierkv.cli", "serve", "--model", str(self.model), "--port",
               str(self.ports.get(name, 0)), "--num-blocks", "256", "--threads", "1",
               "--cache-dir", str(self.tmp / name), "--kv-events", "tcp://127.0.0.1:0"]
        self.procs[name], self.ports[name] = start_server(name, cmd, self.tmp / f"{name}.log", env=self.env)
        if name in self.held:
            self.held.pop(name).close()

    def kill_node(self, name: str) -> None:
        """SIGKILL node ``name``; its port stays reserved (refusing connections) for its restart."""
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(timeout=30)
        self.held[name] = hold_port(self.ports[name])

    def start_router(self, timeout: float = 5.0) -> str:
        cmd = [sys.executable, "-m", "tierkv.cli", "route", "--node", self.url("a"), "--node", self.url("b"),
               "--port", "0", "--timeout", str(timeout), "--poll", "0.3"]
        self.procs["router"], self.ports["router"] = start_server("router", cmd, self.tmp / "router.log",
                                                                  env=self.env)
        return self.url("router")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for s in self.held.values():
            s.close()


@pytest.fixture
def fleet(tmp_path):
    from tierkv.models import pull

    f = Fleet(tmp_path, pull("smollm2-135m-instruct"))
    try:
        yield f
    finally:
        f.close()


def chat(client, messages):
    raw = client.chat.completions.with_raw_response.create(model=client.served, messages=messages,
                                                           max_tokens=8, temperature=0)
    return raw.headers["x-tierkv-node"], raw.parse()


def test_turn_two_follows_its_prefix_and_a_killed_node_costs_no_request(fleet):
    fleet.start_node("a")
    fleet.start_node("b")
    router = fleet.start_router()
    until("both nodes up and synced", lambda: all(n["up"] and n["events"] and n["events"]["synced"]
                                                  for n in status(router).values()))
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="none", max_retries=0, timeout=300)
    client.served = client.models.list().data[0].id

    convo = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you sell rope?"}]
    first, r1 = chat(client, convo)
    assert r1.usage.prompt_tokens > 64
    # The node's save reaches the router as events: its inventory holds the prompt's blocks.
    until("turn 1's blocks in the router's index",
          lambda: status(router)[first]["events"]["blocks"] >= r1.usage.prompt_tokens // 16)
    convo += [{"role": "assistant", "content": r1.choices[0].message.content},
              {"role": "user", "content": "And glue?"}]
    second, r2 = chat(client, convo)
    assert second == first
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens // 16 * 16 - 16
    # Streamed through the router, from the same node and its cache.
    raw = client.chat.completions.with_raw_response.create(model=client.served, messages=convo, max_tokens=8,
                                                           temperature=0, stream=True,
                                                           stream_options={"include_usage": True})
    chunks = list(raw.parse())
    assert raw.headers["x-tierkv-node"] == first
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r2.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= r2.usage.prompt_tokens // 16 * 16 - 16

    # SIGKILL the node holding the conversation: every request still succeeds, on the other node.
    other = next(u for u in (fleet.url("a"), fleet.url("b")) if u != first)
    victim = "a" if first == fleet.url("a") else "b"
    old_instance = status(router)[first]["instance_id"]
    fleet.kill_node(victim)
    convo += [{"role": "assistant", "content": r2.choices[0].message.content},
              {"role": "user", "content": "What about paint?"}]
    for _ in range(3):
        node, r = chat(client, convo)
        assert node == other and r.choices[0].message.content is not None
    assert not status(router)[first]["up"]

    # Restarted: a new instance, resynced (the router's view of it equals its own), and used again.
    fleet.start_node(victim)
    until("the restarted node up and synced", lambda: (lambda n: n["up"] and n["instance_id"] != old_instance
                                                      and n["events"]["synced"])(status(router)[first]))
    own = httpx.get(f"{first}/v1/kv/status", timeout=5).json()
    assert own["instance_id"] != old_instance
    until("the router's inventory of the restarted node equals the node's own",
          lambda: status(router)[first]["events"]["blocks"]
          == httpx.get(f"{first}/v1/kv/status", timeout=5).json()["inventory_blocks"])
    # Four new conversations at once (no shared block): the queue term spreads them over both nodes.
    fresh = [[{"role": "system", "content": f"{word} store, branch {i}. " * 8}, {"role": "user", "content": "Hours?"}]
             for i, word in enumerate(("Zebra", "Quartz", "Mango", "Violet"))]
    with ThreadPoolExecutor(4) as pool:
        served = [node for node, _ in pool.map(lambda m: chat(client, m), fresh)]
    assert set(served) == {fleet.url("a"), fleet.url("b")}
