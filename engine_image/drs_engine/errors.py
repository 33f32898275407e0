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
    │   └── CollectiveError             (502 collective_error)       a collective step failed or ran past
    │                                                                its deadline (names this engine's rank)
    └── UnavailableError                (503 service_unavailable)    asleep (memory released) or not loaded
        ├── DrainingError               (503 draining)               stopping: send the leg to another engine
        ├── WeightsPendingError         (503 weights_pending)        not at the announced target weights, or
        │                                                            the desired weights it started under, yet
        └── WeightsIncompleteError      (503 weights_incomplete)     an update failed after it changed bytes:
                                                                     no turn until a good load
"""

from __future__ import annotations

from drs_protocol import fields
from drs_protocol.collective import COLLECTIVE_ERROR_TYPE, WEIGHTS_INCOMPLETE_ERROR_TYPE
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
    "CollectiveError",
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
    "WeightsIncompleteError",
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
    """503: this engine does not hold the weights it must serve at yet: the fleet's announced target
    (:mod:`drs_engine.weights.target`), or the desired weights it started under
    (:mod:`drs_engine.weights.catchup`); the leg belongs on an engine that holds them
    (``retry_after_s``: when this one may, as a header; None: no estimate)."""

    type = WEIGHTS_PENDING_ERROR_TYPE

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def retry_headers(exc: ApiError) -> dict[str, str] | None:
    """The ``Retry-After`` header of an error that says when to try again (None: none)."""
    if isinstance(exc, WeightsPendingError) and exc.retry_after_s is not None:
        return {fields.RETRY_AFTER_HEADER: str(exc.retry_after_s)}
    return None


class CollectiveError(UpstreamError):
    """502: a collective step (joining the group, an update's broadcasts) failed or ran past its
    deadline; the message names this engine's rank and what it waited for. ``weights_changed``:
    bytes of the update had already landed in the weights (the engine stops serving turns)."""

    type = COLLECTIVE_ERROR_TYPE

    def __init__(self, message: str, *, weights_changed: bool = False) -> None:
        super().__init__(message)
        self.weights_changed = weights_changed


class WeightsIncompleteError(UnavailableError):
    """503: the engine holds part of an update that failed; it serves no turn until a load completes
    (``/health`` answers 503 too, so its pod is not Ready and the frontends send it nothing)."""

    type = WEIGHTS_INCOMPLETE_ERROR_TYPE
