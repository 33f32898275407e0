"""The frontend's errors: the shared tree of :mod:`drs_protocol.errors`, with the relay's leaves.

Every error on the request path is an :class:`FrontendError` (:class:`drs_protocol.errors.ApiError`),
so ``exc.status`` and ``exc.to_body()`` answer it in the one error body
``{"error": {"message", "type", "param", "code", …}}``, as the engine and the sidecar do:

::

    FrontendError = ApiError                      (500 internal_error)
    ├── BadRequestError                           (400 invalid_request_error)
    │   └── RequestError                          the client's request is unusable (names the field)
    ├── EngineRejected                            an engine answered 4xx -> that status and body, verbatim
    ├── PayloadTooLargeError                      (413 request_too_large)
    │   └── ForwardTooLarge                       a body to forward is over the engines' limit (names it)
    ├── UnavailableError                          (503 service_unavailable)
    │   └── NoEngineAvailable                     every engine of a role failed this turn (names the role)
    └── UpstreamError                             (502 upstream_error) talking to one engine went wrong
        ├── UpstreamUnavailable                   refused, reset or timed out -> engine marked down, leg retried
        │   ├── UpstreamConnectError
        │   └── UpstreamTimeout
        └── UpstreamProtocolError                 2xx with a body that breaks PROTOCOL.md -> 502
"""

from __future__ import annotations

from typing import Any

from drs_protocol import errors as protocol
from drs_protocol.errors import ApiError, BadRequestError, UnavailableError, error_type

#: Base of every error the frontend reports to a client.
FrontendError = ApiError


class RequestError(BadRequestError, ValueError):
    """The client's request is unusable: 400 with a message (and ``param``) naming the field."""


class EngineRejected(ApiError):
    """An engine answered with a client error; the client gets the same status and body."""

    def __init__(self, role: str, url: str, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"{role} engine {url} answered {status}")
        self.role = role
        self.url = url
        self.status = status
        self.type = error_type(status)
        self.body = body
        self.content_type = content_type


class ForwardTooLarge(protocol.PayloadTooLargeError):
    """The body this frontend would forward is over the engines' limit (``limits.engineMaxRequestBytes``):
    413 here, naming both sizes, instead of an engine's bare 413 (drs_protocol.limits)."""


class NoEngineAvailable(UnavailableError):
    """No engine of ``role`` could serve this turn (all down, or all tried and failed): 503 naming the role."""

    def __init__(self, role: str, tried: list[str]) -> None:
        detail = f"tried {', '.join(tried)}" if tried else "none is up"
        super().__init__(f"no {role} engine available ({detail})")
        self.role = role
        self.tried = tried

    def extra(self) -> dict[str, Any]:
        return {"role": self.role}


class UpstreamError(protocol.UpstreamError):
    """Talking to one engine went wrong (502 when it reaches the client)."""


class UpstreamUnavailable(UpstreamError):
    """The engine could not be reached or did not answer in time; try another one."""

    kind = "unavailable"


class UpstreamConnectError(UpstreamUnavailable):
    """Connection refused, reset or closed before a complete answer."""

    kind = "connect"


class UpstreamTimeout(UpstreamUnavailable):
    """The leg's named timeout ran out."""

    kind = "timeout"


class EngineRefusedCredential(UpstreamError):
    """An engine answered 401 to this frontend: its serving token (``DRS_SERVING_TOKEN``) is not
    the fleet's. The frontend's fault, not the client's: 502 naming the engine (not the 401, which
    an OpenAI client would take for its own key being wrong)."""

    kind = "credential"

    def __init__(self, role: str, url: str) -> None:
        super().__init__(
            f"{role} engine {url} refused this frontend's serving token (401): "
            "the frontend's serving token is missing or not the fleet's"
        )
        self.role = role


class UpstreamProtocolError(UpstreamError, ValueError):
    """An engine answered 2xx with a body that breaks the protocol (answered 502)."""

    kind = "protocol"

    def to_body(self) -> dict[str, Any]:
        return protocol.error_body(self.status, f"engine response: {self.message}", type_=self.type)
