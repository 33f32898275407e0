"""Every error the frontend raises on the request path, and what the client gets for it.

::

    FrontendError
    ├── RequestError              the client's request is unusable        -> its 4xx, OpenAI-shaped
    ├── EngineRejected            an engine answered 4xx                  -> that status and body, verbatim
    ├── NoEngineAvailable         every engine of a role failed this turn -> 503 naming the role
    └── UpstreamError             talking to one engine went wrong
        ├── UpstreamUnavailable   refused, reset or timed out             -> engine marked down, leg retried
        │   ├── UpstreamConnectError
        │   └── UpstreamTimeout
        └── UpstreamProtocolError 2xx with a body that breaks PROTOCOL.md -> 502
"""

from __future__ import annotations


class FrontendError(Exception):
    """Base of every error on the request path."""


class RequestError(FrontendError, ValueError):
    """The client's request is unusable: answered with ``status`` and an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class EngineRejected(FrontendError):
    """An engine answered with a client error; the client gets the same status and body."""

    def __init__(self, role: str, url: str, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"{role} engine {url} answered {status}")
        self.role = role
        self.url = url
        self.status = status
        self.body = body
        self.content_type = content_type


class NoEngineAvailable(FrontendError):
    """No engine of ``role`` could serve this turn (all down, or all tried and failed)."""

    def __init__(self, role: str, tried: list[str]) -> None:
        detail = f"tried {', '.join(tried)}" if tried else "none is up"
        super().__init__(f"no {role} engine available ({detail})")
        self.role = role
        self.tried = tried


class UpstreamError(FrontendError):
    """Talking to one engine went wrong."""


class UpstreamUnavailable(UpstreamError):
    """The engine could not be reached or did not answer in time; try another one."""

    kind = "unavailable"


class UpstreamConnectError(UpstreamUnavailable):
    """Connection refused, reset or closed before a complete answer."""

    kind = "connect"


class UpstreamTimeout(UpstreamUnavailable):
    """The leg's named timeout ran out."""

    kind = "timeout"


class UpstreamProtocolError(UpstreamError, ValueError):
    """An engine answered 2xx with a body that breaks the protocol (answered 502)."""

    kind = "protocol"
