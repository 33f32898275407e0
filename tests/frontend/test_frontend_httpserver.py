"""The frontend's HTTP/1.1 server (drs_frontend.httpserver) on a real socket, byte by byte.

Each test serves a small handler and talks to it with raw bytes over asyncio streams, so what is
checked is the wire: keep-alive, pipelining, HEAD, 100-continue, HTTP/1.0, chunked bodies both
ways, the size and time bounds, disconnect cancellation and graceful stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from drs_frontend.httpserver import HttpServer, Request, Response, ServerLimits
from drs_frontend.server import bind_socket
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MAX_BODY = 4096


@dataclass
class Served:
    server: HttpServer
    port: int
    seen: list[Request] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    disconnects: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


def error_response(status: int, message: str) -> Response:
    return Response(status, json.dumps({"error": {"message": message, "code": status}}).encode())


@contextlib.asynccontextmanager
async def serving(**limits: float) -> AsyncIterator[Served]:
    sock = bind_socket("127.0.0.1", 0)
    served: Served

    async def handler(request: Request) -> Response:
        served.seen.append(request)
        try:
            if request.path == "/echo":
                return Response(200, request.body, b"text/plain", [(b"x-method", request.method.encode())])
            if request.path == "/wait":
                await served.release.wait()
                return Response(200, b"released")
            if request.path == "/slow":
                await asyncio.sleep(float(request.body or b"0.05"))
                return Response(200, request.body)
            if request.path == "/boom":
                raise RuntimeError("handler bug")
            if request.path == "/stream":
                return Response(200, content_type=b"text/event-stream", stream=chunks(int(request.body or b"3")))
            return error_response(404, f"no route {request.path}")
        except asyncio.CancelledError:
            served.cancelled.append(request.path)
            raise

    def on_disconnect() -> None:
        served.disconnects += 1

    server = HttpServer(
        handler,
        limits=ServerLimits(max_body_bytes=MAX_BODY, **limits),
        error_response=error_response,
        on_disconnect=on_disconnect,
    )
    served = Served(server, sock.getsockname()[1])
    await server.start(sock)
    try:
        yield served
    finally:
        served.release.set()
        await server.stop()
        sock.close()


async def chunks(n: int) -> AsyncIterator[bytes]:
    for i in range(n):
        yield f"data: {i}\n\n".encode()
        await asyncio.sleep(0)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


async def read_answer(reader: asyncio.StreamReader, *, head_only: bool = False) -> Answer:
    """One response off the wire: Content-Length, chunked, or read-to-close bodies."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if line)}
    if head_only or status == 100:
        return Answer(status, headers, b"")
    if "content-length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 5)
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 5))[:-2], 16)
            data = await asyncio.wait_for(reader.readexactly(size + 2), 5)
            if size == 0:
                break
            body += data[:-2]
    else:
        body = await asyncio.wait_for(reader.read(), 5)
    return Answer(status, headers, body)


def post(path: str, body: bytes, *extra: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: t", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), 5) == b""
    except ConnectionResetError:
        return True


async def test_keep_alive_serves_many_requests_on_one_connection() -> None:
    async with serving() as served:
        reader, writer = await served.connect()
        for i in range(5):
            writer.write(post("/echo?x=1", f"body {i}".encode()))
            answer = await read_answer(reader)
            assert (answer.status, answer.body) == (200, f"body {i}".encode())
            assert answer.headers["content-type"] == "text/plain"
            assert answer.headers["x-method"] == "POST"
            assert "connection" not in answer.headers
        assert [r.path for r in served.seen] == ["/echo"] * 5  # the query string is not the path
        writer.close()


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with serving() as served:
        reader, writer = await served.connect()
        # the first takes longest: answers must still come back in request order
        writer.write(post("/slow", b"0.1") + post("/slow", b"0.01") + post("/echo", b"third"))
        bodies = [(await read_answer(reader)).body for _ in range(3)]
        assert bodies == [b"0.1", b"0.01", b"third"]
        writer.close()


async def test_head_gets_headers_without_a_body_and_the_connection_stays_in_step() -> None:
    async with serving() as served:
        reader, writer = await served.connect()
        writer.write(b"HEAD /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        answer = await read_answer(reader, head_only=True)
        assert answer.status == 200 and answer.headers["content-length"] == "0"
        writer.write(post("/echo", b"next"))
        assert (await read_answer(reader)).body == b"next"
        writer.close()


async def test_expect_100_continue_gets_an_interim_answer_before_the_body() -> None:
    async with serving() as served:
        reader, writer = await served.connect()
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert (await read_answer(reader)).status == 100
        writer.write(b"hello")
        assert (await read_answer(reader)).body == b"hello"
        writer.close()


async def test_http_1_0_closes_after_the_answer_unless_keep_alive_is_asked() -> None:
    async with serving() as served:
        reader, writer = await served.connect()
        writer.write(b"POST /echo HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi")
        answer = await read_answer(reader)
        assert (answer.body, answer.headers["connection"]) == (b"hi", "close")
        assert await closed(reader)
        reader, writer = await served.connect()
        writer.write(b"POST /echo HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nhi")
        assert (await read_answer(reader)).body == b"hi"
        writer.write(b"POST /echo HTTP/1.0\r\nContent-Length: 3\r\n\r\nbye")
        assert (await read_answer(reader)).body == b"bye"
        writer.close()


async def test_a_chunked_request_body_arrives_whole() -> None:
    async with serving() as served:
        reader, writer = await served.connect()
        writer.write(
            b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        )
        assert (await read_answer(reader)).body == b"hello world"
        writer.close()


async def test_a_streamed_answer_is_chunked_and_the_connection_is_reused() -> None:
    async with serving() as served:
        reader, writer = await served.connect()
        writer.write(post("/stream", b"4"))
        answer = await read_answer(reader)
        assert answer.headers["transfer-encoding"] == "chunked"
        assert answer.body == b"".join(f"data: {i}\n\n".encode() for i in range(4))
        writer.write(post("/echo", b"after"))
        assert (await read_answer(reader)).body == b"after"
        writer.close()


async def test_a_body_announced_over_the_limit_gets_413_before_it_is_sent() -> None:
    async with serving() as served:
        reader, writer = await served.connect()
        writer.write(f"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode())
        answer = await read_answer(reader)
        assert answer.status == 413 and answer.headers["connection"] == "close"
        assert f"exceeds {MAX_BODY}" in json.loads(answer.body)["error"]["message"]
        assert served.seen == []  # the handler never saw it


async def test_a_body_over_the_limit_is_read_to_its_end_so_the_client_sees_413() -> None:
    async with serving() as served:
        reader, writer = await served.connect()
        body = b"x" * (MAX_BODY * 50)  # the client writes all of it before reading
        writer.write(post("/echo", body))
        await writer.drain()
        assert (await read_answer(reader)).status == 413
        assert await closed(reader)
        reader, writer = await served.connect()  # the server goes on serving
        writer.write(post("/echo", b"ok"))
        assert (await read_answer(reader)).body == b"ok"
        writer.close()


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        pytest.param(b"NOT HTTP AT ALL\r\n\r\n", 400, id="garbage"),
        pytest.param(b"POST /echo HTTP/1.1\r\nContent-Length: x\r\n\r\n", 400, id="a bad Content-Length"),
        pytest.param(b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431, id="a 70 kB header"),
    ],
)
async def test_bad_http_gets_a_4xx_and_a_closed_connection_and_the_server_goes_on(raw: bytes, status: int) -> None:
    async with serving() as served:
        reader, writer = await served.connect()
        writer.write(raw)
        answer = await read_answer(reader)
        assert answer.status == status and answer.headers["connection"] == "close"
        assert "message" in json.loads(answer.body)["error"]
        assert await closed(reader)
        reader, writer = await served.connect()
        writer.write(post("/echo", b"still here"))
        assert (await read_answer(reader)).body == b"still here"
        writer.close()


async def test_an_upgrade_request_is_answered_as_plain_http_and_the_connection_closed() -> None:
    async with serving() as served:
        reader, writer = await served.connect()
        writer.write(b"GET /echo HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
        answer = await read_answer(reader)
        assert (answer.status, answer.headers["x-method"], answer.headers["connection"]) == (200, "GET", "close")
        assert await closed(reader)


async def test_a_handler_that_raises_gets_500_and_the_connection_stays_usable() -> None:
    async with serving() as served:
        reader, writer = await served.connect()
        writer.write(post("/boom", b""))
        assert (await read_answer(reader)).status == 500
        writer.write(post("/echo", b"fine"))
        assert (await read_answer(reader)).body == b"fine"
        writer.close()


async def test_a_client_that_disconnects_cancels_its_handler_at_once() -> None:
    async with serving() as served:
        _reader, writer = await served.connect()
        writer.write(post("/wait", b""))
        while not served.seen:
            await asyncio.sleep(0.005)
        writer.close()
        for _ in range(200):
            if served.cancelled:
                break
            await asyncio.sleep(0.005)
        assert served.cancelled == ["/wait"]
        assert served.disconnects == 1


async def test_an_idle_connection_is_closed_after_the_keep_alive_time() -> None:
    async with serving(keepalive_s=0.2, sweep_s=0.05) as served:
        reader, writer = await served.connect()
        writer.write(post("/echo", b"x"))
        await read_answer(reader)
        assert await closed(reader)
        assert served.server.connections == set()


async def test_a_request_that_never_finishes_arriving_gets_408() -> None:
    async with serving(request_read_s=0.2, sweep_s=0.05) as served:
        reader, writer = await served.connect()
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\nonly part")
        answer = await read_answer(reader)
        assert answer.status == 408
        assert await closed(reader)


async def test_stop_lets_a_request_in_flight_finish_and_refuses_new_connections() -> None:
    async with serving(grace_s=5.0) as served:
        reader, writer = await served.connect()
        idle_reader, _ = await served.connect()
        writer.write(post("/slow", b"0.3"))
        while not served.seen:
            await asyncio.sleep(0.005)
        stopping = asyncio.create_task(served.server.stop())
        answer = await read_answer(reader)
        assert (answer.status, answer.body, answer.headers["connection"]) == (200, b"0.3", "close")
        assert await closed(idle_reader)
        await stopping
        with pytest.raises(OSError):
            await served.connect()


async def test_stop_cancels_what_is_still_running_after_the_grace_period() -> None:
    async with serving(grace_s=0.2) as served:
        reader, writer = await served.connect()
        writer.write(post("/wait", b""))
        while not served.seen:
            await asyncio.sleep(0.005)
        await asyncio.wait_for(served.server.stop(), 3)
        assert served.cancelled == ["/wait"]
        assert await closed(reader)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bodies=st.lists(st.binary(max_size=300), min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30),
    chunked=st.booleans(),
)
def test_requests_split_anywhere_on_the_wire_are_answered_whole_and_in_order(
    bodies: list[bytes], cuts: list[int], chunked: bool
) -> None:
    """However TCP cuts a run of pipelined requests (Content-Length or chunked bodies), each
    is answered once, whole, in order, on the one connection."""

    def request(body: bytes) -> bytes:
        if not chunked:
            return post("/echo", body)
        head = b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        return head + (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"

    wire = b"".join(request(body) for body in bodies)

    async def scenario() -> None:
        async with serving() as served:
            reader, writer = await served.connect()
            position, turn = 0, 0
            while position < len(wire):
                size = cuts[turn % len(cuts)]
                writer.write(wire[position : position + size])
                await writer.drain()
                await asyncio.sleep(0.0005)  # let each piece arrive as its own read
                position, turn = position + size, turn + 1
            answers = [await read_answer(reader) for _ in bodies]
            assert [a.body for a in answers] == bodies
            assert [r.body for r in served.seen] == bodies
            writer.close()

    asyncio.run(scenario())


async def test_many_concurrent_connections_each_get_their_own_answers() -> None:
    async with serving() as served:

        async def client(n: int) -> list[bytes]:
            reader, writer = await served.connect()
            got = []
            for i in range(3):  # a short wait first, so the connections overlap; then two echoes
                writer.write(post("/slow", f"0.0{n % 5}".encode()) if i == 0 else post("/echo", f"{n}-{i}".encode()))
                got.append((await read_answer(reader)).body)
            writer.close()
            return got

        results = await asyncio.gather(*(client(n) for n in range(200)))
        for n, got in enumerate(results):
            assert got[0] == f"0.0{n % 5}".encode()
            assert got[1:] == [f"{n}-1".encode(), f"{n}-2".encode()]


async def test_a_request_pipelined_behind_a_refused_one_is_not_served() -> None:
    async with serving() as served:
        reader, writer = await served.connect()
        too_big = post("/echo", b"x" * (MAX_BODY + 1))  # refused with 413, its body read and dropped
        writer.write(too_big + post("/echo", b"smuggled"))  # one write: both arrive in one read
        assert (await read_answer(reader)).status == 413
        assert await closed(reader)
        await asyncio.sleep(0.05)
        assert served.seen == [], "nothing after the refused request reached the handler"
