"""Running an engine server: bind first, then serve — never a half-alive process.

The listening socket is bound before anything else happens (before the model loads, before
uvicorn starts); if the port is taken the process exits non-zero at once naming it, instead of
loading a model that no one can reach (or, worse, leaving a process that looks alive while another
one answers its health checks). :func:`start_engine` runs a server inside the current event loop,
for tests and benchmarks that need several real engines on loopback in one process.
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

from drs_engine.config import EngineConfig
from drs_engine.server.app import create_app

#: How long :func:`start_engine` waits for a server to load and listen.
STARTUP_TIMEOUT_S: Final = 60.0
BACKLOG: Final = 2048


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` for this server (``port`` 0: any free port), or :class:`BindError`."""
    return listen.bind_socket(host, port, what="engine", backlog=BACKLOG)


def uvicorn_server(config: EngineConfig, control_token: str | None, *, log_level: str = "info") -> uvicorn.Server:
    app = create_app(config, control_token=control_token)
    uv_config = uvicorn.Config(app, lifespan="on", log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
    return uvicorn.Server(uv_config)


@dataclass
class RunningEngine:
    """An engine server running in this event loop."""

    config: EngineConfig
    url: str
    server: uvicorn.Server
    task: asyncio.Task[None]


async def _serve(server: uvicorn.Server, sock: socket.socket, port: int) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:  # uvicorn's way of reporting a failed startup; keep it in this task
        raise RuntimeError(f"engine on port {port} failed to start (exit status {exc.code})") from exc


@contextlib.asynccontextmanager
async def start_engine(
    config: EngineConfig, *, control_token: str | None = None, log_level: str = "warning"
) -> AsyncIterator[RunningEngine]:
    """Serve ``config`` (``port`` 0 picks a free port) until the block exits."""
    sock = bind_socket(config.host, config.port)
    port = sock.getsockname()[1]
    config = config.model_copy(update={"port": port})
    server = uvicorn_server(config, control_token, log_level=log_level)
    task = asyncio.create_task(_serve(server, sock, port))
    try:
        async with asyncio.timeout(STARTUP_TIMEOUT_S):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError(f"engine on port {port} stopped during startup")
                await asyncio.sleep(0.01)
        yield RunningEngine(config=config, url=config.resolved_advertise_url(), server=server, task=task)
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close()
