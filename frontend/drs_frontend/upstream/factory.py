"""The choice between the upstream clients by name (the frontend config's ``upstreamClient``).

Each implementation is imported only when chosen, so a frontend never loads the libraries of the
clients it does not use. The clients import :mod:`.base`, never this module.
"""

from __future__ import annotations

from drs_protocol.token_source import TokenSource

from drs_frontend.config import Limits, UpstreamClientName
from drs_frontend.upstream.base import UpstreamClient


def build_upstream(
    name: UpstreamClientName,
    *,
    connect_timeout: float,
    limits: Limits,
    serving_token: str | TokenSource | None = None,
) -> UpstreamClient:
    """The client ``name``; every request it makes presents ``serving_token`` (``drs_protocol.auth``;
    a :class:`TokenSource`: the token it holds at the time of the request)."""
    tokens = TokenSource.of(serving_token)
    if name == "raw":
        from drs_frontend.upstream.raw_client import RawUpstream

        return RawUpstream(connect_timeout=connect_timeout, limits=limits, tokens=tokens)
    if name == "httpx":
        from drs_frontend.upstream.httpx_client import HttpxUpstream

        return HttpxUpstream(connect_timeout=connect_timeout, limits=limits, tokens=tokens)
    from drs_frontend.upstream.aiohttp_client import AiohttpUpstream

    return AiohttpUpstream(connect_timeout=connect_timeout, limits=limits, tokens=tokens)
