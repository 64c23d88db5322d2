"""OpenAI-style errors: `APIError` and the handlers that turn every failure into `{"error": {...}}` with a 4xx/5xx."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.sched.admission import InvalidRequest

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered to the client. `type` follows OpenAI (invalid_request_error, ...); `code` is optional."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def invalid_request(e: ValueError, prompt_param: str, max_tokens_param: str = "max_tokens") -> APIError:
    """A request the admission checks or `SamplingParams` refused (`InvalidRequest`, or any ValueError a
    backend raises) as a 400 naming the field the client sent: an error about the prompt or the request
    as a whole names `prompt_param` ("messages" for chat), one about max_tokens `max_tokens_param`."""
    if not isinstance(e, InvalidRequest):
        return bad_request(str(e), prompt_param)
    if e.field == "max_tokens":
        e = e.about(max_tokens_param)
    return bad_request(e.message, prompt_param if e.field in (None, "prompt") else e.field, e.code)


def field_path(loc: tuple | list) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content" (None for the body itself)."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    where = field_path(first.get("loc", ()))
    parts = [f"{where or 'body'}: {first.get('msg')}"]
    if len(errors) > 1:
        parts.append(f"(and {len(errors) - 1} more problem(s))")
    return " ".join(parts), where


def unavailable(message: str, code: str = "backend_unavailable") -> APIError:
    return APIError(503, message, "server_error", None, code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(message, kind, None, code), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), status_code=500)
