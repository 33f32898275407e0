"""Running a frontend: bind the port first, then serve — never a half-alive process.

The listening socket is bound before anything else (before the tokenizer loads, before uvicorn
starts). If the port is taken the process exits non-zero at once naming it: a frontend that
cannot bind must not look alive while another process answers its health checks (the reference
system hit exactly that). uvicorn runs with uvloop and httptools, without access logs, and without
its proxy-headers middleware (a per-request header scan for ``X-Forwarded-*``: the frontend never
reads the client's address).
:func:`start_frontend` runs one inside the current event loop, for tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

import uvicorn
from drs_protocol import listen

from drs_frontend.asgi import FrontendApp
from drs_frontend.config import FrontendConfig

STARTUP_TIMEOUT_S: Final = 60.0
BACKLOG: Final = 4096


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` for this server (``port`` 0: any free port), or :class:`BindError`."""
    return listen.bind_socket(host, port, what="frontend", backlog=BACKLOG)


def uvicorn_server(app: FrontendApp, *, log_level: str = "info", fast: bool = True) -> uvicorn.Server:
    """``fast``: uvloop + httptools (off only where uvloop cannot replace a running loop)."""
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_level=log_level,
        access_log=False,
        proxy_headers=False,
        loop="uvloop" if fast else "asyncio",
        http="httptools",
        timeout_graceful_shutdown=5,
    )
    return uvicorn.Server(config)


@dataclass
class RunningFrontend:
    app: FrontendApp
    url: str
    server: uvicorn.Server
    task: asyncio.Task[None]


@contextlib.asynccontextmanager
async def start_frontend(
    config: FrontendConfig, *, app: FrontendApp | None = None, log_level: str = "warning"
) -> AsyncIterator[RunningFrontend]:
    """Serve ``config`` in this event loop (``port`` 0 picks a free port) until the block exits."""
    sock = bind_socket(config.host, config.port)
    port = sock.getsockname()[1]
    config = config.model_copy(update={"port": port})
    app = app or FrontendApp(config)
    server = uvicorn_server(app, log_level=log_level, fast=False)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(STARTUP_TIMEOUT_S):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError(f"frontend on port {port} stopped during startup")
                await asyncio.sleep(0.01)
        host = "127.0.0.1" if config.host in ("0.0.0.0", "") else config.host
        yield RunningFrontend(app=app, url=f"http://{host}:{port}", server=server, task=task)
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close()
