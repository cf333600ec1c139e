"""EngineServer: the FastAPI app, its ASGI guard (body limit, request counts) and uvicorn around one LLM.

Threads: uvicorn runs the app on one asyncio event loop (its own thread with
``start()``, the caller's with ``serve_forever()``); one ``EngineLoop``
thread owns the LLM and batches every request in flight. Routes render and
tokenize prompts in the thread pool, submit them, and await their tokens.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierkv.engine.chat_template import ChatTemplate
from tierkv.engine.server import errors
from tierkv.engine.server.engine_client import EngineClient
from tierkv.engine.server.errors import RequestError
from tierkv.engine.server.metrics import ServerMetrics
from tierkv.engine.server.routes import router
from tierkv.engine.serving import EngineLoop

_DRAIN_LIMIT = 16 << 20  # an oversized body is read and dropped up to this, so the client reads our 413


@dataclass(frozen=True)
class ServerConfig:
    """Limits of the HTTP front end."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "tierkv"
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 4096
    keep_alive_s: float = 5.0

    def __post_init__(self) -> None:
        for name, lo, hi in (("port", 0, 65535), ("max_body_bytes", 1, None), ("max_tokens_limit", 1, None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
                bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise ValueError(f"server.{name}: expected an integer {bound}, got {value!r}")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"server.model_name: expected a non-empty string, got {self.model_name!r}")
        if isinstance(self.keep_alive_s, bool) or not isinstance(self.keep_alive_s, (int, float)) \
                or not self.keep_alive_s > 0:
            raise ValueError(f"server.keep_alive_s: expected a number of seconds > 0, got {self.keep_alive_s!r}")


class Guard:
    """ASGI middleware: counts every request by route name and status, and reads the whole body (up to
    ``max_body_bytes``; 413 above) before the app sees it, so no route can read an unbounded body."""

    def __init__(self, app: ASGIApp, server: EngineServer) -> None:
        self.app = app
        self.server = server


    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = self.server.endpoints.get(scope["path"], "other")
        metrics = self.server.metrics

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":  # before the reply: a client that reads it then /metrics sees it
                metrics.count_request(endpoint, message["status"])
            await send(message)

        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, counted)
            return
        # The API takes JSON whatever the Content-Type says (`curl -d` sends form encoding).
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                 + [(b"content-type", b"application/json")]}
        limit = self.server.config.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        body, more = bytearray(), True
        if declared is not None and int(declared) > limit:  # h11 already refused a non-integer length
            await self._too_large(int(declared), limit, receive, scope, counted)
            return
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                await self._too_large(len(body), limit, receive if more else None, scope, counted)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # later calls wait for the client's disconnect

        await self.app(scope, replay, counted)

    @staticmethod
    async def _too_large(size: int, limit: int, receive: Receive | None, scope: Scope, send: Send) -> None:
        read = 0
        while receive is not None and read < _DRAIN_LIMIT:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            read += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        err = RequestError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes (--max-body)",
                           code="request_too_large")
        await JSONResponse(err.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)


class EngineServer:
    """Serves one LLM over HTTP. ``start()`` runs it on a background thread; ``serve_forever()`` in the caller's.

    The socket is bound in the constructor (OSError if the port is taken), so
    ``url`` is known before serving. The engine loop thread starts with the
    server and owns the LLM until ``shutdown()`` (or the end of
    ``serve_forever``); ``engine_lock`` is held by that thread around each
    step, so whoever holds it sees the engine between steps.
    ``on_request(prompt_ids, output, namespace)`` is called on the loop thread,
    under ``engine_lock``, after each finished request (e.g. to persist its
    blocks). ``model_dir`` gives the chat template and end-of-turn tokens
    (``chat_template`` overrides the template). ``routers``: more APIRouters
    to mount (their routes see this server as ``request.app.state.server``).
    The LLM stays open at shutdown: the caller owns it.
    """

    def __init__(self, llm, config: ServerConfig = ServerConfig(),
                 on_request: Callable[[list[int], Any, str | None], None] | None = None,
                 model_dir: str | Path | None = None, chat_template: ChatTemplate | None = None,
                 routers: Iterable[APIRouter] = (), drain_s: float = 30.0) -> None:
        self.llm = llm
        self.config = config
        self.on_request = on_request
        self.drain_s = drain_s
        self.started = time.time()
        self.metrics = ServerMetrics()
        if chat_template is None and model_dir is not None:
            chat_template = ChatTemplate.from_model_dir(model_dir)
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        self.sock = socket.create_server((config.host, config.port), family=family)
        self.engine_lock = threading.Lock()
        self.loop = EngineLoop(llm, self._finished, self.engine_lock)
        self.client = EngineClient(llm, self.loop, model_dir, chat_template)
        self.app = FastAPI(title="tierkv", docs_url=None, redoc_url=None)
        self.app.state.server = self
        errors.install(self.app)
        routers = [router, *routers]
        for r in routers:
            self.app.include_router(r)
        self.endpoints = {route.path: route.name for r in routers for route in r.routes}  # metric labels
        self.app.add_middleware(Guard, server=self)
        self._uvicorn = uvicorn.Server(uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off", http="h11",
            timeout_keep_alive=int(max(1, config.keep_alive_s)), timeout_graceful_shutdown=int(drain_s)))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()[:2]

    def start(self) -> EngineServer:
        """Serve on a background thread; returns once the server accepts connections."""
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self.sock]},
                                        name="tierkv-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("tierkv serve: the HTTP server did not start")
            time.sleep(0.01)
        return self

    def serve_forever(self) -> None:
        """Serve until SIGINT/SIGTERM; requests in flight get up to ``drain_s`` to finish, then the engine
        loop stops. uvicorn re-raises the signal afterwards (the caller's handler runs then)."""
        try:
            self._uvicorn.run(sockets=[self.sock])
        finally:
            self.loop.stop(self.drain_s)
            self.sock.close()

    def shutdown(self) -> None:
        """Stop accepting requests, let those in flight finish (up to ``drain_s``), stop the engine loop."""
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()
        self.loop.stop(self.drain_s)
        self.sock.close()

    def stats(self) -> dict:
        """Requests by (endpoint, status), tokens served, and the engine's batching; thread-safe."""
        return {**self.metrics.snapshot(), "batch": self.loop.batch_stats()}

    def metrics_text(self) -> bytes:
        """The store's ``tierkv_*`` families and the server's (requests, tokens, batching, pinned blocks)."""
        self.llm.store.stats()  # refreshes the usage gauges
        return self.llm.store.metrics.exposition() + self.metrics.exposition(self.loop.batch_stats(),
                                                                             self.loop.gauges())

    def _finished(self, out, namespace: str | None) -> None:  # on the loop thread, under engine_lock
        self.metrics.count_tokens(len(out.prompt_token_ids), len(out.token_ids), sum(out.hit_tokens.values()))
        if self.on_request is not None:
            self.on_request(out.prompt_token_ids, out, namespace)
