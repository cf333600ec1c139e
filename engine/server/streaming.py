"""Server-sent events for ``"stream": true``, and what a client that leaves does to its request.

``IncrementalDecoder`` turns token deltas into text deltas without decoding
the whole answer each step, holding back a split UTF-8 character; its pieces
always add up to the non-streaming text. ``StopStrings`` cuts them at the
first stop string. ``EventStream`` is a streaming
response that watches for the client's disconnect while it sends: when the
client goes away (or the send fails) the body is cancelled at once and
``on_close`` runs, which aborts the engine request so its blocks are freed
without waiting for the next token. ``until_disconnect`` does the same for a
non-streaming request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tierkv.engine.server.errors import RequestError


class IncrementalDecoder:
    """Text deltas from token deltas. ``decode(ids) -> str`` is the tokenizer's; not thread-safe."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._start = 0    # first id of the window decoded for context
        self._read = 0     # ids before this have been turned into text already
        self.text = ""     # everything emitted so far

    def push(self, ids: list[int]) -> str:
        """Add ``ids``; the new text they complete ("" while a character is still split)."""
        self._ids.extend(ids)
        before = self._decode(self._ids[self._start:self._read])
        after = self._decode(self._ids[self._start:])
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return ""
        delta = after[len(before):]
        self._start, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the answer decoded whole) not sent yet."""
        if final_text.startswith(self.text):
            delta = final_text[len(self.text):]
        else:  # a tokenizer whose pieces do not concatenate: send what matches, then the rest
            delta = ""
        self.text += delta
        return delta


class StopStrings:
    """Cuts generated text at the first of ``stops`` (the stop string itself is not sent, as OpenAI does),
    holding back a tail that could be the start of one. Not thread-safe."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max(len(s) for s in stops) - 1
        self.text = ""      # all text fed, up to the stop string once found
        self.sent = 0       # characters of ``text`` returned so far
        self.stopped = False

    def feed(self, delta: str, final: bool) -> str:
        """Add ``delta``; the text that is now safe to send (everything, when ``final``)."""
        self.text += delta
        found = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if found:
            self.stopped, self.text = True, self.text[:min(found)]
            end = len(self.text)
        else:
            end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """``text/event-stream`` over ``events``; the client's disconnect cancels the body and calls ``on_close``
    (also called when the stream ends normally; it must be idempotent)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def body() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the socket went away under a send
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(body)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


async def until_disconnect(request: Request, work: Awaitable, on_disconnect: Callable[[], None]):
    """Await ``work``; if the client disconnects first, call ``on_disconnect`` and answer 499 (nobody reads it)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    on_disconnect()
    raise RequestError(499, "the client closed the connection", code="client_closed")
