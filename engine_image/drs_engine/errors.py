"""The engine server's errors: the shared tree of :mod:`drs_protocol.errors`, with the engine's leaves.

Every error a request can meet is an :class:`EngineError` (:class:`drs_protocol.errors.ApiError`);
the server answers it with the one error body ``{"error": {"message", "type", "param", "code"}}``
and keeps serving. Anything else that escapes a handler is a bug and becomes a 500 in the same
shape.

::

    EngineError = ApiError              (500 internal_error)
    ├── BadRequestError                 (400 invalid_request_error)  malformed JSON, bad fields, bad base64
    │   ├── ContextLengthError          (400) "context length exceeded: …"
    │   ├── ContextMismatchError        (400) fetched context state does not match the request
    │   └── WeightsLoadError            (400) a weights load was refused; old weights keep serving
    ├── UnauthorizedError               (401 authentication_error)   control API without a token
    ├── ForbiddenError                  (403 permission_error)       wrong token, or control API disabled
    ├── NotFoundError                   (404 not_found_error)        unknown route
    │   └── ContextStateMissingError    (404) ctx_request_id not (or no longer) on the prefill engine
    ├── PayloadTooLargeError            (413 request_too_large)
    ├── NotSupportedError               (501 not_implemented)        op not offered by this backend
    ├── KvTransferError = UpstreamError (502 upstream_error)         prefill engine unreachable for a KV fetch
    └── UnavailableError                (503 service_unavailable)    asleep (memory released) or not loaded
        ├── DrainingError               (503 draining)               stopping: send the leg to another engine
        └── WeightsPendingError         (503 weights_pending)        not at the announced target weights yet
"""

from __future__ import annotations

from drs_protocol import fields
from drs_protocol.errors import (
    ApiError,
    BadRequestError,
    ForbiddenError,
    NotFoundError,
    NotSupportedError,
    PayloadTooLargeError,
    UnauthorizedError,
    UnavailableError,
    UpstreamError,
)
from drs_protocol.lifecycle import DRAINING_ERROR_TYPE, WEIGHTS_PENDING_ERROR_TYPE

#: Base of every error the engine reports to a caller.
EngineError = ApiError
#: A prefill engine could not be reached for a KV fetch.
KvTransferError = UpstreamError

__all__ = [
    "BadRequestError",
    "ContextLengthError",
    "ContextMismatchError",
    "ContextStateMissingError",
    "DrainingError",
    "EngineError",
    "ForbiddenError",
    "KvTransferError",
    "NotFoundError",
    "NotSupportedError",
    "PayloadTooLargeError",
    "UnauthorizedError",
    "UnavailableError",
    "WeightsLoadError",
    "WeightsPendingError",
    "retry_headers",
]


class ContextLengthError(BadRequestError):
    """The prompt does not fit the model's maximum length."""


class ContextMismatchError(BadRequestError):
    """The context state fetched from the prefill engine is not the state of this request."""


class WeightsLoadError(BadRequestError):
    """A weights load could not be done; the previous weights keep serving."""


class ContextStateMissingError(NotFoundError):
    """The prefill engine no longer holds (or never held) the context state asked for."""


class DrainingError(UnavailableError):
    """503: the engine is stopping; the leg belongs on another engine."""

    type = DRAINING_ERROR_TYPE


class WeightsPendingError(UnavailableError):
    """503: the fleet's announced target weights are not the ones this engine holds yet; the leg
    belongs on an engine that holds them (``retry_after_s``: when this one may, as a header)."""

    type = WEIGHTS_PENDING_ERROR_TYPE

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def retry_headers(exc: ApiError) -> dict[str, str] | None:
    """The ``Retry-After`` header of an error that says when to try again (None: none)."""
    if isinstance(exc, WeightsPendingError):
        return {fields.RETRY_AFTER_HEADER: str(exc.retry_after_s)}
    return None
