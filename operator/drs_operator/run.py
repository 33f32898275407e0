"""``drs operator``: run the DisaggReplicaSet operator (kopf) with metrics, probes and leader election."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading

import click
from drs_protocol import routes

DEFAULT_METRICS_PORT = 9090
DEFAULT_HEALTH_PORT = 8080
#: Client-side limits on write requests (kube/throttle.py Limits has the same defaults and why).
DEFAULT_MAX_IN_FLIGHT = 16
DEFAULT_QPS = 100.0
DEFAULT_BURST = 200


@dataclasses.dataclass
class Options:
    workers: int
    resync_s: float
    leader_election: bool
    lease_namespace: str
    watch_timeout_s: int
    stop_flag: threading.Event
    namespaces: tuple[str, ...] = ()
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    qps: float = DEFAULT_QPS
    burst: int = DEFAULT_BURST


@click.command(name="operator")
@click.option("-n", "--namespace", "namespaces", multiple=True, help="Namespace to watch (repeat); default: all.")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=DEFAULT_METRICS_PORT,
    show_default=True,
    help="Prometheus /metrics (0: off).",
)
@click.option(
    "--health-port",
    type=click.IntRange(0, 65535),
    default=DEFAULT_HEALTH_PORT,
    show_default=True,
    help="Liveness /healthz (0: off).",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=4,
    show_default=True,
    help="Concurrent reconciles (of different resources).",
)
@click.option(
    "--resync-seconds", type=click.FloatRange(1, 3600), default=60.0, show_default=True, help="Full resync period."
)
@click.option(
    "--leader-election/--no-leader-election",
    default=True,
    show_default=True,
    help="Hold a Lease so only one replica acts.",
)
@click.option(
    "--lease-namespace",
    default=lambda: os.environ.get("POD_NAMESPACE", "default"),
    help="Namespace of the leader Lease.",
)
@click.option(
    "--watch-timeout",
    type=click.IntRange(5, 3600),
    default=300,
    show_default=True,
    help="Server-side watch timeout (s).",
)
@click.option(
    "--max-in-flight",
    type=click.IntRange(1, 1024),
    default=DEFAULT_MAX_IN_FLIGHT,
    show_default=True,
    envvar="DRS_OPERATOR_MAX_IN_FLIGHT",
    show_envvar=True,
    help="Write requests to the apiserver in flight at once.",
)
@click.option(
    "--qps",
    type=click.FloatRange(0, 100000),
    default=DEFAULT_QPS,
    show_default=True,
    envvar="DRS_OPERATOR_QPS",
    show_envvar=True,
    help="Client-side rate of write requests per second (0: unlimited).",
)
@click.option(
    "--burst",
    type=click.IntRange(1, 100000),
    default=DEFAULT_BURST,
    show_default=True,
    envvar="DRS_OPERATOR_BURST",
    show_envvar=True,
    help="Write requests allowed at once above the rate.",
)
@click.option("-v", "--verbose", is_flag=True)
def operator(
    namespaces: tuple[str, ...],
    metrics_port: int,
    health_port: int,
    workers: int,
    resync_seconds: float,
    leader_election: bool,
    lease_namespace: str,
    watch_timeout: int,
    max_in_flight: int,
    qps: float,
    burst: int,
    verbose: bool,
) -> None:
    """Run the DisaggReplicaSet operator."""
    import kopf
    from prometheus_client import start_http_server

    import drs_operator.handlers  # noqa: F401  (registers the handlers)
    from drs_operator.metrics import OperatorMetrics

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("kopf.objects", "kopf.activities.startup", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    metrics = OperatorMetrics.create()
    if metrics_port:
        try:
            start_http_server(metrics_port, registry=metrics.registry)
        except OSError as exc:
            raise click.ClickException(f"cannot serve metrics on port {metrics_port}: {exc.strerror}") from exc
    stop_flag = threading.Event()
    memo = kopf.Memo(
        metrics=metrics,
        options=Options(
            workers,
            resync_seconds,
            leader_election,
            lease_namespace,
            watch_timeout,
            stop_flag,
            namespaces=namespaces,
            max_in_flight=max_in_flight,
            qps=qps,
            burst=burst,
        ),
    )
    kopf.run(
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        standalone=True,
        liveness_endpoint=f"http://0.0.0.0:{health_port}{routes.HEALTHZ}" if health_port else None,
        memo=memo,
        stop_flag=stop_flag,
    )
