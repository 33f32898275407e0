"""A minimal HTTP/1.1 keep-alive client for the hot path: JSON POSTs on asyncio protocols + httptools.

Each leg of a turn is one ``POST`` of a JSON body to an engine whose answer is one JSON body. A
general client spends most of its time on features this never uses (redirects, cookies, auth,
proxies, decompression, multipart); this one writes a fixed request head and parses the answer
with httptools, the parser uvicorn uses. Streaming and health probes go through aiohttp (the
``aiohttp`` client, held inside).

Connections: at most ``connections_per_engine`` per engine (callers beyond that wait, within
their timeout) and ``connections_total`` overall; idle ones are kept for ``KEEPALIVE_SECONDS``,
below uvicorn's 5 s, so a request is not written on a connection the engine is closing. If a
reused connection is closed before any byte of the answer arrives, the request is sent once more
on a new connection. A timeout or a cancellation (the client went away) closes the connection,
which the engine sees as its client going away.

The uncontended path costs no suspension besides the answer itself: a free slot is taken without
awaiting (:class:`_Slots`), and the leg's timeout is one timer on the answer's future rather
than an ``asyncio.timeout`` block (which is used only when the call must wait for a slot or a new
connection). Whether the engine keeps the connection open is read when the answer completes:
httptools' ``should_keep_alive()`` is False once the parser has moved past the message, which
made every call open a new connection before.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Final, cast
from urllib.parse import urlsplit

import httptools
from drs_protocol.fields import HEADER_WEIGHTS_VERSION
from drs_protocol.token_source import TokenSource

from drs_frontend.config import Limits
from drs_frontend.errors import UpstreamConnectError, UpstreamTimeout
from drs_frontend.upstream.aiohttp_client import AiohttpUpstream
from drs_frontend.upstream.base import Presented, UpstreamResponse, UpstreamStream

#: The engine header naming the weights version (lower-case, as compared).
WEIGHTS_HEADER: Final = HEADER_WEIGHTS_VERSION.encode()

KEEPALIVE_SECONDS: Final = 4.0
#: The head lines after a request's own headers, up to the Content-Length value.
CONTENT_HEAD: Final = b"Content-Type: application/json\r\nContent-Length: "


class _Gone(Exception):
    """The connection closed before the answer was complete (``early``: before any byte of it)."""

    def __init__(self, early: bool) -> None:
        super().__init__("connection closed by the engine")
        self.early = early


class _Connection(asyncio.Protocol):
    """One TCP connection and its response parser; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.idle_since = 0.0
        self.body: list[bytes] = []
        self.content_type = b""
        self.weights_version = b""
        self.got_bytes = False
        self.keep_alive = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamConnectError(f"malformed HTTP answer: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(_Gone(early=not self.got_bytes))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-type":
            self.content_type = value
        elif lowered == WEIGHTS_HEADER:
            self.weights_version = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # False once the parser moves on
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _timed_out(self) -> None:
        self._fail(TimeoutError())
        self.close()

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def exchange(self, request: bytes, deadline: float) -> UpstreamResponse:
        """Write ``request`` and wait for the whole answer until ``deadline`` (loop time: then
        TimeoutError, and the connection is closed)."""
        assert self.transport is not None
        self.body = []
        self.content_type = b""
        self.weights_version = b""
        self.got_bytes = False
        self.keep_alive = False
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        timer = loop.call_at(deadline, self._timed_out)
        try:
            self.transport.write(request)
            await self.waiter
        finally:
            timer.cancel()
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        status = self.parser.get_status_code()
        if not self.keep_alive:
            self.close()
        version = self.weights_version.decode("latin-1") or None
        return UpstreamResponse(status, self.content_type.decode("latin-1") or "application/json", body, version)


class _Slots:
    """A counting semaphore whose uncontended :meth:`take` never suspends (``asyncio.Semaphore``
    on 3.11 builds a generator in ``locked()`` on every acquire). Waiters are served in order."""

    __slots__ = ("free", "waiters")

    def __init__(self, size: int) -> None:
        self.free = size
        self.waiters: deque[asyncio.Future[None]] = deque()

    def try_take(self) -> bool:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return True
        return False

    async def take(self) -> None:
        if self.try_take():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.give()  # handed a slot, then cancelled: pass it on
            raise

    def give(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1


@dataclass
class _Engine:
    """The connections to one engine (``host:port``)."""

    host: str
    port: int
    slots: _Slots
    idle: list[_Connection] = field(default_factory=list)


class RawUpstream:
    def __init__(self, *, connect_timeout: float, limits: Limits, tokens: TokenSource | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.limits = limits
        #: header lines sent with every request (the serving token's ``authorization`` of the
        #: moment: the cached request heads are dropped when it changes)
        self.presented = Presented(tokens)
        self._engines: dict[str, _Engine] = {}
        self._targets: dict[str, tuple[_Engine, bytes]] = {}
        self._total = _Slots(limits.connections_total)
        self._other = AiohttpUpstream(connect_timeout=connect_timeout, limits=limits, tokens=tokens)

    async def start(self) -> None:
        await self._other.start()

    async def close(self) -> None:
        for engine in self._engines.values():
            for conn in engine.idle:
                conn.close()
            engine.idle.clear()
        await self._other.close()

    def _target(self, url: str) -> tuple[_Engine, bytes]:
        """The engine of ``url`` and the request head up to its own headers (cached; dropped when
        the presented token changes)."""
        if self.presented.changed():
            self._targets.clear()
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or parts.hostname is None:
                raise UpstreamConnectError(f"{url}: the raw client speaks plain http only")
            port = parts.port or 80
            key = f"{parts.hostname}:{port}"
            engine = self._engines.get(key)
            if engine is None:
                slots = _Slots(self.limits.connections_per_engine)
                engine = self._engines[key] = _Engine(parts.hostname, port, slots)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            extra = "".join(f"{name}: {value}\r\n" for name, value in self.presented.auth.items())
            head = f"POST {path} HTTP/1.1\r\nHost: {key}\r\n{extra}"
            target = self._targets[url] = (engine, head.encode("latin-1"))
        return target

    async def _connect(self, engine: _Engine) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(_Connection, engine.host, engine.port)
        except TimeoutError as exc:
            raise UpstreamTimeout(
                f"{engine.host}:{engine.port}: no connection within {self.connect_timeout:g}s"
            ) from exc
        except OSError as exc:
            raise UpstreamConnectError(f"{engine.host}:{engine.port}: {exc}") from exc
        return conn

    def _idle_connection(self, engine: _Engine) -> _Connection | None:
        now = time.monotonic()
        while engine.idle:
            conn = engine.idle.pop()
            if not conn.closed and now - conn.idle_since < KEEPALIVE_SECONDS:
                return conn
            conn.close()
        return None

    async def _take_slots(self, engine: _Engine, deadline: float) -> None:
        """One of the engine's connection slots and one of the total, waiting at most until ``deadline``."""
        if engine.slots.try_take():
            if self._total.try_take():
                return
            try:
                async with asyncio.timeout_at(deadline):
                    await self._total.take()
            except BaseException:
                engine.slots.give()
                raise
            return
        async with asyncio.timeout_at(deadline):
            await engine.slots.take()
            try:
                await self._total.take()
            except BaseException:
                engine.slots.give()
                raise

    async def post_json(
        self, url: str, body: bytes, timeout: float, headers: Mapping[str, str] | None = None
    ) -> UpstreamResponse:
        engine, head = self._target(url)
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items()).encode("latin-1")
        request = head + extra + CONTENT_HEAD + str(len(body)).encode() + b"\r\n\r\n" + body
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            await self._take_slots(engine, deadline)
            try:
                conn = self._idle_connection(engine)
                if conn is not None:
                    try:
                        response = await _exchange(conn, request, deadline)
                    except _Gone as gone:
                        if not gone.early:
                            raise UpstreamConnectError(f"{url}: connection closed mid-answer") from None
                        conn = None  # a stale keep-alive connection: once more on a new one
                if conn is None:
                    async with asyncio.timeout_at(deadline):
                        conn = await self._connect(engine)
                    try:
                        response = await _exchange(conn, request, deadline)
                    except _Gone:
                        raise UpstreamConnectError(f"{url}: connection closed before the answer was complete") from None
            finally:
                engine.slots.give()
                self._total.give()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"{url}: no answer within {timeout:g}s") from exc
        if not conn.closed:
            conn.idle_since = time.monotonic()
            engine.idle.append(conn)
        return response

    def stream_json(
        self, url: str, body: bytes, timeout: float, headers: Mapping[str, str] | None = None
    ) -> AbstractAsyncContextManager[UpstreamStream]:
        return self._other.stream_json(url, body, timeout, headers)

    async def get(self, url: str, timeout: float) -> UpstreamResponse:
        return await self._other.get(url, timeout)


async def _exchange(conn: _Connection, request: bytes, deadline: float) -> UpstreamResponse:
    try:
        return await conn.exchange(request, deadline)
    except _Gone:
        raise
    except BaseException:
        conn.close()  # mid-request (timeout, cancellation): the engine sees its client leave
        raise
