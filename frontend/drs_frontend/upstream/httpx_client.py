"""The httpx upstream client (the stack's usual client; slower here, see ``bench/relay.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Final

import httpx
from drs_protocol.fields import HEADER_WEIGHTS_VERSION
from drs_protocol.token_source import TokenSource

from drs_frontend.config import Limits
from drs_frontend.errors import UpstreamConnectError, UpstreamTimeout
from drs_frontend.upstream.base import Presented, UpstreamResponse

#: Below uvicorn's default keep-alive of 5 s (see aiohttp_client.KEEPALIVE_SECONDS).
KEEPALIVE_SECONDS: Final = 4.0


class _HttpxStream:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.content_type = response.headers.get("content-type", "application/json")

    async def read(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.TransportError as exc:
            raise UpstreamConnectError(f"{self._response.url}: {exc!r}") from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"{self._response.url}: stream stalled") from exc
        except httpx.TransportError as exc:
            raise UpstreamConnectError(f"{self._response.url}: {exc!r}") from exc


class HttpxUpstream:
    def __init__(self, *, connect_timeout: float, limits: Limits, tokens: TokenSource | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.limits = limits
        #: sent with every request (the serving token's ``authorization`` of the moment)
        self.presented = Presented(tokens)
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=self.limits.connections_total,
                max_keepalive_connections=self.limits.connections_total,
                keepalive_expiry=KEEPALIVE_SECONDS,
            ),
            timeout=httpx.Timeout(None, connect=self.connect_timeout),
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("upstream client not started")
        return self._client

    def _timeout(self, total: float) -> httpx.Timeout:
        return httpx.Timeout(total, connect=self.connect_timeout)

    async def post_json(
        self, url: str, body: bytes, timeout: float, headers: Mapping[str, str] | None = None
    ) -> UpstreamResponse:
        try:
            resp = await self.client.post(
                url, content=body, headers=self.presented.json(headers), timeout=self._timeout(timeout)
            )
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"{url}: no answer within {timeout:g}s") from exc
        except httpx.TransportError as exc:
            raise UpstreamConnectError(f"{url}: {exc!r}") from exc
        return UpstreamResponse(
            resp.status_code,
            resp.headers.get("content-type", "application/json"),
            resp.content,
            resp.headers.get(HEADER_WEIGHTS_VERSION),
        )

    @asynccontextmanager
    async def stream_json(
        self, url: str, body: bytes, timeout: float, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[_HttpxStream]:
        request = self.client.build_request(
            "POST", url, content=body, headers=self.presented.json(headers), timeout=self._timeout(timeout)
        )
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"{url}: no answer within {timeout:g}s") from exc
        except httpx.TransportError as exc:
            raise UpstreamConnectError(f"{url}: {exc!r}") from exc
        try:
            yield _HttpxStream(resp)
        finally:
            await resp.aclose()

    async def get(self, url: str, timeout: float) -> UpstreamResponse:
        try:
            resp = await self.client.get(url, headers=self.presented.auth, timeout=self._timeout(timeout))
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"{url}: no answer within {timeout:g}s") from exc
        except httpx.TransportError as exc:
            raise UpstreamConnectError(f"{url}: {exc!r}") from exc
        return UpstreamResponse(resp.status_code, resp.headers.get("content-type", ""), resp.content)
