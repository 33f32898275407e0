"""The aiohttp upstream client (streams and probes of the ``raw`` client; see ``bench/relay.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Final

import aiohttp
from drs_protocol.fields import HEADER_WEIGHTS_VERSION
from drs_protocol.token_source import TokenSource

from drs_frontend.config import Limits
from drs_frontend.errors import UpstreamConnectError, UpstreamTimeout
from drs_frontend.upstream.base import Presented, UpstreamResponse

#: Idle keep-alive connections are closed after this many seconds: below uvicorn's default of 5 s
#: (engines run uvicorn), so this side closes an idle connection before the engine does and a
#: request never goes out on a connection the engine is closing.
KEEPALIVE_SECONDS: Final = 4.0


class _AiohttpStream:
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.content_type = response.headers.get("content-type", "application/json")

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamConnectError(f"{self._response.url}: {exc!r}") from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except TimeoutError as exc:
            raise UpstreamTimeout(f"{self._response.url}: stream stalled") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamConnectError(f"{self._response.url}: {exc!r}") from exc


class AiohttpUpstream:
    def __init__(self, *, connect_timeout: float, limits: Limits, tokens: TokenSource | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.limits = limits
        #: sent with every request (the serving token's ``authorization`` of the moment)
        self.presented = Presented(tokens)
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[tuple[float | None, float | None], aiohttp.ClientTimeout] = {}

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self.limits.connections_total,
            limit_per_host=self.limits.connections_per_engine,
            keepalive_timeout=KEEPALIVE_SECONDS,
            enable_cleanup_closed=False,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("upstream client not started")
        return self._session

    def _timeout(self, total: float | None, read: float | None = None) -> aiohttp.ClientTimeout:
        """One ``ClientTimeout`` per (total, read) pair (they come from the config: a few), not one per call."""
        timeout = self._timeouts.get((total, read))
        if timeout is None:
            timeout = aiohttp.ClientTimeout(total=total, connect=self.connect_timeout, sock_read=read)
            self._timeouts[total, read] = timeout
        return timeout

    async def post_json(
        self, url: str, body: bytes, timeout: float, headers: Mapping[str, str] | None = None
    ) -> UpstreamResponse:
        try:
            async with self.session.post(
                url, data=body, headers=self.presented.json(headers), timeout=self._timeout(timeout)
            ) as resp:
                data = await resp.read()
                return UpstreamResponse(
                    resp.status,
                    resp.headers.get("content-type", "application/json"),
                    data,
                    resp.headers.get(HEADER_WEIGHTS_VERSION),
                )
        except TimeoutError as exc:
            raise UpstreamTimeout(f"{url}: no answer within {timeout:g}s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamConnectError(f"{url}: {exc!r}") from exc

    @asynccontextmanager
    async def stream_json(
        self, url: str, body: bytes, timeout: float, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[_AiohttpStream]:
        try:
            resp = await self.session.post(
                url, data=body, headers=self.presented.json(headers), timeout=self._timeout(None, timeout)
            )
        except TimeoutError as exc:
            raise UpstreamTimeout(f"{url}: no answer within {timeout:g}s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamConnectError(f"{url}: {exc!r}") from exc
        try:
            yield _AiohttpStream(resp)
        finally:
            if resp.content.at_eof():
                resp.release()  # back to the pool
            else:
                resp.close()  # cut short (client gone): drop the connection so the engine sees it

    async def get(self, url: str, timeout: float) -> UpstreamResponse:
        try:
            async with self.session.get(url, headers=self.presented.auth, timeout=self._timeout(timeout)) as resp:
                data = await resp.read()
                return UpstreamResponse(resp.status, resp.headers.get("content-type", ""), data)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"{url}: no answer within {timeout:g}s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamConnectError(f"{url}: {exc!r}") from exc
