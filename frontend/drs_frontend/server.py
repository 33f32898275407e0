"""Running a frontend: bind the port first, then serve — never a half-alive process.

The listening socket is bound before anything else (before the tokenizer loads, before the
server starts). If the port is taken the process exits non-zero at once naming it: a frontend
that cannot bind must not look alive while another process answers its health checks (the
reference system hit exactly that).

:func:`serve_forever` is the process (uvloop; SIGTERM and SIGINT stop it gracefully: no new
connections, requests in flight finish within the server's grace period);
:func:`start_frontend` runs one inside the current event loop, for tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

import uvloop
from drs_protocol import listen

from drs_frontend.app import FrontendApp
from drs_frontend.config import FrontendConfig
from drs_frontend.httpserver import HttpServer

log = logging.getLogger(__name__)

BACKLOG: Final = 4096


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` for this server (``port`` 0: any free port), or :class:`BindError`."""
    return listen.bind_socket(host, port, what="frontend", backlog=BACKLOG)


async def _serve(app: FrontendApp, sock: socket.socket, started: list[bool]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await app.startup()
    server = app.server()
    try:
        await server.start(sock)
        started.append(True)
        await stop.wait()
    finally:
        await server.stop()
        await app.shutdown()


def serve_forever(app: FrontendApp, sock: socket.socket) -> bool:
    """Serve ``app`` on ``sock`` until SIGTERM/SIGINT; False if it failed before serving (startup
    raised: the exception is logged)."""
    started: list[bool] = []
    try:
        uvloop.run(_serve(app, sock, started))
    except Exception:
        if started:
            raise
        log.exception("frontend startup failed")
        return False
    return True


@dataclass
class RunningFrontend:
    app: FrontendApp
    url: str
    server: HttpServer


@contextlib.asynccontextmanager
async def start_frontend(config: FrontendConfig, *, app: FrontendApp | None = None) -> AsyncIterator[RunningFrontend]:
    """Serve ``config`` in this event loop (``port`` 0 picks a free port) until the block exits."""
    sock = bind_socket(config.host, config.port)
    port = sock.getsockname()[1]
    config = config.model_copy(update={"port": port})
    app = app or FrontendApp(config)
    await app.startup()
    server = app.server()
    try:
        await server.start(sock)
        host = "127.0.0.1" if config.host in ("0.0.0.0", "") else config.host
        yield RunningFrontend(app=app, url=f"http://{host}:{port}", server=server)
    finally:
        await server.stop()
        await app.shutdown()
        sock.close()
