"""The OpenAI request bodies the server accepts (pydantic, strict types) and the JSON it answers.

Fields are typed strictly (``"max_tokens": "5"`` is a 400, not 5); an
unknown field is a 400 naming it, as OpenAI answers. Fields OpenAI clients
send that the engine cannot honour (``n`` > 1, penalties, logprobs, tools)
are refused with a 400 naming the field instead of being ignored. ``stop``
(up to 4 strings) is applied to the decoded text by the server. tierkv extensions: ``namespace`` (the cache namespace of the
request), ``cache_salt``, ``top_k``, ``stop_token_ids``, ``ignore_eos`` (as vLLM has them).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from tierkv.engine.sampler import SamplingParams
from tierkv.engine.sequence import Output
from tierkv.engine.server.errors import RequestError

Number = Annotated[float, Field(strict=True)]  # ints are accepted, strings and booleans are not


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # accepted for vLLM clients; usage comes once, at the end


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # templates may read more keys (name, ...)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart]

    def as_dict(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = [p.model_dump() for p in self.content]
        return out


class _Generate(_Strict):
    """Fields shared by completions and chat completions."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = 0
    seed: StrictInt | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict[str, Any] | None = None
    logprobs: Any = None
    user: StrictStr | None = None
    namespace: StrictStr | None = None
    # vLLM's: only requests with the same salt share cached KV (a tenant's own prefix cache).
    cache_salt: StrictStr | None = None

    def sampling_params(self, limit: int, stop_ids: tuple[int, ...], max_tokens: int | None = None) -> SamplingParams:
        """SamplingParams for the engine (``stop_ids``: the model's end-of-turn tokens); RequestError (400)
        naming the field that is out of range or asks for something the engine does not do."""
        max_tokens = max_tokens if max_tokens is not None else self.max_tokens
        max_tokens = 16 if max_tokens is None else max_tokens
        if not 1 <= max_tokens <= limit:
            raise RequestError(400, f"max_tokens: expected an integer in [1, {limit}], got {max_tokens}", "max_tokens")
        if self.n != 1:
            raise RequestError(400, f"n: only 1 is supported, got {self.n}", "n")
        if not 0 <= self.temperature <= 2:
            raise RequestError(400, f"temperature: expected a number in [0, 2], got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise RequestError(400, f"top_p: expected a number in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise RequestError(400, f"top_k: expected an integer >= 0, got {self.top_k}", "top_k")
        stops = self.stop_strings()
        if len(stops) > 4 or not all(stops):
            raise RequestError(400, "stop: expected up to 4 non-empty strings", "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise RequestError(400, f"{name}: only 0 is supported", name)
        if self.logit_bias:
            raise RequestError(400, "logit_bias: not supported", "logit_bias")
        if self.logprobs not in (None, False):
            raise RequestError(400, "logprobs: not supported", "logprobs")
        extra = tuple(self.stop_token_ids or ())
        if self.ignore_eos:  # the model's end-of-turn tokens too; the request's own stop_token_ids still stop it
            stop_ids = ()
        return SamplingParams(max_tokens=max_tokens, temperature=float(self.temperature), top_p=float(self.top_p),
                              top_k=self.top_k, seed=self.seed, stop_token_ids=tuple(sorted(set(stop_ids + extra))),
                              ignore_eos=self.ignore_eos)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Generate):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def prompt_value(self) -> str | list[int]:
        """The one prompt of this request; RequestError (400) for an empty one or a batch."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str) and p:
            return p
        if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            return p
        raise RequestError(400, "prompt: expected a non-empty string or list of token ids (one prompt per request)",
                           "prompt")

    def check_supported(self) -> None:
        if self.echo:
            raise RequestError(400, "echo: not supported", "echo")
        if self.suffix:
            raise RequestError(400, "suffix: not supported", "suffix")
        if self.best_of not in (None, 1):
            raise RequestError(400, "best_of: only 1 is supported", "best_of")


class ChatRequest(_Generate):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    top_logprobs: StrictInt | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None

    def check_supported(self) -> None:
        if self.tools:
            raise RequestError(400, "tools: tool calling is not supported", "tools")
        if self.tool_choice not in (None, "none"):
            raise RequestError(400, "tool_choice: tool calling is not supported", "tool_choice")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise RequestError(400, "response_format: only {\"type\": \"text\"} is supported", "response_format")
        if self.top_logprobs:
            raise RequestError(400, "top_logprobs: not supported", "top_logprobs")

    def max_tokens_asked(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a ``prompt`` (tokenized as a completion would be) or chat ``messages``
    (rendered with the chat template, exactly as /v1/chat/completions does)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Message] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool | None = None


class WhyRequest(_Strict):
    """tierkv's ``/v1/kv/why``: for a ``prompt`` (text, tokenized as a completion would be, or token
    ids) or chat ``messages``, per block where its KV is or why it is not in any tier."""

    model: StrictStr | None = None
    prompt: StrictStr | list[StrictInt] | None = None
    messages: list[Message] | None = None
    add_generation_prompt: StrictBool = True
    namespace: StrictStr | None = None
    cache_salt: StrictStr | None = None


# -- responses ------------------------------------------------------------------------


def usage(out: Output) -> dict:
    """OpenAI's usage block; ``prompt_tokens_details.cached_tokens`` counts the prompt tokens whose KV came
    from any tierkv tier (L1-L4) instead of being computed."""
    n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": sum(out.hit_tokens.values())}}


def tierkv_info(out: Output) -> dict:
    """Where the cached prompt tokens came from, by tier, and the time to first token."""
    return {"hit_tokens": out.hit_tokens, "ttft_ms": round(out.ttft_s * 1e3, 3) if out.ttft_s is not None else None}


def response(rid: str, model: str, out: Output, text: str, chat: bool) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": out.finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": out.finish_reason}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(out), "tierkv": tierkv_info(out)}


def chunk(rid: str, model: str, created: int, chat: bool, delta: str | None, finish_reason: str | None,
          role: bool = False) -> dict:
    """One streamed event; ``delta`` None with ``chat`` sends an empty delta (the final event)."""
    if chat:
        d: dict = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
        choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, created: int, chat: bool, out: Output) -> dict:
    """The last event when ``stream_options.include_usage``: no choices, the usage (and tierkv's hits)."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(out), "tierkv": tierkv_info(out)}
