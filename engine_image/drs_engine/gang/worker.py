"""Ranks 1..W-1 of an engine wider than a node: join the leader's Ray cluster, serve nothing else.

The process listens on the engine's port for ``/health`` only (the pod's readiness probe): 200 once
the leader's ``GET /v1/gang`` reports this rank joined in the leader's current session, 503 with
the reason before. Sequence:

1. wait until the leader answers ``/v1/gang`` (no deadline: the leader's pod may be starting);
2. ``ray start --address=<leader>:<ray port> --block`` as a child, on the pod's address, declaring
   the node slice's GPUs and this rank's resource;
3. watch every second: the child must live, the leader must stay reachable and keep its session.

When any of that fails the process exits with :data:`EXIT_GANG_LOST` (its Ray node with it): the
kubelet restarts it with back-off and an Event, and it joins the leader's next session. A rank
therefore never sits in a cluster whose engine is gone.

The leader's ``/v1/gang`` is in the serving realm: the rank presents the serving token of the
moment (:func:`leader_client` over a :class:`~drs_protocol.token_source.TokenSource` that re-reads
the mounted Secret), so a token rotation does not cut a rank off its leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import time
from typing import Any, Final

import httpx
import uvicorn
from drs_protocol import routes
from drs_protocol.auth import Realm
from drs_protocol.gang import GangReport, parse_gang_report
from drs_protocol.token_source import GENERATIONS_HEADER, TokenSource, format_generations, run_sources
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from drs_engine.gang.leader import stop_process
from drs_engine.gang.spec import EXIT_GANG_LOST, GangSpec, ray_env, worker_argv
from drs_engine.peer_auth import peer_auth

log = logging.getLogger("drs_engine.gang")

POLL_S: Final = 1.0
LEADER_TIMEOUT: Final = httpx.Timeout(2.0)
#: The leader unreachable this long after we joined: its gang is gone.
LEADER_LOST_S: Final = 10.0


class GangMember:
    """This rank's state (see the module docstring)."""

    def __init__(self, spec: GangSpec, host: str, leader_url: str) -> None:
        self.spec = spec
        self.host = host
        self.leader_url = leader_url.rstrip("/")
        self.session: str | None = None
        self.joined = False
        self.reason = f"waiting for the leader at {self.leader_url}"
        self.failure: str | None = None
        self.node: asyncio.subprocess.Process | None = None

    def view(self) -> dict[str, Any]:
        return {
            "rank": self.spec.rank,
            "world_size": self.spec.world_size,
            "leader": self.leader_url,
            "ray_address": self.spec.ray_address,
            "session": self.session,
            "joined": self.joined,
            "reason": self.reason,
        }

    async def run(self, client: httpx.AsyncClient) -> None:
        """Join and stay joined; returns (with :attr:`failure` set) when the gang is lost."""
        while self.session is None:
            report = await self._leader(client)
            if report is not None and report["phase"] != "failed":
                self.session = report["session"]
            else:
                await asyncio.sleep(POLL_S)
        argv = worker_argv(self.spec, self.host)
        log.info("gang: joining session %s: %s", self.session, " ".join(argv))
        self.reason = f"joining {self.spec.ray_address} (session {self.session})"
        self.node = await asyncio.create_subprocess_exec(
            *argv, env=ray_env(), stdin=asyncio.subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr
        )
        last_seen = time.monotonic()
        while self.failure is None:
            await asyncio.sleep(POLL_S)
            if self.node.returncode is not None:
                self.failure = f"this rank's Ray node exited with code {self.node.returncode}"
                break
            report = await self._leader(client)
            if report is None:
                if time.monotonic() - last_seen > LEADER_LOST_S:
                    self.failure = f"the leader at {self.leader_url} has not answered for {LEADER_LOST_S:.0f}s"
                continue
            last_seen = time.monotonic()
            if report["session"] != self.session or report["phase"] == "failed":
                self.failure = (
                    f"the leader's gang ended (session {self.session} -> {report['session']}, {report['reason']})"
                )
                break
            me = next((r for r in report["ranks"] if r["rank"] == self.spec.rank), None)
            self.joined = bool(me and me["joined"])
            self.reason = "joined" if self.joined else f"joining {self.spec.ray_address} (session {self.session})"
        self.joined = False
        self.reason = self.failure or "stopped"
        log.error("gang: %s; exiting so that the engine restarts as a whole", self.failure)

    async def _leader(self, client: httpx.AsyncClient) -> GangReport | None:
        try:
            response = await client.get(self.leader_url + routes.GANG, timeout=LEADER_TIMEOUT)
            if response.status_code != 200:
                return None
            return parse_gang_report(response.json())
        except (httpx.HTTPError, ValueError):
            return None


def worker_app(member: GangMember, serving_token: TokenSource | None = None) -> Starlette:
    """``/health`` (with the serving token Secret's generation this rank read, never the token) and ``/v1/gang``."""

    async def health(_: Request) -> Response:
        body = member.view()
        held = format_generations({str(Realm.SERVING): serving_token}) if serving_token is not None else ""
        headers = {GENERATIONS_HEADER: held} if held else None
        return JSONResponse(body, status_code=200 if member.joined else 503, headers=headers)

    async def gang(_: Request) -> Response:
        return JSONResponse(member.view())

    return Starlette(routes=[Route(routes.HEALTH, health), Route(routes.GANG, gang)])


def leader_client(serving_token: str | TokenSource | None) -> httpx.AsyncClient:
    """The client a rank polls its leader with: every request presents the source's token of the moment."""
    auth, headers = peer_auth(TokenSource.of(serving_token))
    return httpx.AsyncClient(trust_env=False, auth=auth, headers=headers)


async def serve_worker(
    spec: GangSpec,
    host: str,
    leader_url: str,
    sock: socket.socket,
    log_level: str,
    serving_token: str | TokenSource | None = None,
) -> int:
    """Serve ``/health`` on ``sock`` while the rank stays in its gang; the process's exit code.
    The leader's ``/v1/gang`` is in the serving realm: the rank presents ``serving_token``'s
    current token, re-read while it runs."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll of the leader otherwise
    member = GangMember(spec, host, leader_url)
    source = TokenSource.of(serving_token)
    config = uvicorn.Config(worker_app(member, source), log_level=log_level, access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    refreshing = asyncio.create_task(run_sources(source), name="tokens")
    async with leader_client(source) as client:
        membership = asyncio.create_task(member.run(client))
        done, _ = await asyncio.wait({serving, membership}, return_when=asyncio.FIRST_COMPLETED)
        if membership not in done:  # SIGTERM: uvicorn stopped serving; stop the Ray node too
            membership.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await membership
    refreshing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await refreshing
    server.should_exit = True
    await stop_process(member.node)
    with contextlib.suppress(asyncio.CancelledError):
        await serving
    return EXIT_GANG_LOST if member.failure is not None else 0
