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
import logging
import signal
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import uvicorn
from drs_protocol import listen
from drs_protocol.token_source import TokenSource
from drs_protocol.weights_state import DesiredWeights

from drs_engine.config import EngineConfig
from drs_engine.gang.spec import GangSpec
from drs_engine.server.app import create_app
from drs_engine.server.state import EngineState
from drs_engine.weights.desired import Peers

log = logging.getLogger("drs_engine")

#: How long :func:`start_engine` waits for a server to load and listen.
STARTUP_TIMEOUT_S: Final = 60.0
BACKLOG: Final = 2048


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` for this server (``port`` 0: any free port), or :class:`BindError`."""
    return listen.bind_socket(host, port, what="engine", backlog=BACKLOG)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM drains before the server stops.

    Draining (``EngineState.drain``): ``/health`` and new legs answer 503 ``draining`` at once,
    while the socket stays open, so a decode engine can still fetch the context states this engine
    holds and every leg in flight finishes; after ``drain_seconds`` at most, uvicorn's own graceful
    shutdown runs. A second signal (or SIGINT) stops at once, as plain uvicorn does."""

    def __init__(self, config: uvicorn.Config, state: EngineState, drain_seconds: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_seconds = drain_seconds
        self._drain_requested = False
        self._drain: asyncio.Task[int] | None = None

    def handle_exit(self, sig: int, frame: object) -> None:
        if sig == signal.SIGTERM and not self._drain_requested and self.started:
            self._captured_signals.append(sig)
            self.request_drain()
            return
        super().handle_exit(sig, frame)  # type: ignore[arg-type]

    def request_drain(self) -> None:
        """Start draining as a SIGTERM would (tests, and callers embedding the server): from now on
        health and new legs answer 503; the wait for what is in flight starts on the next tick."""
        self.state.draining = True
        self._drain_requested = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain is None:
            log.info("draining: refusing new legs for up to %gs", self.drain_seconds)
            self._drain = asyncio.create_task(self.state.drain(self.drain_seconds))
        if self._drain is not None and self._drain.done():
            left = self._drain.result()
            log.info("drained (%d leg(s) or context state(s) left); stopping", left)
            return True
        return await super().on_tick(counter)


def uvicorn_server(
    config: EngineConfig,
    control_token: str | TokenSource | None,
    *,
    serving_token: str | TokenSource | None = None,
    log_level: str = "info",
    gang: GangSpec | None = None,
    desired_weights: DesiredWeights | None = None,
    weights_peers: Sequence[str] | Peers = (),
    desired_file: Path | None = None,
) -> DrainingServer:
    app = create_app(
        config,
        control_token=control_token,
        serving_token=serving_token,
        gang=gang,
        desired_weights=desired_weights,
        weights_peers=weights_peers,
        desired_file=desired_file,
    )
    uv_config = uvicorn.Config(app, lifespan="on", log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
    server = DrainingServer(uv_config, app.state.engine, config.drain_seconds)

    def stop() -> None:  # a lost gang stops at once: there is nothing left to drain to
        server.should_exit = True

    server.state.stop_server = stop
    return server


@dataclass
class RunningEngine:
    """An engine server running in this event loop."""

    config: EngineConfig
    url: str
    server: DrainingServer
    task: asyncio.Task[None]


async def _serve(server: uvicorn.Server, sock: socket.socket, port: int) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:  # uvicorn's way of reporting a failed startup; keep it in this task
        raise RuntimeError(f"engine on port {port} failed to start (exit status {exc.code})") from exc


@contextlib.asynccontextmanager
async def start_engine(
    config: EngineConfig,
    *,
    control_token: str | TokenSource | None = None,
    serving_token: str | TokenSource | None = None,
    log_level: str = "warning",
    desired_weights: DesiredWeights | None = None,
    weights_peers: Sequence[str] | Peers = (),
    desired_file: Path | None = None,
) -> AsyncIterator[RunningEngine]:
    """Serve ``config`` (``port`` 0 picks a free port) until the block exits."""
    sock = bind_socket(config.host, config.port)
    port = sock.getsockname()[1]
    config = config.model_copy(update={"port": port})
    server = uvicorn_server(
        config,
        control_token,
        serving_token=serving_token,
        log_level=log_level,
        desired_weights=desired_weights,
        weights_peers=weights_peers,
        desired_file=desired_file,
    )
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
