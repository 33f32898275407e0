"""The Grafana dashboard shipped with the chart: every panel's PromQL parses (a real PromQL parser)
and names only metrics some drs process exports (read from the prometheus-client registries of the
operator, the frontend, the engine and the sidecar), with labels those metrics carry or the
chart's PodMonitor adds; and the chart renders it as Grafana's sidecar expects."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import promql_parser
import pytest
from drs_engine.metrics import EngineMetrics
from drs_frontend.metrics import FrontendMetrics
from drs_operator.metrics import OperatorMetrics
from drs_sidecar.metrics import SidecarMetrics
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from .chart import CHART, Manifest, only
from .conftest import Helm, Render

DASHBOARD_FILE = CHART / "dashboards" / "drs-fleet.json"
DASHBOARD = json.loads(DASHBOARD_FILE.read_text())
#: Grafana's variables, given values PromQL can parse.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "1h", "$__interval": "1m"}
#: Labels a scrape adds (Prometheus: job, instance; the Prometheus Operator: namespace, pod,
#: container; the chart's PodMonitor: fleet, replica, role).
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "fleet", "replica", "role", "le"}
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def registries() -> Iterator[CollectorRegistry]:
    frontend = FrontendMetrics()
    frontend.watch_in_flight(lambda: [])
    yield frontend.registry
    yield EngineMetrics(backend="sim", role="prefill", test_double=True).registry
    yield SidecarMetrics().registry
    yield OperatorMetrics.create().registry


def exported() -> dict[str, set[str]]:
    """Every sample name a drs process exports -> the labels it carries (a histogram's ``le`` included).

    prometheus-client has no public list of a metric's label names: they are read from the
    registered wrappers (``_labelnames``) and from a custom collector's described families."""
    names: dict[str, set[str]] = {}
    for registry in registries():
        for collector in list(registry._collector_to_names):
            if isinstance(collector, MetricWrapperBase):
                entries = [(collector._name, collector._type, set(collector._labelnames))]
            else:
                described = collector.describe()  # type: ignore[attr-defined]  # custom collectors define it
                entries = [(f.name, f.type, set(getattr(f, "_labelnames", ()))) for f in described]
            for name, type_, labels in entries:
                for suffix in SAMPLE_SUFFIXES.get(type_ or "", ("",)):
                    names[name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return names


def queries() -> Iterator[tuple[str, str]]:
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for variable in DASHBOARD["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), *(\w+)\)", variable["query"]["query"])
            assert match, variable
            yield f"variable {variable['name']}", match.group(1)


def parse(expr: str) -> Any:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    expr = re.sub(r"\$(\w+)", r"x_\1", expr)  # $namespace, $fleet: label values
    return promql_parser.parse(expr)


def selectors(node: Any) -> Iterator[tuple[str, set[str]]]:
    """``(metric name, label names it matches on or groups by)`` of every vector selector under ``node``."""
    kind = type(node).__name__
    if kind == "VectorSelector":
        yield node.name, {m.name for m in node.matchers.matchers} - {"__name__"}
        return
    grouping: set[str] = set()
    if kind == "AggregateExpr" and node.modifier is not None:
        grouping = set(node.modifier.labels)
    for child in _children(node):
        for name, labels in selectors(child):
            yield name, labels | grouping


def _children(node: Any) -> Iterator[Any]:
    kind = type(node).__name__
    if kind == "MatrixSelector":
        yield node.vector_selector
    elif kind == "Call":
        yield from node.args
    elif kind == "AggregateExpr":
        yield node.expr
        if node.param is not None:
            yield node.param
    elif kind == "BinaryExpr":
        yield node.lhs
        yield node.rhs
    elif kind in ("ParenExpr", "UnaryExpr", "SubqueryExpr"):
        yield node.expr
    elif kind not in ("NumberLiteral", "StringLiteral"):
        raise AssertionError(f"a PromQL node this test does not walk: {kind}")


def test_the_dashboard_has_the_panels_the_chart_promises() -> None:
    titles = " | ".join(p["title"] for p in DASHBOARD["panels"])
    for words in (
        "Turns/s",
        "Time to first token",
        "Turn latency",
        "Prefix-cache hit ratio",
        "Queue depth",
        "Refit duration",
        "Weights version per engine",
        "divergent",
    ):
        assert words in titles, words


@pytest.mark.parametrize(("where", "expr"), list(queries()), ids=[f"{w}: {e[:60]}" for w, e in queries()])
def test_every_query_names_a_metric_a_process_exports_with_labels_it_has(where: str, expr: str) -> None:
    names = exported()
    found = list(selectors(parse(expr)))
    assert found, f"{where}: no metric in {expr}"
    for name, labels in found:
        assert name in names, f"{where}: {name} is exported by no drs process"
        unknown = labels - names[name] - TARGET_LABELS
        assert not unknown, f"{where}: {name} has no label {sorted(unknown)}"


def test_the_check_rejects_a_metric_no_process_exports_and_a_label_it_lacks() -> None:
    names = exported()
    assert "drs_frontend_requests_total" in names and "drs_engine_queue_depth" in names
    assert "drs_sidecar_refit_seconds_bucket" in names and "le" in names["drs_sidecar_refit_seconds_bucket"]
    [(name, _)] = selectors(parse("rate(drs_frontend_turns_lost_total[5m])"))
    assert name not in names
    [(name, labels)] = selectors(parse('sum by (replica, engine) (drs_engine_queue_depth{leg="x"})'))
    assert labels - names[name] - TARGET_LABELS == {"engine", "leg"}


def test_the_chart_ships_no_dashboard_unless_asked(render: Render) -> None:
    assert not [o for o in render() if o["kind"] in ("ConfigMap", "PodMonitor")]


def test_the_chart_ships_the_dashboard_in_a_configmap_grafanas_sidecar_loads(render: Render) -> None:
    objects = render({"grafanaDashboard.enabled": True, "grafanaDashboard.annotations": {"grafana_folder": "drs"}})
    configmap: Manifest = only(objects, "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "drs-system"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "drs"}
    assert json.loads(configmap["data"]["drs-fleet.json"]) == DASHBOARD


def test_the_podmonitor_labels_what_the_dashboard_groups_by(render: Render) -> None:
    monitor = only(render({"fleetMetrics.podMonitor.enabled": True, "watchNamespaces": ["rl"]}), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["rl"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    targets = {r.get("targetLabel") for r in endpoint["relabelings"]}
    assert {"fleet", "replica", "role"} <= targets
    anywhere = only(render({"fleetMetrics.podMonitor.enabled": True}), "PodMonitor")
    assert anywhere["spec"]["namespaceSelector"] == {"any": True}


def test_helm_lint_strict_passes_with_the_dashboard_and_the_podmonitor(helm: Helm) -> None:
    from .chart import KUBE_VERSION, set_args

    values = {"grafanaDashboard.enabled": True, "fleetMetrics.podMonitor.enabled": True}
    result = helm("lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, *set_args(values), check=False)
    assert result.returncode == 0, result.stdout + result.stderr
