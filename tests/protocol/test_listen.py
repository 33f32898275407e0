"""``drs_protocol.listen.bind_socket``: the listening socket every server binds first.

The connections a server accepts on it must not wait on Nagle's algorithm on asyncio's own event loop
(the engines and frontends of the benchmarks and tests, a gang's rank workers): a two-write answer
otherwise waits for the client's delayed ACK, ~40 ms per answer on Linux loopback (issue 27's lookups).
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from drs_protocol.listen import BindError, bind_socket


class _Answer(asyncio.Protocol):
    """Answers each request in two writes, as uvicorn writes a head and a body; notes the socket's TCP_NODELAY."""

    def __init__(self, nodelay: list[int]) -> None:
        self.nodelay = nodelay

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        self.nodelay.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    def data_received(self, data: bytes) -> None:
        assert isinstance(self.transport, asyncio.Transport)
        self.transport.write(b"head;")
        self.transport.write(b"body")


def test_the_socket_is_tcp_with_nodelay() -> None:
    sock = bind_socket("127.0.0.1", 0, what="test", backlog=8)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        sock.close()


async def test_connections_accepted_on_the_stdlib_loop_have_nodelay() -> None:
    """asyncio's loop (not uvloop) sets TCP_NODELAY only where the socket says IPPROTO_TCP."""
    assert not type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    nodelay: list[int] = []
    sock = bind_socket("127.0.0.1", 0, what="test", backlog=8)
    server = await asyncio.get_running_loop().create_server(lambda: _Answer(nodelay), sock=sock)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        writer.write(b"ask")
        assert await reader.readexactly(len(b"head;body")) == b"head;body"
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()
    assert len(nodelay) == 1
    assert nodelay[0] != 0


def test_a_taken_port_names_what_wanted_it() -> None:
    first = bind_socket("127.0.0.1", 0, what="engine", backlog=8)
    try:
        first_port = first.getsockname()[1]
        # SO_REUSEADDR lets a second socket bind a port only while nobody listens on it
        with pytest.raises(BindError, match=f"engine port 127.0.0.1:{first_port}"):
            bind_socket("127.0.0.1", first_port, what="engine", backlog=8)
    finally:
        first.close()
