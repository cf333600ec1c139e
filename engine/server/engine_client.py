"""The async side of the engine: prompts to token ids, requests into the EngineLoop, results back to asyncio.

``EngineClient`` is shared by every route. ``chat_ids`` renders messages
with the model's chat template and tokenizes them as transformers'
``apply_chat_template`` does; ``submit`` queues one request and returns a
``Generation`` whose items arrive on the caller's event loop (the loop thread
hands them over with ``call_soon_threadsafe``). ``Generation.cancel()`` aborts
the sequence at the engine's next step boundary: its L1 blocks are freed and
its pinned store blocks released.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from tierkv.engine.chat_template import ChatTemplate, ChatTemplateError, chat_token_ids, end_of_turn_ids
from tierkv.engine.sampler import SamplingParams
from tierkv.engine.sequence import Output
from tierkv.engine.server.errors import RequestError
from tierkv.engine.serving import EngineLoop, EngineStopped, PromptRejected, TokenDelta

log = logging.getLogger("tierkv.server")


class Generation:
    """One request in flight, read on the event loop that submitted it. Not thread-safe."""

    def __init__(self, loop: EngineLoop, prompt_ids: list[int], params: SamplingParams, namespace: str | None,
                 stream: bool, cache_salt: str | None = None) -> None:
        self._aloop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._engine = loop
        self.prompt_ids = prompt_ids
        self.done = False
        try:
            self._req = loop.submit(prompt_ids, params, namespace, stream, sink=self._deliver, cache_salt=cache_salt)
        except EngineStopped as exc:
            raise RequestError(503, str(exc), kind="server_error", code="shutting_down") from None

    def _deliver(self, item) -> None:  # on the engine-loop thread
        try:
            self._aloop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    async def next(self) -> TokenDelta | Output:
        """The next TokenDelta, or the final Output; RequestError for a refused prompt (400), a stopping
        server (503) or an engine error (500, logged)."""
        item = await self._queue.get()
        if isinstance(item, Output):
            self.done = True
            return item
        if isinstance(item, TokenDelta):
            return item
        self.done = True
        if isinstance(item, PromptRejected):
            raise RequestError(400, str(item), "prompt")
        if isinstance(item, EngineStopped):
            raise RequestError(503, str(item), kind="server_error", code="shutting_down")
        log.error("tierkv serve: the engine failed a request", exc_info=item)
        raise RequestError(500, f"internal error: {type(item).__name__}: {item}", kind="server_error")

    async def result(self) -> Output:
        while True:
            item = await self.next()
            if isinstance(item, Output):
                return item

    async def items(self) -> AsyncIterator[TokenDelta | Output]:
        while not self.done:
            yield await self.next()

    def cancel(self) -> None:
        """Abort the request unless it already finished; idempotent, safe from any thread."""
        if not self.done:
            self.done = True
            self._engine.cancel(self._req)


class EngineClient:
    """Prompt preparation and submission for the routes; holds no per-request state. Thread-safe."""

    def __init__(self, llm, loop: EngineLoop, model_dir: str | Path | None = None,
                 chat_template: ChatTemplate | None = None) -> None:
        self.llm = llm
        self.loop = loop
        self.template = chat_template
        tok = llm.tokenizer
        self.stop_ids: tuple[int, ...] = end_of_turn_ids(model_dir, tok.token_id) if model_dir is not None else ()

    def completion_ids(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        return self.llm.tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The conversation's prompt ids: the chat template's text, tokenized without added special tokens.
        RequestError (400) when the model has no template or the template refuses the messages."""
        if self.template is None:
            raise RequestError(400, "messages: this model has no chat template (no chat_template in its "
                                    "tokenizer_config.json or chat_template.jinja); start `tierkv serve` with "
                                    "--chat-template FILE, or use /v1/completions", "messages",
                               "chat_template_missing")
        try:
            return chat_token_ids(self.template, self.llm.tokenizer, messages, add_generation_prompt)
        except ChatTemplateError as exc:
            raise RequestError(400, f"messages: {exc}", "messages") from None
        except ValueError as exc:
            raise RequestError(400, str(exc), "messages") from None

    def check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """RequestError (400) when the prompt is empty, too long, or prompt + max_tokens could never fit in
        the engine's L1 pool."""
        llm, n = self.llm, len(prompt_ids)
        if n == 0:
            raise RequestError(400, "prompt: expected at least one token, got an empty prompt", "prompt")
        if n >= llm.max_model_len:
            raise RequestError(400, f"prompt: {n} tokens leave no room under max_model_len={llm.max_model_len}",
                               "prompt", "context_length_exceeded")
        need = -(-min(n + params.max_tokens, llm.max_model_len) // llm.config.block_size)
        if need > llm.config.num_blocks:
            raise RequestError(400, f"prompt of {n} tokens + max_tokens {params.max_tokens} need {need} KV blocks; "
                                    f"this server holds {llm.config.num_blocks} (lower max_tokens or shorten the "
                                    "prompt)", "max_tokens", "context_length_exceeded")

    def submit(self, prompt_ids: list[int], params: SamplingParams, namespace: str | None,
               stream: bool, cache_salt: str | None = None) -> Generation:
        """Queue the request (``cache_salt``: only requests with the same salt share cached KV); call on
        the event loop that will read the Generation."""
        return Generation(self.loop, prompt_ids, params, namespace, stream, cache_salt)

    def decode(self, ids: list[int]) -> str:
        return self.llm.tokenizer.decode(ids)
