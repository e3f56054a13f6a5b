"""Every error is OpenAI's body `{"error": {"message", "type", "param", "code"}}` with OpenAI's status: 400 for a
request that cannot be understood, 401 without a known key, 404 for an object this key does not own (or that does
not exist — the two are indistinguishable on purpose), 413 for an upload over the limit, 400 or 429 for a request
over its key's quotas (server/quotas.py), 507 when the server's disk is full (the request changed nothing: it may be
sent again once space returns)."""

from __future__ import annotations

import sqlite3

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.io.full_disk import disk_full
from pipeline.server.quotas import QuotaExceeded
from pipeline.server.schemas import ErrorBody, ErrorDetail

log = structlog.get_logger(__name__)

DISK_FULL = ErrorDetail(
    message="the server's disk is full: nothing of this request was kept; send it again later",
    type="server_error",
    code="insufficient_storage",
)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)


def not_found(kind: str, object_id: str, param: str = "id") -> ApiError:
    return ApiError(404, f"No such {kind} object: {object_id}", param=param)


def error_response(status: int, detail: ErrorDetail) -> JSONResponse:
    return JSONResponse(ErrorBody(error=detail).model_dump(), status_code=status)


async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.detail)


async def _over_quota(_: Request, exc: QuotaExceeded) -> JSONResponse:
    return error_response(
        exc.status, ErrorDetail(message=exc.message, type=exc.type, param=exc.param, code=exc.code)
    )


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return error_response(400, ErrorDetail(message=f"{param}: {first.get('msg', 'invalid')}", param=param))


async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown routes and methods, in OpenAI's shape.
    return error_response(exc.status_code, ErrorDetail(message=str(exc.detail)))


async def _storage(request: Request, exc: Exception) -> JSONResponse:
    """A full disk is the server's condition, not the request's fault: 507, OpenAI's shape, and the server goes on.
    Any other storage error is a 500 in the same shape; its detail stays in the server's log."""
    if disk_full(exc):
        log.warning("request refused: disk full", path=request.url.path, error=str(exc))
        return error_response(507, DISK_FULL)
    log.error("storage error", path=request.url.path, error=repr(exc), exc_info=exc)
    return error_response(
        500, ErrorDetail(message="the server could not store this request", type="server_error")
    )


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(QuotaExceeded, _over_quota)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(OSError, _storage)
    app.add_exception_handler(sqlite3.Error, _storage)
