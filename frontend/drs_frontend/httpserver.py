"""The frontend's HTTP/1.1 server: asyncio protocols and httptools, one handler coroutine per request.

Chosen over uvicorn by measurement (``bench/relay.py``, variant ``uvicorn+raw``): the relay's own
work per turn is small, so the ASGI layer (a scope dict, message dicts for every receive and
send, a response-cycle object, a watcher for client disconnects) was a measurable share of the
frontend's CPU. This server parses with httptools (the parser uvicorn uses), hands the handler a
:class:`Request` whose body is complete, and writes the :class:`Response` head and body in one
``write``.

What it does, as a production server must:

* keep-alive (HTTP/1.1 default, HTTP/1.0 on request), pipelined requests answered in order
  (reading pauses while ``MAX_PIPELINED`` wait), ``HEAD``, ``Expect: 100-continue``;
* bounds: a body over ``max_body_bytes`` gets 413 (before it is read when Content-Length says
  so), a request head over ``MAX_HEAD_BYTES`` 431, malformed HTTP 400, each with ``Connection:
  close``; an ``Upgrade`` request is answered as plain HTTP and the connection closed after it; a connection idle for ``keepalive_s`` is closed, and one that
  takes longer than ``request_read_s`` to send its request gets 408;
* a client that disconnects while its request is served cancels the handler at once (the relay
  then closes its engine connection, which the engine sees) and calls ``on_disconnect``;
* streamed responses (``Response.stream``) go out chunked, honouring the transport's write
  flow control; the stream is closed when the client goes away;
* :meth:`HttpServer.stop` stops accepting, closes idle connections, lets requests in flight
  finish for ``grace_s`` and then cancels them.

A handler that raises gets a 500 from ``error_response`` (the exception is logged); the
connection stays usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final, cast

import httptools
from drs_protocol.limits import MAX_REQUEST_HEAD_BYTES

log = logging.getLogger(__name__)

#: Request line plus headers; more gets 431 (uvicorn has no such bound; h11's is 16 KiB). A
#: conversation id may come from a header: the engines' body limit allows for it (drs_protocol.limits).
MAX_HEAD_BYTES: Final = MAX_REQUEST_HEAD_BYTES
#: Requests parsed ahead of the one being answered on a connection before reading pauses.
MAX_PIPELINED: Final = 16

_REASONS: Final = {s.value: s.phrase.encode() for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
    return line


@dataclass(slots=True)
class Request:
    method: str
    path: str  #: without the query string
    headers: list[tuple[bytes, bytes]]  #: names lower-cased, in the order received
    body: bytes


@dataclass(slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: bytes = b"application/json"
    headers: Sequence[tuple[bytes, bytes]] = ()
    #: chunks sent with chunked transfer encoding instead of ``body``; closed when done or abandoned
    stream: AsyncIterator[bytes] | None = None


Handler = Callable[[Request], Awaitable[Response]]
#: ``error_response(status, message)``: the answer the server itself gives (413, 400, 500…).
ErrorResponse = Callable[[int, str], Response]


#: How long an idle client connection is kept open. Longer than the pools of the clients that call
#: a frontend (aiohttp, NeMo-Gym's client, keeps idle connections 15 s; httpx 5 s), so the client,
#: not the server, closes an idle connection: a server that closes first races the client's next
#: request on that connection, which then fails with a reset (a POST is not retried). 75 s is
#: nginx's default.
IDLE_KEEPALIVE_S = 75.0


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_body_bytes: int
    keepalive_s: float = IDLE_KEEPALIVE_S
    request_read_s: float = 60.0
    grace_s: float = 5.0
    sweep_s: float = 1.0  #: how often idle and slow connections are looked for


class HttpServer:
    """``await server.start(sock)`` serves ``handler`` on a listening socket until :meth:`stop`."""

    def __init__(
        self,
        handler: Handler,
        *,
        limits: ServerLimits,
        error_response: ErrorResponse,
        on_disconnect: Callable[[], None] | None = None,
    ) -> None:
        self.handler = handler
        self.limits = limits
        self.error_response = error_response
        self.on_disconnect = on_disconnect or (lambda: None)
        self.connections: set[_Connection] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), sock=sock)
        self._sweeper = loop.create_task(self._sweep(), name="http-sweeper")

    async def stop(self) -> None:
        """Stop accepting; finish requests in flight within ``grace_s``, then cancel them."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.connections):
            if conn.idle():
                conn.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.grace_s
        while any(conn.task is not None for conn in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await self._server.wait_closed()

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.limits.sweep_s)
            now = loop.time()
            for conn in list(self.connections):
                conn.sweep(now)


class _Connection(asyncio.Protocol):
    """One client connection: parser state, the request being read, the one being answered."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.task: asyncio.Task[None] | None = None  #: answering ``self.current``
        self.queue: deque[tuple[Request, bool]] = deque()  #: pipelined (request, keep_alive)
        self.last_active = self.loop.time()
        self.write_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        #: a request was refused: nothing more is parsed (``lingering``: but its body is read to its end)
        self.rejected = False
        self.lingering = False
        self._reset()

    def _reset(self) -> None:
        self.reading = False  #: inside a request (its first byte arrived, its last not yet)
        self.started = 0.0
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.body: list[bytes] = []
        self.body_bytes = 0

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.last_active = self.loop.time()
        if self.closed or (self.rejected and not self.lingering):
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # RFC 9110 7.8: a server may ignore Upgrade. The request was parsed and is answered
            # as plain HTTP; what follows it is not HTTP/1.1, so the connection closes after.
            if self.task is None:
                self._reject(400, "protocol upgrades are not supported")
            else:
                self.rejected = True
                self.queue.clear()
        except httptools.HttpParserError as exc:
            if self.rejected:
                self.close()
            else:
                self._reject(400, f"malformed HTTP request: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.queue.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()
            self.server.on_disconnect()
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_exception(ConnectionResetError("client disconnected"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_result(None)

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.rejected:
            return  # a request pipelined behind a refused one is not served
        self._reset()
        self.reading = True
        self.started = self.last_active

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))
        self._count_head(len(name) + len(value))

    def on_headers_complete(self) -> None:
        if self.rejected:
            return
        length = -1
        expect = False
        for name, value in self.headers:
            if name == b"content-length":
                length = int(value) if value.isdigit() else -1
            elif name == b"expect" and value.lower() == b"100-continue":
                expect = True
        limit = self.server.limits.max_body_bytes
        if length > limit:
            self._reject(413, f"request body of {length} bytes exceeds {limit}", linger=True)
        elif expect and self.transport is not None:
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        if self.rejected:
            return
        self.body_bytes += len(body)
        if self.body_bytes > self.server.limits.max_body_bytes:
            self._reject(413, f"request body exceeds {self.server.limits.max_body_bytes} bytes", linger=True)
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.rejected:
            if self.lingering:
                self.close()  # the rejected body is read to its end: the client has our answer
            return
        self.reading = False
        try:
            path = httptools.parse_url(self.url).path.decode("latin-1")
        except httptools.HttpParserInvalidURLError:
            self._reject(400, "malformed request target")
            return
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        request = Request(self.parser.get_method().decode("latin-1"), path, self.headers, body)
        keep_alive = bool(self.parser.should_keep_alive()) and not self.server.stopping
        if self.task is None:
            self.task = self.loop.create_task(self._answer(request, keep_alive))
        else:
            self.queue.append((request, keep_alive))
            if len(self.queue) >= MAX_PIPELINED and self.transport is not None:
                self.transport.pause_reading()

    def _count_head(self, size: int) -> None:
        self.head_bytes += size
        if self.head_bytes > MAX_HEAD_BYTES and not self.rejected:
            self._reject(431, f"request head exceeds {MAX_HEAD_BYTES} bytes")

    # -- answering -------------------------------------------------------------------------------

    async def _answer(self, request: Request, keep_alive: bool) -> None:
        while True:
            try:
                response = await self.server.handler(request)
            except Exception:
                log.exception("handler failed on %s %s", request.method, request.path)
                response = self.server.error_response(500, "internal error in the frontend")
            if self.closed:
                await _close_stream(response)
                return
            keep_alive = keep_alive and not self.server.stopping and not self.rejected
            try:
                await self._write(request, response, keep_alive)
            except ConnectionError:
                return
            if not keep_alive or self.rejected:
                self.close()
                return
            self.last_active = self.loop.time()
            if not self.queue:
                self.task = None
                return
            request, keep_alive = self.queue.popleft()
            if self.transport is not None and len(self.queue) < MAX_PIPELINED // 2:
                self.transport.resume_reading()

    async def _write(self, request: Request, response: Response, keep_alive: bool) -> None:
        transport = self.transport
        assert transport is not None
        head = [_status_line(response.status), b"content-type: ", response.content_type, b"\r\n"]
        for name, value in response.headers:
            head += (name, b": ", value, b"\r\n")
        if not keep_alive:
            head.append(b"connection: close\r\n")
        stream = response.stream
        if stream is None:
            head += (b"content-length: ", b"%d" % len(response.body), b"\r\n\r\n")
            if request.method != "HEAD":
                head.append(response.body)
            transport.write(b"".join(head))
            return
        chunked = self.parser.get_http_version() != "1.0"
        if chunked:
            head.append(b"transfer-encoding: chunked\r\n")
        elif keep_alive:
            head.append(b"connection: close\r\n")  # HTTP/1.0: the end of the body is the close
        head.append(b"\r\n")
        transport.write(b"".join(head))
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            if request.method == "HEAD":
                return
            async for chunk in stream:
                if not chunk:
                    continue
                if self.closed:
                    raise ConnectionResetError("client disconnected")
                transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                if self.write_paused:
                    await self._drain()
            if chunked:
                transport.write(b"0\r\n\r\n")
        if not chunked:
            self.close()

    async def _drain(self) -> None:
        self.drain_waiter = self.loop.create_future()
        try:
            await self.drain_waiter
        finally:
            self.drain_waiter = None

    def _reject(self, status: int, message: str, *, linger: bool = False) -> None:
        """Answer ``status`` now and close. ``linger``: the request is well-formed but its body is
        refused; read (and drop) the rest of it before closing, at most ``request_read_s``, since
        closing a socket with unread bytes resets it and the client would never see the answer."""
        self.rejected = True
        self.queue.clear()
        if self.task is not None:
            return  # still answering an earlier request: just close after it (rare; pipelined garbage)
        self.lingering = linger
        response = self.server.error_response(status, message)
        if self.transport is not None and not self.closed:
            head = b"%scontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % (
                _status_line(status),
                response.content_type,
                len(response.body),
            )
            self.transport.write(head + response.body)
        if not linger:
            self.close()

    # -- lifecycle -------------------------------------------------------------------------------

    def idle(self) -> bool:
        return self.task is None and not self.reading

    def sweep(self, now: float) -> None:
        if self.lingering:
            if now - self.started > self.server.limits.request_read_s:
                self.close()
        elif self.idle():
            if now - self.last_active > self.server.limits.keepalive_s:
                self.close()
        elif self.reading and self.task is None and now - self.started > self.server.limits.request_read_s:
            self._reject(408, f"request not received within {self.server.limits.request_read_s:g}s")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def abort(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


async def _close_stream(response: Response) -> None:
    if response.stream is not None:
        aclose = getattr(response.stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
