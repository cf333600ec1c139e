"""OpenAI-style JSON errors: ``{"error": {"message", "type", "param", "code"}}`` for every refusal.

``install(app)`` makes FastAPI answer a request that fails validation (bad
JSON, a missing or mistyped field) with a 400 naming the field, an unknown
route or method with 404/405, a ``RequestError`` with its own status, and an
engine bug with a 500, all in that shape.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("tierkv.server")


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "TextPart", "Message", "StreamOptions"}


def _is_tag(part) -> bool:
    """Pydantic's name for a union member in an error location (``str``, ``list[int]``), not a field."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


def field_path(loc) -> str:
    """Pydantic's ``("body", "messages", 0, "role")`` as ``messages[0].role`` (union member tags dropped)."""
    out = ""
    for i, part in enumerate(loc):
        if part == "body" and i == 0:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_tag(part):
            out += ("." if out else "") + str(part)
    return out or "body"


def validation_error(exc: RequestValidationError) -> RequestError:
    """The first problem pydantic found, as a 400 naming the field."""
    errors = exc.errors()
    if not errors:
        return RequestError(400, "body: invalid request")
    err = errors[0]
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return RequestError(400, f"body: not valid JSON ({detail})" if detail else "body: not valid JSON")
    path = field_path(err.get("loc", ()))
    tags = [next((p for p in e.get("loc", ()) if _is_tag(p)), None) for e in errors if field_path(e.get("loc", ())) == path
            or field_path(e.get("loc", ())).startswith(path + "[")]
    if len(errors) > 1 and any(tags):  # every member of a union refused the value
        kinds = " or ".join(dict.fromkeys(t for t in tags if t))
        return RequestError(400, f"{path}: expected {kinds}", path)
    if kind == "missing":
        return RequestError(400, f"{path}: required", path)
    if kind == "extra_forbidden":
        return RequestError(400, f"{path}: unknown field", path)
    if path == "body" and kind in ("model_attributes_type", "dict_type", "model_type"):
        return RequestError(400, "body: expected a JSON object")
    return RequestError(400, f"{path}: {err.get('msg', 'invalid')}", path)


def install(app: FastAPI) -> None:
    """Register the JSON error handlers on ``app``."""

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = RequestError(404, f"no route {request.method} {request.url.path}", code="not_found")
        elif exc.status_code == 405:
            err = RequestError(405, f"method {request.method} not allowed on {request.url.path}",
                               code="method_not_allowed")
        else:
            err = RequestError(exc.status_code, str(exc.detail))
        return JSONResponse(err.body(), status_code=err.status, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.error("tierkv serve: %s %s failed", request.method, request.url.path, exc_info=exc)
        return RequestError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error").response()
