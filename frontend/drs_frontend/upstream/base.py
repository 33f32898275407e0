"""The interface every upstream client implements (the choice between them: :mod:`.factory`).

A client owns one connection pool (bounded per engine and in total) and maps its library's
failures onto :mod:`drs_frontend.errors`: refused/reset -> ``UpstreamConnectError``, the named
timeout running out -> ``UpstreamTimeout``. HTTP statuses are returned, never raised.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from drs_protocol.token_source import TokenSource


@dataclass(frozen=True, slots=True)
class UpstreamResponse:
    status: int
    content_type: str
    body: bytes
    #: the engine's ``x-drs-weights-version`` header (an engine in strict TensorRT-LLM mode names
    #: the version only there)
    weights_version: str | None = None


class UpstreamStream(Protocol):
    """A response whose body is read as it arrives."""

    status: int
    content_type: str

    async def read(self) -> bytes:
        """The whole remaining body (for non-2xx answers)."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; raises ``UpstreamUnavailable`` if the engine goes away."""
        ...


class UpstreamClient(Protocol):
    async def start(self) -> None:
        """Create the connection pool (inside the running event loop)."""
        ...

    async def close(self) -> None: ...

    async def post_json(
        self, url: str, body: bytes, timeout: float, headers: Mapping[str, str] | None = None
    ) -> UpstreamResponse:
        """POST a JSON body (with ``headers`` beside the client's own) and read the whole answer
        within ``timeout`` seconds."""
        ...

    def stream_json(
        self, url: str, body: bytes, timeout: float, headers: Mapping[str, str] | None = None
    ) -> AbstractAsyncContextManager[UpstreamStream]:
        """POST a JSON body (``headers`` as for :meth:`post_json`) and read the answer as it
        arrives (``timeout``: gap between reads)."""
        ...

    async def get(self, url: str, timeout: float) -> UpstreamResponse: ...


JSON_HEADERS: Mapping[str, str] = {"content-type": "application/json"}


class Presented:
    """The headers every request to an engine carries: the serving token's ``authorization`` of
    the moment (``drs_protocol.token_source``). Per request this compares one counter; the dicts
    are rebuilt only when the source changed (a rotation), so no file or environment is read."""

    def __init__(self, tokens: TokenSource | None) -> None:
        self.tokens = tokens or TokenSource()
        self._generation = -1
        self._auth: Mapping[str, str] = {}
        self._json: Mapping[str, str] = JSON_HEADERS

    def changed(self) -> bool:
        """Rebuild when the source changed; True then (callers drop what they cached)."""
        if self.tokens.generation == self._generation:
            return False
        self._generation = self.tokens.generation
        self._auth = dict(self.tokens.headers)
        self._json = {**JSON_HEADERS, **self._auth}
        return True

    @property
    def auth(self) -> Mapping[str, str]:
        """The ``authorization`` header alone (GETs)."""
        self.changed()
        return self._auth

    def json(self, extra: Mapping[str, str] | None = None) -> Mapping[str, str]:
        """``content-type: application/json``, the ``authorization`` header and a leg's own
        headers (the turn's stamp) for a POST."""
        self.changed()
        return self._json if not extra else {**self._json, **extra}


def json_headers(extra: Mapping[str, str] | None) -> Mapping[str, str]:
    """:data:`JSON_HEADERS` with a leg's own headers (the turn's stamp)."""
    return JSON_HEADERS if not extra else {**JSON_HEADERS, **extra}
