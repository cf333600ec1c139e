"""``tierkv route``: an OpenAI-compatible proxy that sends each request to the node that will answer first.

Per request (``POST /v1/completions`` or ``/v1/chat/completions``):

1. the prompt's block keys: one live node's ``POST /v1/kv/match`` tokenizes
   and hashes it exactly as a completion would (nodes serve one model, so any
   node's keys are every node's keys); a node that fails or does not answer
   within the timeout is marked down and the next is asked;
2. a ``Candidate`` per live node from the global prefix index (each node's
   event-fed inventory), its queue depth and cost figures;
3. the router policy (``cost_model`` by default) picks; the request is
   forwarded as is, streamed or not, with ``x-tierkv-node`` naming the node;
4. a node that refuses the connection, drops it before answering or answers
   503 is marked down and the request goes to the next pick, so a dead node
   costs a request at most one failed connection, never a failure. When no
   live node is left, nodes marked down are tried too (most recently seen
   first): a node that was only slow still serves rather than the request failing.

``GET /v1/models`` is forwarded to a live node; ``GET /health`` is ok while a
node is up; ``GET /v1/route/status`` shows each node's state.
"""

from __future__ import annotations

import contextlib
import itertools
import logging

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tierkv.route.nodes import Node, NodePool
from tierkv.route.policy import Prompt, make_router

log = logging.getLogger("tierkv")

_FAILOVER = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
             httpx.WriteError, httpx.PoolTimeout)
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                        status_code=status)


class RouteProxy:
    """The proxy app over a ``NodePool``. Runs on one asyncio loop; not shared across loops."""

    def __init__(self, pool: NodePool, policy: str = "cost_model", request_timeout_s: float = 600.0,
                 **policy_options) -> None:
        self.pool = pool
        self.router = make_router(policy, **policy_options)
        self.policy = policy
        self.request_timeout = httpx.Timeout(request_timeout_s, connect=pool.timeout_s)
        self.client = httpx.AsyncClient(timeout=self.request_timeout)
        self._hasher = itertools.count()
        self.picks: dict[str, int] = {}
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/route/status", self.status, methods=["GET"]),
        ], lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        await self.pool.poll_all()
        self.pool.start()
        try:
            yield
        finally:
            await self.pool.close()
            await self.client.aclose()

    # -- routes -----------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._route(request, "/v1/completions", chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._route(request, "/v1/chat/completions", chat=True)

    async def models(self, request: Request) -> Response:
        for node in self.pool.live():
            try:
                r = await self.pool.client.get(f"{node.url}/v1/models")
                return Response(r.content, r.status_code, media_type="application/json")
            except httpx.HTTPError as exc:
                self.pool.mark_down(node, type(exc).__name__)
        return _error(503, "route: no node is up", "no_node")

    async def health(self, request: Request) -> Response:
        live = self.pool.live()
        return JSONResponse({"status": "ok" if live else "down", "nodes_up": len(live)},
                            status_code=200 if live else 503)

    async def status(self, request: Request) -> Response:
        return JSONResponse({"policy": self.policy, "picks": self.picks,
                             "nodes": [n.to_json() for n in self.pool.nodes]})

    # -- routing ------------------------------------------------------------------

    async def _keys(self, body: dict, chat: bool) -> tuple[list[bytes], int] | None:
        """The prompt's block keys and token count, from the first live node that answers in time."""
        ask = {"namespace": body.get("namespace")}
        if chat:
            ask.update(messages=body.get("messages"), add_generation_prompt=body.get("add_generation_prompt", True))
        else:
            ask["prompt"] = body.get("prompt")
        live = self.pool.live()
        start = next(self._hasher)
        order = [live[(start + i) % len(live)] for i in range(len(live))] + self.pool.down()
        for node in order:
            try:
                r = await self.pool.client.post(f"{node.url}/v1/kv/match", json=ask)
            except httpx.HTTPError as exc:
                self.pool.mark_down(node, f"match: {type(exc).__name__}")
                continue
            if r.status_code != 200:
                return None  # the node refuses this prompt: let the completion route say why
            m = r.json()
            return [bytes.fromhex(k) for k in m["keys"]], int(m["prompt_tokens"])
        return None

    async def _route(self, request: Request, path: str, chat: bool) -> Response:
        raw = await request.body()
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "body: expected a JSON object", "type": "invalid_request_error",
                                           "param": None, "code": None}}, status_code=400)
        found = await self._keys(body, chat)
        keys, n_tokens = found if found is not None else ([], 0)
        tried: set[str] = set()
        while True:
            live = [n for n in self.pool.live() if n.url not in tried]
            if not live:  # last resort: a node marked down may only have been slow
                live = [n for n in self.pool.down() if n.url not in tried]
            if not live:
                return _error(503, "route: no node could serve this request", "no_node")
            cands = [n.candidate(keys, n_tokens) for n in live]
            node = live[self.router.pick(Prompt(n_tokens, keys), cands)]
            tried.add(node.url)
            response = await self._send(node, path, raw, request.headers.get("content-type", "application/json"),
                                        bool(body.get("stream")))
            if response is not None:
                self.picks[node.url] = self.picks.get(node.url, 0) + 1
                return response

    async def _send(self, node: Node, path: str, raw: bytes, content_type: str, stream: bool) -> Response | None:
        """Forward to ``node``; None when it failed before answering (it is then marked down)."""
        req = self.client.build_request("POST", f"{node.url}{path}", content=raw,
                                        headers={"content-type": content_type})
        node.inflight += 1
        try:
            r = await self.client.send(req, stream=True)
        except _FAILOVER as exc:
            node.inflight -= 1
            self.pool.mark_down(node, f"{path}: {type(exc).__name__}")
            return None
        if r.status_code == 503:
            await r.aclose()
            node.inflight -= 1
            self.pool.mark_down(node, f"{path}: 503")
            return None
        headers = {k: v for k, v in r.headers.items() if k.lower() not in _HOP_HEADERS}
        headers["x-tierkv-node"] = node.url
        node.served += 1

        async def done() -> None:
            await r.aclose()
            node.inflight -= 1

        if stream:
            return StreamingResponse(r.aiter_raw(), r.status_code, headers=headers, background=BackgroundTask(done))
        try:
            content = await r.aread()
        except _FAILOVER as exc:
            await done()
            self.pool.mark_down(node, f"{path}: {type(exc).__name__}")
            return None
        await done()
        return Response(content, r.status_code, headers=headers)
