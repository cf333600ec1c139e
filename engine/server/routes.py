"""The HTTP routes: OpenAI's /v1/completions, /v1/chat/completions, /v1/models; /tokenize; /v1/kv/why;
/health; /metrics.

Every route reads the shared state from ``request.app.state.server`` (an
``EngineServer``: its ``client``, ``config``, ``metrics``); ``state(request)``
is the one accessor. A new route is a function on ``router`` (or on an
``APIRouter`` of its own passed to ``EngineServer(routers=...)``) with a
pydantic body model; raise ``RequestError`` to refuse.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from tierkv.engine.sequence import Output
from tierkv.engine.server import protocol
from tierkv.engine.server.errors import RequestError
from tierkv.engine.server.metrics import CONTENT_TYPE
from tierkv.engine.server.protocol import ChatRequest, CompletionRequest, TokenizeRequest, WhyRequest
from tierkv.engine.server.streaming import DONE, EventStream, IncrementalDecoder, StopStrings, sse, until_disconnect
from tierkv.engine.serving import TokenDelta
from tierkv.why import summary

router = APIRouter()


def state(request: Request):
    """The EngineServer serving this request."""
    return request.app.state.server


def _check_model(server, model: str | None) -> None:
    if model is not None and model != server.config.model_name:
        raise RequestError(404, f"model: {model!r} is not served here; try {server.config.model_name!r}",
                           "model", "model_not_found")


@router.get("/health")
async def health(request: Request) -> dict:
    if not state(request).loop.running:
        raise RequestError(503, "the engine loop has stopped", kind="server_error", code="engine_stopped")
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    server = state(request)
    return {"object": "list", "data": [{"id": server.config.model_name, "object": "model",
                                        "created": int(server.started), "owned_by": "tierkv",
                                        "max_model_len": server.llm.max_model_len}]}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(await run_in_threadpool(state(request).metrics_text), media_type=CONTENT_TYPE)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    """The prompt token ids a completion (``prompt``) or chat (``messages``) request would run on."""
    server = state(request)
    _check_model(server, body.model)
    client = server.client
    if (body.prompt is None) == (body.messages is None):
        raise RequestError(400, "prompt, messages: give exactly one of them", "prompt")
    if body.messages is not None:
        if body.add_special_tokens:
            raise RequestError(400, "add_special_tokens: the chat template writes the special tokens; "
                                    "leave it unset or false with messages", "add_special_tokens")
        msgs = [m.as_dict() for m in body.messages]
        ids = await run_in_threadpool(client.chat_ids, msgs, body.add_generation_prompt)
    else:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await run_in_threadpool(client.completion_ids, body.prompt, add)
    return {"count": len(ids), "max_model_len": server.llm.max_model_len, "tokens": ids}


@router.post("/v1/kv/why")
async def kv_why(body: WhyRequest, request: Request) -> dict:
    """Per block of the prompt: the tier holding its KV, or why none does (``tierkv.why``)."""
    server = state(request)
    _check_model(server, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError(400, "prompt, messages: give exactly one of them", "prompt")
    if body.cache_salt is not None and not body.cache_salt:
        raise RequestError(400, "cache_salt: expected a non-empty string", "cache_salt")
    client = server.client
    if body.messages is not None:
        ids = await run_in_threadpool(client.chat_ids, [m.as_dict() for m in body.messages], body.add_generation_prompt)
    else:
        ids = await run_in_threadpool(client.completion_ids, body.prompt)
    blocks = await run_in_threadpool(server.llm.why, ids, body.namespace, body.cache_salt)
    store = server.llm.store
    return {"identity": store.identity.digest, "block_size": store.block_size, "prompt_tokens": len(ids),
            "summary": summary(blocks), "blocks": [b.to_dict() for b in blocks]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    server = state(request)
    _check_model(server, body.model)
    body.check_supported()
    params = body.sampling_params(server.config.max_tokens_limit, server.client.stop_ids)
    ids = await run_in_threadpool(server.client.completion_ids, body.prompt_value())
    return await _generate(request, body, ids, params, chat=False)


@router.post("/v1/chat/completions", name="chat")
async def chat_completions(body: ChatRequest, request: Request):
    server = state(request)
    _check_model(server, body.model)
    body.check_supported()
    params = body.sampling_params(server.config.max_tokens_limit, server.client.stop_ids, body.max_tokens_asked())
    msgs = [m.as_dict() for m in body.messages]
    ids = await run_in_threadpool(server.client.chat_ids, msgs, body.add_generation_prompt)
    return await _generate(request, body, ids, params, chat=True)


async def _generate(request: Request, body, ids: list[int], params, chat: bool):
    server = state(request)
    client = server.client
    client.check_fits(ids, params)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    model = server.config.model_name
    stops = body.stop_strings()
    gen = client.submit(ids, params, body.namespace, stream=body.stream or bool(stops), cache_salt=body.cache_salt)
    if not body.stream:
        if not stops:
            out = await until_disconnect(request, gen.result(), gen.cancel)
            return JSONResponse(protocol.response(rid, model, out, out.text, chat))
        text, out = await until_disconnect(request, _collect(_pieces(server, gen, await gen.next(), stops)),
                                           gen.cancel)
        return JSONResponse(protocol.response(rid, model, out, text, chat))
    first = await until_disconnect(request, gen.next(), gen.cancel)  # a refused prompt is a 400, not a 200
    return EventStream(_events(_pieces(server, gen, first, stops), rid, model, chat, body.include_usage), gen.cancel)


async def _pieces(server, gen, first, stops: list[str]) -> AsyncIterator[tuple[str, Output | None]]:
    """The answer as text pieces: ``(text, None)`` per step that completed some text, then ``(text, Output)``
    once. Cut at the first of ``stops`` (the request is then cancelled and the Output made here)."""
    decoder = IncrementalDecoder(server.client.decode)
    cut = StopStrings(stops) if stops else None
    ids: list[int] = []
    hits, ttft = {}, None
    item = first
    while True:
        final = None
        if isinstance(item, TokenDelta):
            ids += item.token_ids
            if item.hit_tokens is not None:
                hits, ttft = item.hit_tokens, item.ttft_s
            text = decoder.push(item.token_ids)
        else:
            final = item
            text = decoder.push(final.token_ids[len(ids):]) + decoder.finish(final.text)
            ids = list(final.token_ids)
        if cut is not None:
            text = cut.feed(text, final is not None)
            if cut.stopped:
                gen.cancel()
                final = Output(-1, list(gen.prompt_ids), ids, cut.text, "stop",
                               final.ttft_s if final else ttft, final.hit_tokens if final else hits)
        if text or final is not None:
            yield text, final
        if final is not None:
            return
        item = await gen.next()


async def _collect(pieces: AsyncIterator[tuple[str, Output | None]]) -> tuple[str, Output]:
    texts = []
    async for text, final in pieces:
        texts.append(text)
        if final is not None:
            return "".join(texts), final
    raise RuntimeError("the answer ended without a final output")


async def _events(pieces, rid: str, model: str, chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    if chat:
        yield sse(protocol.chunk(rid, model, created, chat, None, None, role=True))
    try:
        async for text, out in pieces:
            yield sse(protocol.chunk(rid, model, created, chat, text, out.finish_reason if out else None))
            if out is not None and include_usage:
                yield sse(protocol.usage_chunk(rid, model, created, chat, out))
    except RequestError as exc:  # after the 200: the error goes in the stream, as vLLM sends it
        yield sse(exc.body())
    except Exception as exc:
        yield sse(RequestError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").body())
    yield DONE
