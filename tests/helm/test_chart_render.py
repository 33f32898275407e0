"""The drs-operator chart without a cluster: `helm lint`, what `helm template` renders, and that the
rendered Deployment, RBAC and CRD agree with the operator's own code (its CLI, its API calls, its
generated CRD) and with the image the top-level Dockerfile builds."""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_operator.api.constants import CRD_NAME, DEFAULT_FRONTEND_IMAGE
from drs_operator.crd import render_crd
from drs_operator.leader import LEASE_NAME
from drs_operator.manifests.policies import parse_labels
from drs_operator.run import DEFAULT_HEALTH_PORT, DEFAULT_METRICS_PORT
from drs_operator.run import operator as operator_command
from drs_protocol import env, routes

from .chart import CHART, KUBE_VERSION, ROOT, Manifest, container, only, set_args
from .conftest import Helm, Render
from .operator_needs import NEEDS, Need

VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())
WATCHED = {"watchNamespaces": ["rl-team-a", "rl-team-b"]}
ESCALATING_VERBS = {"*", "escalate", "bind", "impersonate"}


def args_of(objects: list[Manifest]) -> dict[str, Any]:
    """The Deployment's args as `drs operator` itself parses them (click, not a regex)."""
    ctx = operator_command.make_context("operator", list(container(objects)["args"]))
    return dict(ctx.params)


# --- helm lint ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        pytest.param({}, id="with the default values"),
        pytest.param(WATCHED, id="when it serves two namespaces"),
        pytest.param({"metrics.serviceMonitor.enabled": True}, id="with a ServiceMonitor"),
        pytest.param({"replicaCount": 1, "operator.leaderElection": False}, id="as one replica without a Lease"),
        pytest.param({"metrics.port": 0, "health.port": 0}, id="with metrics and probes off"),
        pytest.param(
            {"serviceAccount.create": False, "serviceAccount.name": "existing"}, id="with a given ServiceAccount"
        ),
    ],
)
def test_helm_lint_strict_passes(helm: Helm, values: dict[str, Any]) -> None:
    result = helm("lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, *set_args(values), check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_helm_lint_fails_on_a_broken_template(helm: Helm, tmp_path: Path) -> None:
    broken = tmp_path / "drs-operator"
    shutil.copytree(CHART, broken)
    deployment = broken / "templates" / "deployment.yaml"
    deployment.write_text(deployment.read_text().replace("{{- end }}", "", 1))
    result = helm("lint", "--strict", str(broken), "--kube-version", KUBE_VERSION, check=False)
    assert result.returncode != 0
    assert "deployment.yaml" in result.stdout + result.stderr


# --- identity: CRD, versions, image -------------------------------------------------------------


def test_the_chart_crd_is_the_generated_crd_byte_for_byte() -> None:
    chart_crds = sorted(p.name for p in (CHART / "crds").iterdir())
    assert chart_crds == ["disagg.dev_disaggreplicasets.yaml"]
    chart_crd = (CHART / "crds" / chart_crds[0]).read_text()
    assert chart_crd == (ROOT / "crds" / chart_crds[0]).read_text(), "run `make crd`: it writes both copies"
    assert chart_crd == render_crd(), "run `make crd`: the API models changed"
    assert yaml.safe_load(chart_crd)["metadata"]["name"] == CRD_NAME


def test_the_chart_is_helm_3_and_its_app_version_is_the_project_version() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert CHART_META["apiVersion"] == "v2"
    assert CHART_META["appVersion"] == project["version"] == "0.1.0"


def test_the_default_image_is_the_one_the_operator_names_for_frontends(render: Render) -> None:
    assert container(render())["image"] == DEFAULT_FRONTEND_IMAGE
    assert container(render({"image.repository": "registry.example/drs", "image.tag": "dev"}))["image"] == (
        "registry.example/drs:dev"
    )


# --- the Deployment -----------------------------------------------------------------------------


def test_the_deployment_runs_drs_operator_with_every_setting_from_values(render: Render) -> None:
    objects = render(
        {
            **WATCHED,
            "operator.workers": 8,
            "operator.resyncSeconds": 30,
            "operator.watchTimeoutSeconds": 120,
            "operator.api.maxInFlight": 8,
            "operator.api.qps": 50,
            "operator.api.burst": 75,
            "operator.verbose": True,
            "metrics.port": 9191,
            "health.port": 8181,
        },
        namespace="ops",
    )
    assert container(objects)["command"] == ["drs", "operator"]
    assert args_of(objects) == {
        "namespaces": ("rl-team-a", "rl-team-b"),
        "metrics_port": 9191,
        "health_port": 8181,
        "workers": 8,
        "resync_seconds": 30.0,
        "leader_election": True,
        "lease_namespace": "ops",
        "watch_timeout": 120,
        "pod_labels": "",  # not an argument: the container's DRS_OPERATOR_POD_LABELS (a test below)
        "max_in_flight": 8,
        "qps": 50.0,
        "burst": 75,
        "verbose": True,
    }


def test_by_default_it_serves_every_namespace_from_two_replicas_under_a_lease(render: Render) -> None:
    objects = render(namespace="drs-system")
    params = args_of(objects)
    assert only(objects, "Deployment")["spec"]["replicas"] == 2
    assert params["namespaces"] == ()
    assert params["leader_election"] is True
    assert params["lease_namespace"] == "drs-system"
    assert (params["metrics_port"], params["health_port"]) == (DEFAULT_METRICS_PORT, DEFAULT_HEALTH_PORT)


def test_more_than_one_replica_without_leader_election_does_not_render(helm: Helm) -> None:
    result = helm(
        "template", "drs", str(CHART), "--kube-version", KUBE_VERSION,
        *set_args({"operator.leaderElection": False}), check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "needs replicaCount=1" in result.stderr


def test_one_replica_may_run_without_leader_election(render: Render) -> None:
    params = args_of(render({"operator.leaderElection": False, "replicaCount": 1}))
    assert params["leader_election"] is False


def test_pod_name_and_namespace_come_from_the_downward_api(render: Render) -> None:
    variables = {e["name"]: e for e in container(render())["env"]}  # the names the operator reads (drs_protocol.env)
    assert variables[env.POD_NAME]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert variables[env.POD_NAMESPACE]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


@pytest.mark.parametrize("release", ["drs", "rl-team-a"])
def test_the_operator_is_told_the_labels_that_select_its_own_pods(render: Render, release: str) -> None:
    """Its per-replica NetworkPolicies admit exactly the pods of its Deployment (none other)."""
    deployment = only(render(release=release), "Deployment")
    variables = {e["name"]: e for e in container([deployment])["env"]}
    labels = parse_labels(variables[env.OPERATOR_POD_LABELS]["value"])
    assert labels == deployment["spec"]["selector"]["matchLabels"]
    assert labels["app.kubernetes.io/instance"] == release
    assert labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_liveness_and_readiness_probe_healthz_on_the_health_port(render: Render) -> None:
    c = container(render({"health.port": 8181}))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": DEFAULT_METRICS_PORT, "health": 8181}
    for probe in (c["livenessProbe"], c["readinessProbe"]):
        assert probe["httpGet"] == {"path": routes.HEALTHZ, "port": "health"}  # the route kopf serves


def test_port_zero_turns_probes_and_the_metrics_service_off(render: Render) -> None:
    objects = render({"health.port": 0, "metrics.port": 0})
    c = container(objects)
    assert "livenessProbe" not in c and "readinessProbe" not in c
    assert not [o for o in objects if o["kind"] == "Service"]
    assert (args_of(objects)["metrics_port"], args_of(objects)["health_port"]) == (0, 0)


def test_the_operator_runs_as_the_image_user_with_a_read_only_root_filesystem(render: Render) -> None:
    objects = render()
    pod = only(objects, "Deployment")["spec"]["template"]["spec"]
    c = container(objects)
    default_stage = re.split(r"^FROM ", (ROOT / "Dockerfile").read_text(), flags=re.MULTILINE)[-1]  # the image built
    (user,) = re.findall(r"^USER\s+(\d+):(\d+)$", default_stage, flags=re.MULTILINE)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert (str(pod["securityContext"]["runAsUser"]), str(pod["securityContext"]["runAsGroup"])) == user
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    tmp = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == tmp["name"])
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


def test_the_metrics_service_selects_the_operator_pods_on_the_metrics_port(render: Render) -> None:
    objects = render()
    service = only(objects, "Service")
    pod_labels = only(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": DEFAULT_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}
    ]


def test_the_service_monitor_is_off_by_default_and_scrapes_the_metrics_service_when_on(render: Render) -> None:
    assert not [o for o in render() if o["kind"] == "ServiceMonitor"]
    objects = render({"metrics.serviceMonitor.enabled": True, "metrics.serviceMonitor.labels": {"release": "prom"}})
    monitor = only(objects, "ServiceMonitor")
    service = only(objects, "Service")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["endpoints"][0]["path"] == routes.METRICS


def test_a_service_monitor_without_the_metrics_service_does_not_render(helm: Helm) -> None:
    values = {"metrics.serviceMonitor.enabled": True, "metrics.service.enabled": False}
    result = helm("template", "drs", str(CHART), "--kube-version", KUBE_VERSION, *set_args(values), check=False)
    assert result.returncode != 0
    assert "needs metrics.service.enabled=true" in result.stderr


# --- RBAC ---------------------------------------------------------------------------------------


def granted(objects: list[Manifest], fullname: str) -> set[Need]:
    """The chart's rules as Need rows (``why`` left empty), scoped by the role that grants them."""
    scope_of = {
        ("ClusterRole", f"{fullname}-cluster-reader"): "cluster",
        ("ClusterRole", f"{fullname}-workloads"): "workloads",
        ("Role", f"{fullname}-leader-election"): "lease",
    }
    roles = [o for o in objects if o["kind"] in ("ClusterRole", "Role")]
    assert {(r["kind"], r["metadata"]["name"]) for r in roles} == set(scope_of)
    rows: set[Need] = set()
    for role in roles:
        scope = scope_of[(role["kind"], role["metadata"]["name"])]
        for rule in role["rules"]:
            names = rule.get("resourceNames") or [None]
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        for name in names:
                            rows.add(Need(verb, group, resource, scope, "", name))  # type: ignore[arg-type]
    return rows


@pytest.mark.parametrize(
    "values", [pytest.param({}, id="serving every namespace"), pytest.param(WATCHED, id="serving two namespaces")]
)
def test_rbac_grants_exactly_the_requests_the_operator_code_makes(render: Render, values: dict[str, Any]) -> None:
    needed = {Need(n.verb, n.group, n.resource, n.scope, "", n.name) for n in NEEDS}
    rows = granted(render(values), "drs-operator")
    assert not rows - needed, f"granted but never requested: {sorted(map(str, rows - needed))}"
    assert not needed - rows, f"requested but not granted: {sorted(map(str, needed - rows))}"


def test_the_lease_role_names_the_lease_the_operator_holds(render: Render) -> None:
    role = only(render(), "Role")
    assert [r["resourceNames"] for r in role["rules"] if "resourceNames" in r] == [[LEASE_NAME]]


def test_no_rule_uses_a_wildcard_or_an_escalating_verb(render: Render) -> None:
    for role in (o for o in render(WATCHED) if o["kind"] in ("ClusterRole", "Role")):
        for rule in role["rules"]:
            assert not ESCALATING_VERBS & set(rule["verbs"]), role["metadata"]["name"]
            assert "*" not in rule["apiGroups"] + rule["resources"], role["metadata"]["name"]


def test_serving_every_namespace_binds_the_workload_role_cluster_wide(render: Render) -> None:
    objects = render(namespace="drs-system")
    bindings = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ClusterRoleBinding"}
    assert set(bindings) == {"drs-operator-cluster-reader", "drs-operator-workloads"}
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "RoleBinding"] == ["drs-operator-leader-election"]
    for binding in bindings.values():
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "drs-operator", "namespace": "drs-system"}]


def test_serving_listed_namespaces_binds_the_workload_role_only_in_them(render: Render) -> None:
    objects = render(WATCHED, namespace="drs-system")
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "ClusterRoleBinding"} == {
        "drs-operator-cluster-reader"
    }
    workload_bindings = [
        o for o in objects if o["kind"] == "RoleBinding" and o["roleRef"]["name"] == "drs-operator-workloads"
    ]
    assert sorted(b["metadata"]["namespace"] for b in workload_bindings) == WATCHED["watchNamespaces"]
    for binding in workload_bindings:
        assert binding["roleRef"]["kind"] == "ClusterRole"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "drs-operator", "namespace": "drs-system"}]


def test_cluster_scoped_objects_are_named_after_the_release(render: Render) -> None:
    def cluster_scoped(release: str) -> set[tuple[str, str]]:
        objects = render(release=release)
        return {(o["kind"], o["metadata"]["name"]) for o in objects if o["kind"].startswith("Cluster")}

    first, second = cluster_scoped("fleet-a"), cluster_scoped("fleet-b")
    assert len(first) == 4 and not first & second
    assert all(name.startswith("fleet-a-operator-") for _, name in first)


def test_a_release_name_with_operator_in_it_is_used_as_is(render: Render) -> None:
    assert only(render(release="drs-operator"), "Deployment")["metadata"]["name"] == "drs-operator"
    assert only(render(release="drs"), "Deployment")["metadata"]["name"] == "drs-operator"
    assert only(render(release="rl"), "Deployment")["metadata"]["name"] == "rl-operator"


def test_everything_namespaced_lands_in_the_release_namespace_except_watched_bindings(render: Render) -> None:
    for obj in render(WATCHED, namespace="ops"):
        if obj["kind"].startswith("Cluster"):
            assert "namespace" not in obj["metadata"]
        elif obj["kind"] == "RoleBinding" and obj["roleRef"]["name"].endswith("-workloads"):
            assert obj["metadata"]["namespace"] in WATCHED["watchNamespaces"]
        else:
            assert obj["metadata"]["namespace"] == "ops", obj["kind"]


# --- documentation ------------------------------------------------------------------------------

#: Values documented as one block in the README (their keys are Kubernetes fields).
BLOCKS = {"livenessProbe", "readinessProbe", "resources", "podSecurityContext", "securityContext"}


def leaf_paths(values: dict[str, Any], prefix: str = "") -> list[str]:
    paths: list[str] = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and path not in BLOCKS:
            paths += leaf_paths(value, f"{path}.")
        else:
            paths.append(path)
    return paths


def test_every_value_is_in_the_readme_table_and_every_row_is_a_value() -> None:
    readme = (ROOT / "helm" / "README.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \|", readme, flags=re.MULTILINE)
    assert sorted(rows) == sorted(leaf_paths(VALUES))


def test_every_value_has_a_comment_above_it_in_values_yaml() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    leaves = set(leaf_paths(VALUES))
    parents: list[tuple[int, str]] = []  # (indent, key) of the keys enclosing the current line
    undocumented = []
    for i, line in enumerate(lines):
        key = re.match(r"^( *)([A-Za-z]\w*):", line)
        if not key:
            continue
        indent = len(key.group(1))
        while parents and parents[-1][0] >= indent:
            parents.pop()
        path = ".".join([k for _, k in parents] + [key.group(2)])
        parents.append((indent, key.group(2)))
        if path in leaves and not lines[i - 1].lstrip().startswith("#"):
            undocumented.append(path)
    assert len(leaves) > 30
    assert not undocumented


# --- NetworkPolicies ----------------------------------------------------------------------------


def _policies(render: Render, values: dict[str, Any]) -> dict[tuple[str, str], Manifest]:
    return {
        (o["metadata"]["namespace"], o["metadata"]["name"].rsplit("-", 1)[1]): o
        for o in render(values)
        if o["kind"] == "NetworkPolicy"
    }


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels + In expressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_no_network_policies_unless_enabled(render: Render) -> None:
    assert not [o for o in render({}) if o["kind"] == "NetworkPolicy"]


def test_network_policies_select_the_operators_pods_by_its_own_labels(render: Render) -> None:
    from drs_operator.api import names

    policies = _policies(render, {"networkPolicy.enabled": True, **WATCHED})
    assert set(policies) == {(ns, kind) for ns in WATCHED["watchNamespaces"] for kind in ("frontends", "engines")}
    frontend = names.labels("fleet", "frontend", 0)
    prefill, decode = names.labels("fleet", "prefill", 0), names.labels("fleet", "decode", 1)
    fe, en = policies[("rl-team-a", "frontends")]["spec"], policies[("rl-team-a", "engines")]["spec"]
    assert _matches(fe["podSelector"], frontend) and not _matches(fe["podSelector"], prefill)
    assert _matches(en["podSelector"], prefill) and _matches(en["podSelector"], decode)
    assert not _matches(en["podSelector"], frontend)
    assert fe["ingress"] == [{}]  # frontends: reachable by any client unless frontendClients says otherwise
    peers = en["ingress"][0]["from"]
    same_namespace = [p["podSelector"] for p in peers if "namespaceSelector" not in p]
    assert len(same_namespace) == 1
    for labels in (frontend, prefill, decode):  # requests, and the prefill-to-decode KV handoff
        assert _matches(same_namespace[0], labels)
    assert not _matches(same_namespace[0], {"app": "something-else"})
    operator_peer = next(p for p in peers if "namespaceSelector" in p)
    assert operator_peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "drs-system"}
    deployment = only(render({}), "Deployment")
    assert _matches(operator_peer["podSelector"], deployment["spec"]["template"]["metadata"]["labels"])


def test_network_policy_clients_are_the_values_given(render: Render) -> None:
    trainer = {"podSelector": {"matchLabels": {"app": "trainer"}}}
    clients = {"namespaceSelector": {"matchLabels": {"team": "rl"}}}
    values = {"networkPolicy.enabled": True, "networkPolicy.frontendClients": [clients]}
    values["networkPolicy.engineClients"] = [trainer]
    policies = _policies(render, values)
    assert set(policies) == {("drs-system", "frontends"), ("drs-system", "engines")}  # the release namespace
    assert policies[("drs-system", "frontends")]["spec"]["ingress"] == [{"from": [clients]}]
    assert trainer in policies[("drs-system", "engines")]["spec"]["ingress"][0]["from"]


def test_the_namespace_wide_engines_policy_can_be_left_to_the_operators_per_replica_ones(render: Render) -> None:
    policies = _policies(render, {"networkPolicy.enabled": True, "networkPolicy.engines": False})
    assert set(policies) == {("drs-system", "frontends")}  # the frontends keep the namespace-wide policy
