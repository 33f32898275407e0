"""The one error shape on the wire, and the exception tree every server raises from.

The engine, the frontend and the sidecar answer every error with the OpenAI error body
``{"error": {"message", "type", "param", "code"}}`` (``code`` is the HTTP status; a server may add
keys naming what failed, e.g. ``role`` or ``engines``), built by :func:`error_body`. Each server's
own errors subclass the status classes below, so ``exc.status`` and ``exc.type`` are all a server
needs to answer one:

::

    ApiError                      (500 internal_error)
    ├── BadRequestError           (400 invalid_request_error)  malformed JSON, bad fields
    ├── UnauthorizedError         (401 authentication_error)   control API without a token
    ├── ForbiddenError            (403 permission_error)       wrong token, control API disabled
    ├── NotFoundError             (404 not_found_error)        unknown route or object
    ├── ConflictError             (409 conflict_error)         another operation holds the resource
    ├── PayloadTooLargeError      (413 request_too_large)      body over the server's cap
    ├── NotSupportedError         (501 not_implemented)        operation not offered here
    ├── UpstreamError             (502 upstream_error)         a process this one called failed
    └── UnavailableError          (503 service_unavailable)    not loaded, asleep, or not ready

A status class is one line, ``class NotFoundError(ApiError, status=404)``: its ``type`` comes from
the same status table :func:`error_body` uses. Leaves: ``drs_engine.errors`` (context length,
weights load, draining …), ``drs_sidecar.errors`` (refit busy, no group, fleet unreadable …),
``drs_frontend.errors`` (a bad request, no engine of a role, an engine's answer that breaks the
protocol, an engine's own 4xx passed on verbatim).
"""

from __future__ import annotations

from typing import Any, Final

#: ``error.type`` of a status that has no class of its own.
_TYPE_BY_STATUS: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "request_too_large",
    500: "internal_error",
    501: "not_implemented",
    502: "upstream_error",
    503: "service_unavailable",
}


def error_type(status: int) -> str:
    """The ``error.type`` of an HTTP status (other 4xx: ``invalid_request_error``; 5xx: ``internal_error``)."""
    known = _TYPE_BY_STATUS.get(status)
    if known is not None:
        return known
    return "invalid_request_error" if 400 <= status < 500 else "internal_error"


def error_body(
    status: int, message: str, *, type_: str | None = None, param: str | None = None, **extra: Any
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code", **extra}}``: the one error body on the wire."""
    return {"error": {"message": message, "type": type_ or error_type(status), "param": param, "code": status, **extra}}


class ApiError(Exception):
    """Base of every error a server reports to its caller; answered with :meth:`to_body`.

    A subclass names its status as a class keyword (``class NotFoundError(ApiError, status=404)``);
    its ``type`` is that status's :func:`error_type` unless it sets ``type`` itself."""

    status: int = 500
    type: str = "internal_error"

    def __init_subclass__(cls, *, status: int | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if status is not None:
            cls.status = status
            if "type" not in cls.__dict__:
                cls.type = error_type(status)

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def extra(self) -> dict[str, Any]:
        """Keys added to the error object (what failed); none by default."""
        return {}

    def to_body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, type_=self.type, param=self.param, **self.extra())


class BadRequestError(ApiError, status=400):
    """Malformed JSON or bad fields; the message (and ``param``) names the field."""


class UnauthorizedError(ApiError, status=401):
    """No credentials where the route wants them."""


class ForbiddenError(ApiError, status=403):
    """Credentials that do not grant the route, or a route switched off."""


class NotFoundError(ApiError, status=404):
    """An unknown route or object."""


class ConflictError(ApiError, status=409):
    """Another operation holds the resource."""


class PayloadTooLargeError(ApiError, status=413):
    """A body over the server's cap."""


class NotSupportedError(ApiError, status=501):
    """An operation this server does not offer."""


class UpstreamError(ApiError, status=502):
    """A process this one called failed."""


class UnavailableError(ApiError, status=503):
    """Not loaded, asleep, or not ready."""
