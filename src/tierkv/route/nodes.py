"""The router's view of its nodes: health, cost figures, queue depth and an event-fed inventory each.

Each ``Node`` is polled (``GET /v1/kv/status``) every ``poll_s`` with a
``timeout_s`` bound: a node that does not answer in time is *down* and is
skipped; the first answer after that brings it back. A status names the
node's event endpoints and instance id; the node's ``KVEventSubscriber`` is
(re)made whenever those endpoints change (a restart may bind new ports), and
itself notices a new instance id on the stream and resyncs.

Threading: the asyncio loop of the proxy owns the Node fields; subscriber
threads write only their own inventories, which ``candidates`` reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from tierkv.cost import CostModel
from tierkv.kvevents import KVEventSubscriber
from tierkv.route.policy import Candidate
from tierkv.route.ttft import recompute_us

log = logging.getLogger("tierkv")


@dataclass
class Node:
    """One ``tierkv serve`` behind the router."""

    url: str
    up: bool = False
    instance_id: str = ""
    cost: CostModel | None = None
    external_depth: int = 0  # requests in the node's engine at the last poll that were not ours
    inflight: int = 0
    served: int = 0
    failures: int = 0
    last_ok: float = 0.0
    subscriber: KVEventSubscriber | None = None
    events: tuple[str, str] | None = None
    block_size: int = 16
    errors: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.url

    @property
    def queue_depth(self) -> int:
        """This router's requests in flight there plus the others its last status counted.

        The status is up to a poll old; counting our own requests from ``inflight``
        (exact, updated as each one ends) keeps a request that just finished from
        making the node look busy until the next poll.
        """
        return self.external_depth + self.inflight

    def match(self, keys: Sequence[bytes]) -> tuple[int, int, int, int]:
        """Leading tokens of a prompt with ``keys`` this node holds per tier, by its events."""
        out = [0, 0, 0, 0]
        if self.subscriber is not None:
            for tier in self.subscriber.inventory.match(keys):
                out[tier] += self.block_size
        return tuple(out)

    def candidate(self, keys: Sequence[bytes], n_tokens: int) -> Candidate:
        """This node as the routers see it. Queue delay: each queued request is taken to cost a full
        prefill of this prompt (the node's own cost figures), a deliberately simple estimate."""
        cost = self.cost or CostModel((0.0, 0.0, 0.0, 0.0), 1.0)
        matched = self.match(keys)
        if sum(matched) > n_tokens:
            matched = _clip(matched, n_tokens)
        depth = self.queue_depth
        return Candidate(self.url, matched, depth, depth * recompute_us(cost, 0, n_tokens), cost)

    def to_json(self) -> dict:
        sub = self.subscriber
        return {"url": self.url, "up": self.up, "instance_id": self.instance_id, "queue_depth": self.queue_depth,
                "inflight": self.inflight, "served": self.served, "failures": self.failures,
                "events": None if sub is None else {
                    "synced": sub.synced, "last_seq": sub.last_seq, "blocks": len(sub.inventory),
                    "per_tier": list(sub.inventory.counts), "gaps": sub.gaps, "resyncs": sub.resyncs,
                    "restarts": sub.restarts}}


def _clip(matched: tuple[int, ...], n_tokens: int) -> tuple[int, int, int, int]:
    out, left = [], n_tokens
    for m in matched:
        out.append(min(m, left))
        left -= out[-1]
    return tuple(out)


class NodePool:
    """Polls the nodes and keeps their subscribers; hands the live ones to the proxy."""

    def __init__(self, urls: Sequence[str], timeout_s: float = 1.0, poll_s: float = 0.5) -> None:
        if not urls:
            raise ValueError("route.nodes: expected at least one --node URL")
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"route.nodes: expected http(s)://host:port URLs, got {bad!r}")
        if not timeout_s > 0 or not poll_s > 0:
            raise ValueError(f"route: timeout and poll interval must be > 0 s, got {timeout_s!r}, {poll_s!r}")
        self.nodes = [Node(u.rstrip("/")) for u in urls]
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.client = httpx.AsyncClient(timeout=timeout_s)
        self._task: asyncio.Task | None = None

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.up]

    def down(self) -> list[Node]:
        """Nodes marked down, the most recently seen up first (the last resort of a request)."""
        return sorted((n for n in self.nodes if not n.up), key=lambda n: -n.last_ok)

    def mark_down(self, node: Node, why: str) -> None:
        if node.up:
            log.warning("tierkv route: %s is down (%s)", node.url, why)
        node.up = False
        node.failures += 1

    async def poll(self, node: Node) -> None:
        """One status request; marks the node up (and refreshes it) or down."""
        try:
            r = await self.client.get(f"{node.url}/v1/kv/status")
            r.raise_for_status()
            body = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            self.mark_down(node, type(exc).__name__)
            return
        c = body["cost"]
        node.cost = CostModel(tuple(c["load_us_per_token"]), c["recompute_us_per_token"], c["growth"],
                              c["block_size"], c["block_bytes"])
        node.block_size = int(body["block_size"])
        node.external_depth = max(0, int(body["queue_depth"]) - node.inflight)
        node.instance_id = body.get("instance_id", "")
        events = body.get("events")
        if events is not None:
            where = (events["endpoint"], events["replay_endpoint"])
            if where != node.events:
                if node.subscriber is not None:
                    await asyncio.to_thread(node.subscriber.close)
                node.subscriber = KVEventSubscriber(*where, replay_timeout_s=self.timeout_s).start()
                node.events = where
        if not node.up:
            log.warning("tierkv route: %s is up (instance %s)", node.url, node.instance_id)
        node.up, node.last_ok = True, time.monotonic()

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(n) for n in self.nodes))

    async def run(self) -> None:
        """Poll every node every ``poll_s`` until cancelled."""
        while True:
            await self.poll_all()
            await asyncio.sleep(self.poll_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for node in self.nodes:
            if node.subscriber is not None:
                await asyncio.to_thread(node.subscriber.close)
        await self.client.aclose()
