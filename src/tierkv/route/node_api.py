"""The routing side of a ``tierkv serve`` node: ``POST /v1/kv/match`` and ``GET /v1/kv/status``.

``kv_routes(publisher)`` is an ``APIRouter`` for ``EngineServer(routers=...)``;
its routes read the server from ``request.app.state.server`` (its ``client``
tokenizes exactly as the completion routes do, ``llm.store`` is the store,
``loop.gauges()["sequences"]`` the requests in the engine):

- ``POST /v1/kv/match`` with ``prompt`` (text or token ids) or chat
  ``messages`` (+ ``namespace``): ``match_tiers`` of those tokens — matched
  and loaded tokens per tier, estimated load / recompute / TTFT µs, block keys
  — plus ``queue_depth`` and the node's ``instance_id``.
- ``GET /v1/kv/status``: what a router needs to follow and price the node —
  event endpoints, instance id and last sequence number, the cost model's
  per-token figures, ``queue_depth``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr
from starlette.concurrency import run_in_threadpool

from tierkv.kvevents import KVEventPublisher, PublisherConfig
from tierkv.route.match import match_tiers


class MatchRequest(BaseModel):
    """A prompt as /v1/completions (``prompt``) or /v1/chat/completions (``messages``) would get it."""

    model_config = ConfigDict(extra="ignore")  # a router forwards whole request bodies

    prompt: StrictStr | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    namespace: StrictStr | None = None
    add_generation_prompt: StrictBool = True


def queue_depth(server) -> int:
    """Requests admitted to the node's engine and not finished."""
    return int(server.loop.gauges()["sequences"])


def status(server, publisher: KVEventPublisher | None) -> dict:
    store = server.llm.store
    cost = store.cost
    out = {"queue_depth": queue_depth(server), "block_size": store.block_size,
           "cost": {"load_us_per_token": list(cost.load_us), "recompute_us_per_token": cost.recompute_us,
                    "growth": cost.growth, "block_size": cost.block_size, "block_bytes": cost.block_bytes}}
    if publisher is not None:
        out.update(instance_id=publisher.instance_id, last_seq=publisher.last_seq,
                   inventory_blocks=len(publisher.inventory),
                   events={"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint,
                           "topic": publisher.topic.decode()})
    return out


def serve_kv(store, endpoint: str | None) -> tuple[APIRouter, KVEventPublisher | None]:
    """For ``tierkv serve``: the routes, and a publisher of ``store``'s events bound at ``endpoint``.

    ``endpoint`` is ``tcp://HOST:PORT`` (PUB at PORT, replay at PORT + 1; port 0
    picks two free ports) or None / ``"off"`` for no events. The caller closes
    the publisher after the store stops changing.
    """
    publisher = None
    if endpoint not in (None, "off"):
        base, _, port = endpoint.rpartition(":")
        if not base.startswith("tcp://") or not port.isdigit():
            raise ValueError(f"--kv-events: expected tcp://HOST:PORT or off, got {endpoint!r}")
        replay = f"{base}:{int(port) + 1 if int(port) else 0}"
        publisher = KVEventPublisher(PublisherConfig(endpoint=endpoint, replay_endpoint=replay,
                                                     block_size=store.block_size))
        publisher.attach(store)
    return kv_routes(publisher), publisher


def kv_routes(publisher: KVEventPublisher | None = None) -> APIRouter:
    """The node's routing endpoints; ``publisher`` is the store's event publisher (None: no events)."""
    router = APIRouter()

    @router.get("/v1/kv/status")
    async def kv_status(request: Request) -> dict:
        return status(request.app.state.server, publisher)

    @router.post("/v1/kv/match")
    async def kv_match(body: MatchRequest, request: Request) -> dict:
        server = request.app.state.server
        if (body.prompt is None) == (body.messages is None):
            raise HTTPException(400, "prompt, messages: give exactly one of them")
        if body.messages is not None:
            ids = await run_in_threadpool(server.client.chat_ids, body.messages, body.add_generation_prompt)
        else:
            ids = await run_in_threadpool(server.client.completion_ids, body.prompt)
        m = await run_in_threadpool(match_tiers, server.llm.store, ids, body.namespace)
        out = m.to_json()
        out["queue_depth"] = queue_depth(server)
        if publisher is not None:
            out["instance_id"] = publisher.instance_id
        return out

    return router
