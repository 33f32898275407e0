"""The engine server's one error tree, and how each error looks on the wire.

Every error a request can meet is an :class:`EngineError`; the server turns it into the OpenAI
error shape ``{"error": {"message", "type", "param", "code"}}`` with ``code`` equal to the HTTP
status, and keeps serving. Anything else that escapes a handler is a bug and becomes a 500 in
the same shape.

::

    EngineError                         (500 internal_error)
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
    ├── KvTransferError                 (502 upstream_error)         prefill engine unreachable for a KV fetch
    └── UnavailableError                (503 service_unavailable)    asleep (memory released) or not loaded
        └── DrainingError               (503 draining)               stopping: send the leg to another engine
"""

from __future__ import annotations

from typing import Any

from drs_protocol.lifecycle import DRAINING_ERROR_TYPE


class EngineError(Exception):
    """Base of every error the engine reports to a caller."""

    status: int = 500
    type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_body(self) -> dict[str, Any]:
        """The OpenAI error body."""
        return error_body(self.message, self.type, self.status, self.param)


class BadRequestError(EngineError):
    status = 400
    type = "invalid_request_error"


class ContextLengthError(BadRequestError):
    """The prompt does not fit the model's maximum length."""


class ContextMismatchError(BadRequestError):
    """The context state fetched from the prefill engine is not the state of this request."""


class WeightsLoadError(BadRequestError):
    """A weights load could not be done; the previous weights keep serving."""


class UnauthorizedError(EngineError):
    status = 401
    type = "authentication_error"


class ForbiddenError(EngineError):
    status = 403
    type = "permission_error"


class NotFoundError(EngineError):
    status = 404
    type = "not_found_error"


class ContextStateMissingError(NotFoundError):
    """The prefill engine no longer holds (or never held) the context state asked for."""


class PayloadTooLargeError(EngineError):
    status = 413
    type = "request_too_large"


class NotSupportedError(EngineError):
    status = 501
    type = "not_implemented"


class KvTransferError(EngineError):
    status = 502
    type = "upstream_error"


class UnavailableError(EngineError):
    status = 503
    type = "service_unavailable"


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``: the one error shape on the wire."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class DrainingError(UnavailableError):
    """503: the engine is stopping; the leg belongs on another engine."""

    type = DRAINING_ERROR_TYPE
