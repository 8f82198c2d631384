"""Errors as OpenAI's error object (`{"error": {"message", "type", "param", "code"}}`) with the status that fits:
400 bad input, 401 a missing or wrong key, 404 an unknown model or route, 503 overload or a dead engine (with
Retry-After when a retry can help), 500 only for bugs."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from m3sdk.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from m3sdk.server.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("m3sdk.server")


class APIError(Exception):
    """An error the server answers with: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def not_supported(param: str, what: str = "") -> APIError:
    return APIError(400, f"{param}{what} is not supported by this server", param=param, code="unsupported_parameter")


def to_api_error(exc: BaseException) -> APIError:
    """The API error of an exception raised while serving a request (also used inside an open stream)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), type="overloaded_error", code="engine_overloaded")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_dead")
    log.exception("internal error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def error_response(exc: BaseException) -> JSONResponse:
    err = to_api_error(exc)
    headers = {"Retry-After": "1"} if err.code == "engine_overloaded" else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    problems, param = [], None
    for e in exc.errors():
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        param = param or where or None
        problems.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "; ".join(problems) or "invalid request", param


def install_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(bad_request(message, param))

    async def on_http(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    for kind in (APIError, InvalidRequestError, EngineOverloadedError, EngineDeadError, Exception):
        app.add_exception_handler(kind, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
