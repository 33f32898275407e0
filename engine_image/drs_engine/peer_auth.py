"""What an engine presents to its peers: the serving token of the moment, per request.

An ``httpx.Auth`` over a :class:`~drs_protocol.token_source.TokenSource`: each request gets the
source's current ``authorization`` header (an attribute read; the source re-reads its mounted
Secret off the request path), so a rotated token reaches the KV fetch without a new client.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping

import httpx
from drs_protocol.token_source import TokenSource


class SourceAuth(httpx.Auth):
    """Sets the source's current header on every request (none while it holds no token)."""

    def __init__(self, source: TokenSource) -> None:
        self.source = source

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers.update(self.source.headers)
        yield request


def peer_auth(peer: TokenSource | Mapping[str, str] | None) -> tuple[httpx.Auth | None, dict[str, str]]:
    """(the client's ``auth``, its fixed ``headers``) for a backend's ``peer_headers`` argument:
    a live source, or fixed headers (tests, hand-built backends)."""
    if isinstance(peer, TokenSource):
        return SourceAuth(peer), {}
    return None, dict(peer or {})
