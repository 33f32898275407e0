"""``drs sidecar``: the trainer's refit sidecar for one DisaggReplicaSet.

In Kubernetes: ``drs sidecar --name NAME --namespace NS`` (in-cluster config or KUBECONFIG; the
control token from ``--control-token-file``, the environment (``drs_protocol.env.CONTROL_TOKEN``)
or the resource's Secret).
Outside it: ``drs sidecar --engine URL --engine URL … --control-token-file F``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import click
import uvloop
from drs_protocol import env
from drs_protocol.cutover import DEFAULT_CUTOVER_MARGIN_S, MAX_CUTOVER_MARGIN_S, MIN_CUTOVER_MARGIN_S
from drs_protocol.limits import DEFAULT_COLLECTIVE_TIMEOUT_S, MAX_COLLECTIVE_TIMEOUT_S, MAX_WEIGHTS_TARGET_LEASE_S
from drs_protocol.token_source import TokenSource, token_source

from drs_sidecar.targets import DEFAULT_LEASE_S

EXIT_BIND_FAILED = 1


@click.command(name="sidecar")
@click.option("--name", default=None, help="The DisaggReplicaSet whose engines to refit.")
@click.option("--namespace", default=None, help="Its namespace (default: the pod's, else 'default').")
@click.option("--engine", "engines", multiple=True, help="An engine base URL instead of --name (repeat).")
@click.option("--control-token-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option("--host", default="127.0.0.1", show_default=True, help="Listen address (the trainer is in the same pod).")
@click.option("--port", type=click.IntRange(0, 65535), default=8400, show_default=True)
@click.option(
    "--concurrency", type=click.IntRange(1, 4096), default=64, show_default=True, help="Engines called at once."
)
@click.option(
    "--load-timeout", type=click.FloatRange(min=1), default=1800.0, show_default=True, help="Seconds per load."
)
@click.option(
    "--call-timeout", type=click.FloatRange(min=0.1), default=30.0, show_default=True, help="Seconds per other call."
)
@click.option(
    "--collective-timeout",
    type=click.FloatRange(min=1, max=MAX_COLLECTIVE_TIMEOUT_S),
    default=DEFAULT_COLLECTIVE_TIMEOUT_S,
    show_default=True,
    help="Seconds one collective refit step may take, the group's abort included: past it the trainer gets "
    "502 naming the member that hung, died or failed.",
)
@click.option("--reconcile-interval", type=click.FloatRange(min=0.1), default=5.0, show_default=True)
@click.option(
    "--target-lease",
    type=click.FloatRange(min=0, max=MAX_WEIGHTS_TARGET_LEASE_S),
    default=DEFAULT_LEASE_S,
    show_default=True,
    help="Seconds an announced target weights binds an engine (it refuses new legs until it holds them), "
    "renewed while loads run; 0: announce nothing (engines not loaded yet answer at the old weights).",
)
@click.option(
    "--fold-announce/--no-fold-announce",
    default=False,
    show_default=True,
    help="A refit by checkpoint path whose ready engines fit one fan-out (--concurrency) sends each engine one "
    "call, its load carrying the target, instead of an announce round first (see docs/weights.md).",
)
@click.option(
    "--cutover-margin",
    type=click.FloatRange(min=0.0, max=MAX_CUTOVER_MARGIN_S),
    default=MIN_CUTOVER_MARGIN_S,
    show_default=True,
    help="Seconds at least between a refit's start and its cut-over (the instant its weights take effect: "
    "turns started from then on are the new weights'); the margin is twice the last refit's time until every "
    f"engine was told when that is more ({DEFAULT_CUTOVER_MARGIN_S:g}s before one was measured), at most "
    f"{MAX_CUTOVER_MARGIN_S:g}s. No engine loads before the cut-over.",
)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info")
def sidecar(
    name: str | None,
    namespace: str | None,
    engines: tuple[str, ...],
    control_token_file: Path | None,
    host: str,
    port: int,
    concurrency: int,
    load_timeout: float,
    call_timeout: float,
    collective_timeout: float,
    reconcile_interval: float,
    target_lease: float,
    cutover_margin: float,
    fold_announce: bool,
    log_level: str,
) -> None:
    """Refit every engine of a DisaggReplicaSet for the trainer, and keep restarted engines current."""
    if bool(name) == bool(engines):
        raise click.UsageError("give --name (a DisaggReplicaSet) or --engine URLs, not both and not neither")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per engine call otherwise
    from drs_protocol.listen import BindError, bind_socket

    try:
        sock = bind_socket(host, port, what="sidecar", backlog=128)
    except BindError as exc:
        click.echo(f"drs sidecar: {exc.strerror}", err=True)
        sys.exit(EXIT_BIND_FAILED)
    source = token_source(
        os.environ.get(env.CONTROL_TOKEN_DIR) or None,
        control_token_file,
        os.environ.get(env.CONTROL_TOKEN),
        "control token",
    )
    uvloop.run(  # the loop the engines (uvicorn picks it) and the frontends run on
        _run(
            sock,
            name,
            namespace,
            list(engines),
            source,
            concurrency,
            (load_timeout, call_timeout, collective_timeout),
            reconcile_interval,
            (target_lease, cutover_margin, fold_announce),
        )
    )


def _pod_namespace() -> str:
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return path.read_text().strip() if path.exists() else "default"


async def _run(
    sock: socket.socket,
    name: str | None,
    namespace: str | None,
    engines: list[str],
    source: TokenSource,
    concurrency: int,
    timeouts: tuple[float, float, float],
    reconcile_interval: float,
    targets: tuple[float, float, bool],
) -> None:
    """``timeouts``: a load's, another call's, a collective step's (seconds); ``targets``: the
    target lease and the cut-over margin (seconds)."""
    import uvicorn

    from drs_sidecar.app import build_app
    from drs_sidecar.control import ControlClient
    from drs_sidecar.errors import FleetError
    from drs_sidecar.fleet import Fleet, KubeFleet, StaticFleet
    from drs_sidecar.metrics import SidecarMetrics
    from drs_sidecar.refit import Refitter

    token = source.current or ""
    fleet: Fleet
    refresh: Callable[[], Awaitable[str]] | None = None
    if source.directory is not None:  # the control Secret mounted: read the files again on a 401
        refresh = functools.partial(_reread, source)
    if name:
        kube = await KubeFleet.connect(namespace or _pod_namespace(), name)
        if not token:
            # read from the fleet's Secret: read again when an engine refuses it (a rotation)
            refresh = kube.control_token
            try:
                token = await kube.control_token()
            except FleetError as exc:
                await kube.close()
                raise click.ClickException(
                    f"no control token: {exc} (or give --control-token-file / ${env.CONTROL_TOKEN})"
                ) from None
        fleet = kube
    else:
        if not token:
            raise click.ClickException(f"no control token: give --control-token-file or ${env.CONTROL_TOKEN}")
        fleet = StaticFleet(engines)
    load_timeout, call_timeout, collective_timeout = timeouts
    control = ControlClient(token, call_s=call_timeout, load_s=load_timeout, refresh=refresh)
    refitter = Refitter(
        fleet,
        control,
        SidecarMetrics(),
        concurrency=concurrency,
        collective_timeout_s=collective_timeout,
        target_lease_s=targets[0],
        cutover_margin_s=targets[1],
    )
    refitter.targets.fold = targets[2]  # loads carry the target (drs_sidecar.targets)
    app = build_app(refitter, reconcile_s=reconcile_interval)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    await uvicorn.Server(config).serve(sockets=[sock])


async def _reread(source: TokenSource) -> str:
    """The mounted control token as it is now (``drs_protocol.token_source``)."""
    await asyncio.to_thread(source.refresh)
    return source.current or ""
