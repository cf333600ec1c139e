"""An OpenAI-compatible HTTP server for the engine (`tierkv serve`): FastAPI on uvicorn.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (both
with ``"stream": true`` as server-sent events and ``stream_options``),
``GET /v1/models``, ``POST /tokenize`` (the prompt ids a request would run
on), ``GET /metrics`` (Prometheus) and ``GET /health``. Chat is rendered with
the model's own chat template and stops at its end-of-turn tokens;
``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens served
from any tierkv tier. Every malformed, oversized or unsupported request gets
a 4xx with an OpenAI-style JSON error body before it reaches the engine.

Files: ``app`` (EngineServer, ServerConfig, the ASGI guard), ``routes``,
``protocol`` (request models, response JSON), ``streaming`` (SSE,
disconnects), ``engine_client`` (prompts in, tokens out), ``metrics``,
``errors``.
"""

from tierkv.engine.server.app import EngineServer, ServerConfig
from tierkv.engine.server.errors import RequestError

__all__ = ["EngineServer", "RequestError", "ServerConfig"]
