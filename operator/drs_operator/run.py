"""``drs operator``: run the DisaggReplicaSet operator (kopf) with metrics, probes and leader election."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import click
from drs_protocol import env, routes

from drs_operator.kube.throttle import Limits
from drs_operator.manifests.policies import OperatorPods, parse_labels

DEFAULT_METRICS_PORT = 9090
DEFAULT_HEALTH_PORT = 8080
#: Client-side limits on write requests: kube/throttle.py's defaults (and why they suit).
DEFAULT_LIMITS = Limits()


@dataclasses.dataclass
class Options:
    workers: int
    resync_s: float
    leader_election: bool
    lease_namespace: str
    watch_timeout_s: int
    stop_flag: threading.Event
    namespaces: tuple[str, ...] = ()
    limits: Limits = DEFAULT_LIMITS
    #: The operator's own pods (``--pod-labels`` in ``POD_NAMESPACE``), admitted to the engines by
    #: every per-replica NetworkPolicy; None: not in a pod.
    operator: OperatorPods | None = None


def _option(
    flag: str, kind: click.ParamType[Any], default: object, help: str, envvar: str | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A typed flag whose default ``--help`` shows; with ``envvar``, also set from that variable."""
    return click.option(
        flag, type=kind, default=default, show_default=True, envvar=envvar, show_envvar=envvar is not None, help=help
    )


#: The write limits (``kube/throttle.py``): flag, range, default, the variable that also sets it, help.
WRITE_LIMIT_FLAGS: tuple[tuple[str, click.ParamType[Any], float, str, str], ...] = (
    ("--max-in-flight", click.IntRange(1, 1024), DEFAULT_LIMITS.max_in_flight, "DRS_OPERATOR_MAX_IN_FLIGHT",
     "Write requests to the apiserver in flight at once."),
    ("--qps", click.FloatRange(0, 100000), DEFAULT_LIMITS.qps, "DRS_OPERATOR_QPS",
     "Client-side rate of write requests per second (0: unlimited)."),
    ("--burst", click.IntRange(1, 100000), DEFAULT_LIMITS.burst, "DRS_OPERATOR_BURST",
     "Write requests allowed at once above the rate."),
)  # fmt: skip


def _write_limit_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for flag, kind, default, envvar, help in reversed(WRITE_LIMIT_FLAGS):
        command = _option(flag, kind, default, help, envvar=envvar)(command)
    return command


@click.command(name="operator")
@click.option("-n", "--namespace", "namespaces", multiple=True, help="Namespace to watch (repeat); default: all.")
@_option("--metrics-port", click.IntRange(0, 65535), DEFAULT_METRICS_PORT, "Prometheus /metrics (0: off).")
@_option("--health-port", click.IntRange(0, 65535), DEFAULT_HEALTH_PORT, "Liveness /healthz (0: off).")
@_option("--workers", click.IntRange(1, 64), 4, "Concurrent reconciles (of different resources).")
@_option("--resync-seconds", click.FloatRange(1, 3600), 60.0, "Full resync period.")
@click.option(
    "--leader-election/--no-leader-election",
    default=True,
    show_default=True,
    help="Hold a Lease so only one replica acts.",
)
@click.option(
    "--lease-namespace",
    default=lambda: os.environ.get(env.POD_NAMESPACE, "default"),
    help="Namespace of the leader Lease.",
)
@_option("--watch-timeout", click.IntRange(5, 3600), 300, "Server-side watch timeout (s).")
@_option(
    "--pod-labels",
    click.STRING,
    "",
    "The labels that select this operator's pods, key=value,key=value (the chart sets them): each "
    f"replica's NetworkPolicy admits these pods of ${env.POD_NAMESPACE} to its engines. Empty: none.",
    envvar=env.OPERATOR_POD_LABELS,
)
@_write_limit_options
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
    pod_labels: str,
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
    operator_pods = _operator_pods(pod_labels)
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
            limits=dataclasses.replace(DEFAULT_LIMITS, max_in_flight=max_in_flight, qps=qps, burst=burst),
            operator=operator_pods,
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


def _operator_pods(pod_labels: str) -> OperatorPods | None:
    """``--pod-labels`` in ``POD_NAMESPACE``; a usage error names the flag, its variable and the rule."""
    if not pod_labels.strip():
        return None
    try:
        labels = parse_labels(pod_labels)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'--pod-labels' / ${env.OPERATOR_POD_LABELS}") from exc
    namespace = os.environ.get(env.POD_NAMESPACE, "")
    if not namespace:
        raise click.BadParameter(
            f"needs ${env.POD_NAMESPACE}, the namespace of the pods it selects (the downward API's metadata.namespace)",
            param_hint=f"'--pod-labels' / ${env.OPERATOR_POD_LABELS}",
        )
    return OperatorPods(namespace, labels)
