"""An OpenAI-compatible HTTP server for the engine (`tierkv serve`), on the standard library.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``"stream": true`` as server-sent events), ``GET /v1/models``, ``GET /metrics``
(Prometheus: the store's ``tierkv_*`` counters plus request counters) and
``GET /health``. Every malformed, oversized or unsupported request gets a 4xx
with an OpenAI-style JSON error body; a request never reaches the engine
before it has been fully validated.

Threading: ``ThreadingHTTPServer`` reads and validates requests on one thread
each and hands them to an ``EngineLoop`` (``serving.py``): one thread owns the
LLM and batches every request in flight, step by step; handler threads wait
on their request's queue. A client that goes away mid-stream aborts its own
sequence only. An engine error fails the requests in flight with a 500 and the
server keeps serving. Socket reads time out after ``read_timeout_s``, so a
stalled client never pins a thread forever.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tierkv.engine.sampler import SamplingParams
from tierkv.engine.serving import EngineLoop, EngineStopped, PromptRejected


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ServerConfig:
    """Limits of the HTTP front end."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "tierkv"
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 4096
    read_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name, lo, hi in (("port", 0, 65535), ("max_body_bytes", 1, None), ("max_tokens_limit", 1, None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
                bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise ValueError(f"server.{name}: expected an integer {bound}, got {value!r}")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"server.model_name: expected a non-empty string, got {self.model_name!r}")
        if isinstance(self.read_timeout_s, bool) or not isinstance(self.read_timeout_s, (int, float)) \
                or not self.read_timeout_s > 0:
            raise ValueError(f"server.read_timeout_s: expected a number of seconds > 0, got {self.read_timeout_s!r}")


# -- request validation -------------------------------------------------------------


def _opt(body: dict, name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise RequestError(400, f"{name}: expected {names}, got {type(value).__name__}", name)
    return value


def sampling_params(body: dict, limit: int) -> SamplingParams:
    """SamplingParams from an OpenAI request body; RequestError (400) naming the bad field."""
    max_tokens = _opt(body, "max_completion_tokens", (int,), None)
    max_tokens = _opt(body, "max_tokens", (int,), 16 if max_tokens is None else max_tokens)
    if not 1 <= max_tokens <= limit:
        raise RequestError(400, f"max_tokens: expected an integer in [1, {limit}], got {max_tokens}", "max_tokens")
    temperature = float(_opt(body, "temperature", (int, float), 1.0))
    top_p = float(_opt(body, "top_p", (int, float), 1.0))
    top_k = _opt(body, "top_k", (int,), 0)
    seed = _opt(body, "seed", (int,), None)
    n = _opt(body, "n", (int,), 1)
    if n != 1:
        raise RequestError(400, f"n: only 1 is supported, got {n}", "n")
    if not 0 <= temperature <= 2:
        raise RequestError(400, f"temperature: expected a number in [0, 2], got {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise RequestError(400, f"top_p: expected a number in (0, 1], got {top_p}", "top_p")
    if top_k < 0:
        raise RequestError(400, f"top_k: expected an integer >= 0, got {top_k}", "top_k")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


def completion_prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise RequestError(400, "prompt: expected a non-empty string or list of token ids (one prompt per request)",
                       "prompt")


def chat_prompt(body: dict) -> str:
    """The chat messages rendered with a plain role-tagged template (demo models carry no chat template)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: expected a non-empty list of {role, content} objects", "messages")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool", "developer"):
            raise RequestError(400, f"messages[{i}].role: expected one of system, user, assistant, tool, developer",
                               f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise RequestError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            content = "".join(texts)
        if not isinstance(content, str):
            raise RequestError(400, f"messages[{i}].content: expected a string", f"messages[{i}].content")
        parts.append(f"<|{m['role']}|>\n{content}\n")
    return "".join(parts) + "<|assistant|>\n"


# -- the server ---------------------------------------------------------------------


class EngineServer:
    """Serves one LLM over HTTP. ``start()`` runs it on a background thread; ``serve_forever()`` in the caller's.

    The engine loop thread starts with the server and owns the LLM until
    ``shutdown()`` (or the end of ``serve_forever``). ``engine_lock`` is held
    by that thread around each step, so whoever holds it sees the engine
    between steps. ``on_request(prompt_ids, output, namespace)`` is called on
    the loop thread, under ``engine_lock``, after each finished request, e.g.
    to record namespaces and hits.
    """

    def __init__(self, llm, config: ServerConfig = ServerConfig(),
                 on_request: Callable[[list[int], Any, str | None], None] | None = None,
                 drain_s: float = 30.0) -> None:
        self.llm = llm
        self.config = config
        self.on_request = on_request
        self.drain_s = drain_s
        self.engine_lock = threading.Lock()
        self.counts: Counter = Counter()       # (endpoint, status) -> requests
        self.tokens: Counter = Counter()       # "prompt" / "completion" -> tokens
        self.stats_lock = threading.Lock()
        self.started = time.time()
        handler = type("Handler", (_Handler,), {"app": self, "timeout": config.read_timeout_s})
        self.httpd = ThreadingHTTPServer((config.host, config.port), handler)
        self.httpd.daemon_threads = True
        self.loop = EngineLoop(llm, self._finished, self.engine_lock)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> EngineServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="tierkv-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve until interrupted; then requests in flight get up to ``drain_s`` to finish."""
        try:
            self.httpd.serve_forever()
        finally:
            self.loop.stop(self.drain_s)

    def shutdown(self) -> None:
        """Stop accepting requests, close the socket and stop the engine loop (requests in flight get up to
        ``drain_s`` to finish). The LLM stays open: the caller owns it."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.loop.stop(self.drain_s)

    def count(self, endpoint: str, status: int) -> None:
        with self.stats_lock:
            self.counts[(endpoint, status)] += 1

    def stats(self) -> dict:
        """Requests by (endpoint, status), tokens served, and the engine's batching; thread-safe."""
        with self.stats_lock:
            counts, tokens = dict(self.counts), dict(self.tokens)
        return {"requests": counts, "prompt_tokens": tokens.get("prompt", 0),
                "completion_tokens": tokens.get("completion", 0), "batch": self.loop.batch_stats()}

    def metrics_text(self) -> bytes:
        self.llm.store.stats()  # refreshes the usage gauges
        lines = ["# HELP tierkv_http_requests_total HTTP requests by endpoint and status",
                 "# TYPE tierkv_http_requests_total counter"]
        stats = self.stats()
        for (endpoint, status), n in sorted(stats["requests"].items()):
            lines.append(f'tierkv_http_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
        for kind in ("prompt", "completion"):
            lines += [f"# HELP tierkv_{kind}_tokens_total Tokens in {kind}s served",
                      f"# TYPE tierkv_{kind}_tokens_total counter", f"tierkv_{kind}_tokens_total {stats[kind + '_tokens']}"]
        batch = stats["batch"]
        lines += ["# HELP tierkv_engine_steps_total Engine steps that sampled at least one token",
                  "# TYPE tierkv_engine_steps_total counter", f"tierkv_engine_steps_total {batch['steps']}",
                  "# HELP tierkv_engine_batch_size_max Most sequences that got a token in one step",
                  "# TYPE tierkv_engine_batch_size_max gauge", f"tierkv_engine_batch_size_max {batch['max_batch']}",
                  "# HELP tierkv_engine_batch_size_avg Sequences that got a token per step, on average",
                  "# TYPE tierkv_engine_batch_size_avg gauge", f"tierkv_engine_batch_size_avg {batch['avg_batch']:.4f}"]
        return self.llm.store.metrics.exposition() + ("\n".join(lines) + "\n").encode()

    # -- generation (called from handler threads) ---------------------------------

    def check_fits(self, prompt, params: SamplingParams) -> None:
        """RequestError (400) when prompt + max_tokens could never fit in the engine's L1 pool."""
        llm = self.llm
        n = len(prompt) if isinstance(prompt, list) else len(llm.tokenizer.encode(prompt))
        need = -(-min(n + params.max_tokens, llm.max_model_len) // llm.config.block_size)
        if need > llm.config.num_blocks:
            raise RequestError(400, f"prompt of {n} tokens + max_tokens {params.max_tokens} need {need} KV blocks; "
                                    f"this server holds {llm.config.num_blocks} (lower max_tokens or shorten the prompt)",
                               "max_tokens", "context_length_exceeded")

    def generate(self, prompt, params: SamplingParams, namespace: str | None):
        """One finished Output, batched with the other requests in flight; RequestError (400) for a prompt
        the engine refuses (too long, bad ids), (503) while shutting down; an engine error is raised."""
        req = self._submit(prompt, params, namespace, stream=False)
        return self._next(req)

    def stream(self, prompt, params: SamplingParams, namespace: str | None) -> Iterator:
        """Outputs token by token; closing the iterator early aborts this request only."""
        req = self._submit(prompt, params, namespace, stream=True)
        done = False
        try:
            while not done:
                out = self._next(req)
                done = out.finish_reason is not None
                yield out
        finally:
            if not done:
                self.loop.cancel(req)

    def _submit(self, prompt, params: SamplingParams, namespace: str | None, stream: bool):
        try:
            return self.loop.submit(prompt, params, namespace, stream)
        except EngineStopped as exc:
            raise RequestError(503, str(exc), kind="server_error", code="shutting_down") from None

    def _next(self, req):
        item = self.loop.next_output(req)
        if isinstance(item, PromptRejected):
            raise RequestError(400, str(item), "prompt")
        if isinstance(item, EngineStopped):
            raise RequestError(503, str(item), kind="server_error", code="shutting_down")
        if isinstance(item, BaseException):
            raise item
        return item

    def _finished(self, out, namespace: str | None) -> None:
        with self.stats_lock:
            self.tokens["prompt"] += len(out.prompt_token_ids)
            self.tokens["completion"] += len(out.token_ids)
        if self.on_request is not None:
            self.on_request(out.prompt_token_ids, out, namespace)


class _Handler(BaseHTTPRequestHandler):
    app: EngineServer
    server_version = "tierkv"
    error_content_type = "application/json"

    def log_message(self, format: str, *args) -> None:  # access logs stay off the console
        return

    # -- plumbing -----------------------------------------------------------------

    def _send_json(self, status: int, body: dict, endpoint: str) -> None:
        data = json.dumps(body).encode()
        self.app.count(endpoint, status)  # before the reply: a client that reads it then /metrics sees it counted
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Errors raised by the HTTP parser itself (bad request line, headers) as JSON too."""
        self.close_connection = True
        self.request_version = "HTTP/1.0"  # an unparsable request line would otherwise get a bare HTTP/0.9 body
        try:
            self._send_json(code, RequestError(code, message or "bad request").body(), "other")
        except OSError:
            pass

    def _read_body(self) -> dict:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise RequestError(411, "send the body with a Content-Length (chunked requests are not supported)")
        raw_len = self.headers.get("Content-Length")
        if raw_len is None:
            raise RequestError(411, "Content-Length: required")
        try:
            length = int(raw_len)
        except ValueError:
            raise RequestError(400, f"Content-Length: expected an integer, got {raw_len!r}") from None
        if length < 0:
            raise RequestError(400, f"Content-Length: expected >= 0, got {length}")
        if length > self.app.config.max_body_bytes:
            self._drain(length)
            raise RequestError(413, f"request body of {length} bytes exceeds the limit of "
                                    f"{self.app.config.max_body_bytes} bytes", code="request_too_large")
        data = self.rfile.read(length)
        if len(data) != length:
            raise RequestError(400, f"body: got {len(data)} of {length} bytes")
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(400, f"body: not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise RequestError(400, "body: expected a JSON object")
        return body

    def _drain(self, length: int, limit: int = 16 << 20) -> None:
        """Read and drop an oversized body (up to ``limit``), so the client reads our 413 instead of a reset."""
        left = min(length, limit)
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                return
            left -= len(chunk)

    def _handle(self, endpoint: str, fn) -> None:
        try:
            fn()
        except RequestError as exc:
            self.close_connection = True
            self._send_json(exc.status, exc.body(), endpoint)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
        except Exception as exc:  # an engine bug: report it as JSON, keep serving
            self.close_connection = True
            try:
                self._send_json(500, RequestError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                  kind="server_error").body(), endpoint)
            except OSError:
                pass

    # -- routes -------------------------------------------------------------------

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._handle("health", lambda: self._send_json(200, {"status": "ok"}, "health"))
        elif path == "/v1/models":
            self._handle("models", lambda: self._send_json(200, {"object": "list", "data": [
                {"id": self.app.config.model_name, "object": "model", "created": int(self.app.started),
                 "owned_by": "tierkv"}]}, "models"))
        elif path == "/metrics":
            self._handle("metrics", self._metrics)
        elif path in ("/v1/completions", "/v1/chat/completions"):
            self._handle("other", self._method_not_allowed)
        else:
            self._handle("other", self._not_found)

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/v1/completions":
            self._handle("completions", lambda: self._complete(chat=False))
        elif path == "/v1/chat/completions":
            self._handle("chat", lambda: self._complete(chat=True))
        elif path in ("/health", "/v1/models", "/metrics"):
            self._handle("other", self._method_not_allowed)
        else:
            self._handle("other", self._not_found)

    def do_PUT(self) -> None:
        self._handle("other", self._method_not_allowed)

    do_DELETE = do_PATCH = do_PUT

    def _not_found(self) -> None:
        raise RequestError(404, f"no route {self.command} {self.path}", code="not_found")

    def _method_not_allowed(self) -> None:
        raise RequestError(405, f"method {self.command} not allowed on {self.path}", code="method_not_allowed")

    def _metrics(self) -> None:
        self.app.count("metrics", 200)
        data = self.app.metrics_text()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _complete(self, chat: bool) -> None:
        endpoint = "chat" if chat else "completions"
        body = self._read_body()
        model = body.get("model", self.app.config.model_name)
        if model != self.app.config.model_name:
            raise RequestError(404, f"model: {model!r} is not served here; try {self.app.config.model_name!r}",
                               "model", "model_not_found")
        prompt = chat_prompt(body) if chat else completion_prompt(body)
        params = sampling_params(body, self.app.config.max_tokens_limit)
        stream = _opt(body, "stream", (bool,), False)
        namespace = _opt(body, "namespace", (str,), None)
        self.app.check_fits(prompt, params)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if stream:
            self._stream(rid, prompt, params, namespace, chat, endpoint)
            return
        out = self.app.generate(prompt, params, namespace)
        self._send_json(200, _response(rid, self.app.config.model_name, out, chat), endpoint)

    def _stream(self, rid: str, prompt, params, namespace, chat: bool, endpoint: str) -> None:
        outputs = self.app.stream(prompt, params, namespace)
        first = next(outputs)  # a refused prompt raises here, before any byte of the 200 is sent
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.app.count(endpoint, 200)
        model, created, sent = self.app.config.model_name, int(time.time()), ""
        try:
            if chat:
                self._event(_chunk(rid, model, created, chat, {"role": "assistant", "content": ""}, None))
            for out in itertools.chain([first], outputs):
                text = out.text if out.finish_reason else out.text.rstrip("\ufffd")  # hold back a split UTF-8 char
                delta = text[len(sent):] if text.startswith(sent) else ""
                sent += delta
                self._event(_chunk(rid, model, created, chat, {"content": delta} if chat else delta,
                            out.finish_reason, out if out.finish_reason else None))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        finally:
            outputs.close()  # a client that left aborts its request and frees the engine

    def _event(self, payload: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()


def _usage(out) -> dict:
    n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _tierkv(out) -> dict:
    return {"hit_tokens": out.hit_tokens, "ttft_ms": round(out.ttft_s * 1e3, 3) if out.ttft_s is not None else None}


def _response(rid: str, model: str, out, chat: bool) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "finish_reason": out.finish_reason}
    else:
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": _usage(out), "tierkv": _tierkv(out)}


def _chunk(rid: str, model: str, created: int, chat: bool, delta, finish_reason, final=None) -> dict:
    if chat:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
    payload = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
               "model": model, "choices": [choice]}
    if final is not None:
        payload["usage"] = _usage(final)
        payload["tierkv"] = _tierkv(final)
    return payload
