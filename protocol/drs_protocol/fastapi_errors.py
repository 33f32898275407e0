"""The error handlers of the FastAPI servers (engine, sidecar): every error in the one body shape.

:func:`install_error_handlers` makes an app answer an :class:`~drs_protocol.errors.ApiError`
raised anywhere with ``exc.status`` and ``exc.to_body()``, an unknown route or method with 404 /
405, invalid path or query parameters with 400 naming the parameter, and anything else (a bug)
with 500 — all as ``{"error": {"message", "type", "param", "code"}}``. The frontend's own HTTP
server builds the same body with :func:`drs_protocol.errors.error_body`.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from drs_protocol.errors import ApiError, error_body
from drs_protocol.validation_errors import field_problems

#: Where FastAPI says a parameter came from: not part of the field path a client is told.
_REQUEST_PARTS = ("path", "query", "body")


def api_error_response(exc: ApiError) -> JSONResponse:
    """The response of one :class:`ApiError`."""
    return JSONResponse(exc.to_body(), status_code=exc.status)


def install_error_handlers(app: FastAPI, log: logging.Logger) -> None:
    """Answer every error of ``app`` in the one error body (see the module docstring)."""

    async def http_error(_: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        detail = getattr(exc, "detail", None) or "error"
        return JSONResponse(error_body(status, str(detail)), status_code=status)

    async def invalid_params(_: Request, exc: Exception) -> Response:
        problems = field_problems(exc.errors(), skip=_REQUEST_PARTS) if isinstance(exc, RequestValidationError) else []
        if not problems:
            return JSONResponse(error_body(400, "invalid request"), status_code=400)
        first = problems[0]
        return JSONResponse(error_body(400, first.describe(), param=first.path or None), status_code=400)

    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return api_error_response(exc)

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"), status_code=500)

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid_params)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(Exception, unexpected)
