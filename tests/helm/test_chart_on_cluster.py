"""The drs-operator chart against the real control plane.

* every object `helm template` renders passes a server-side dry run;
* `helm install` stores the Deployment, the RBAC and an Established CRD; `helm uninstall` removes
  all of it but the CRD (Helm's crds/ semantics);
* the ServiceAccount may make every request the operator's code makes (``operator_needs.NEEDS``,
  asked with ``kubectl auth can-i --as``) and may not do what the operator never does;
* the operator itself, running under the ServiceAccount's own token with the Deployment's own
  arguments, reconciles an example to Ready, and a second replica takes over the Lease.

The operator pods of an installed release never run (kwok only marks them Running), so the
operator is run here as a local process, the way it would run in that pod.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_devcluster.testing import RunningCluster, namespace_for, pod_runner, wait_for
from drs_operator.api.constants import CRD_NAME, Phase
from drs_operator.leader import LEASE_NAME

from .chart import CHART, ROOT, Manifest, set_args
from .conftest import Helm, Render
from .operator_needs import NEEDS, Need

pytestmark = pytest.mark.cluster

DRS = str(Path(sys.executable).parent / "drs")
IMAGE = {"image.repository": "registry.example/drs-test", "image.tag": "helm-test"}
MODES = ("every namespace", "one namespace")
WAIT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Release:
    name: str
    namespace: str
    watched: list[str]  # empty: every namespace
    install_output: str

    @property
    def fullname(self) -> str:
        return f"{self.name}-operator"

    @property
    def service_account(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.fullname}"

    @property
    def workload_namespace(self) -> str:
        """A namespace the operator serves."""
        return self.watched[0] if self.watched else "default"


def get(cluster: RunningCluster, *args: str, check: bool = True) -> Manifest | None:
    proc = cluster.kubectl("get", *args, "-o", "json", check=check)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


@contextlib.contextmanager
def installed(cluster: RunningCluster, helm: Helm, mode: str, *extra: str) -> Iterator[Release]:
    """A release of the chart in a fresh namespace (and, in "one namespace" mode, a fresh served
    namespace); uninstalled and deleted afterwards."""
    name = f"drs-{uuid.uuid4().hex[:6]}"
    namespace = namespace_for(f"helm-{name}")
    watched = [namespace_for(f"served-{name}")] if mode == "one namespace" else []
    for ns in (namespace, *watched):
        cluster.kubectl("create", "namespace", ns)
    try:
        values = {**IMAGE, "watchNamespaces": watched}
        out = helm(
            "install", name, str(CHART), "--namespace", namespace, "--wait", "--timeout", "120s",
            *set_args(values), *extra, env=cluster.env,
        ).stdout  # fmt: skip
        yield Release(name, namespace, watched, out)
    finally:
        helm("uninstall", name, "--namespace", namespace, "--wait", env=cluster.env, check=False)
        for ns in (namespace, *watched):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="module")
def cluster_wide_release(devcluster: RunningCluster, helm: Helm) -> Iterator[Release]:
    with installed(devcluster, helm, "every namespace") as release:
        yield release


@pytest.fixture(scope="module")
def scoped_release(devcluster: RunningCluster, helm: Helm) -> Iterator[Release]:
    with installed(devcluster, helm, "one namespace") as release:
        yield release


@pytest.fixture(scope="module", params=MODES, ids=[f"serving {m}" for m in MODES])
def release(request: pytest.FixtureRequest) -> Release:
    fixture = "cluster_wide_release" if request.param == "every namespace" else "scoped_release"
    result: Release = request.getfixturevalue(fixture)
    return result


# --- server-side dry run ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=[f"serving {m}" for m in MODES])
def test_every_rendered_object_passes_a_server_side_dry_run(
    devcluster: RunningCluster, render: Render, namespace: str, mode: str
) -> None:
    values = {**IMAGE, "watchNamespaces": [namespace] if mode == "one namespace" else []}
    objects = render(values, release=f"dry-{uuid.uuid4().hex[:6]}", namespace=namespace, crds=True)
    kinds = {o["kind"] for o in objects}
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole", "Role", "ServiceAccount", "Service"} <= kinds
    result = devcluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(objects), check=False
    )
    assert result.returncode == 0, result.stderr
    accepted = [line for line in result.stdout.splitlines() if line.endswith("(server dry run)")]
    assert len(accepted) == len(objects), result.stdout


# --- helm install / uninstall -------------------------------------------------------------------


def test_helm_install_stores_the_deployment_the_rbac_and_an_established_crd(
    devcluster: RunningCluster, release: Release
) -> None:
    deployment = get(devcluster, "deployment", release.fullname, "-n", release.namespace)
    assert deployment is not None
    assert deployment["metadata"]["labels"]["app.kubernetes.io/instance"] == release.name
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "registry.example/drs-test:helm-test"
    assert c["command"] == ["drs", "operator"]
    assert [a for a in c["args"] if a.startswith("--namespace=")] == [f"--namespace={n}" for n in release.watched]
    assert f"--lease-namespace={release.namespace}" in c["args"]
    assert pod["serviceAccountName"] == release.fullname
    assert deployment["spec"]["replicas"] == 2
    # kwok marks the pods Running and Ready without running a container: this shows the pods were
    # admitted and scheduled, not that the operator works (test_the_operator_… below shows that).
    assert deployment["status"].get("availableReplicas") == 2

    assert get(devcluster, "serviceaccount", release.fullname, "-n", release.namespace) is not None
    for suffix in ("cluster-reader", "workloads"):
        assert get(devcluster, "clusterrole", f"{release.fullname}-{suffix}") is not None
    workload_binding = (
        get(devcluster, "rolebinding", f"{release.fullname}-workloads", "-n", release.watched[0])
        if release.watched
        else get(devcluster, "clusterrolebinding", f"{release.fullname}-workloads")
    )
    assert workload_binding is not None
    assert get(devcluster, "role", f"{release.fullname}-leader-election", "-n", release.namespace) is not None

    crd = get(devcluster, "crd", CRD_NAME)
    assert crd is not None
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == conditions["NamesAccepted"] == "True"


def test_the_install_notes_say_how_to_apply_an_example_and_read_status_urls(release: Release) -> None:
    out = release.install_output
    assert "STATUS: deployed" in out
    assert f"kubectl apply -n {release.workload_namespace} -f examples/reference.yaml" in out
    assert "{range .status.urls[*]}" in out
    assert f"deployment/{release.fullname}" in out


def test_helm_uninstall_removes_what_it_installed_but_leaves_the_crd(
    devcluster: RunningCluster, helm: Helm, tmp_path: Path
) -> None:
    with installed(devcluster, helm, "one namespace") as release:
        selector = f"app.kubernetes.io/instance={release.name}"
        namespaced = "deployments,services,serviceaccounts,roles,rolebindings"
        cluster_scoped = "clusterroles,clusterrolebindings"

        def count(kinds: str, *where: str) -> int:
            return len(get(devcluster, kinds, "-l", selector, *where)["items"])  # type: ignore[index]

        assert count(namespaced, "-n", release.namespace) == 5  # Deployment, Service, SA, Role, RoleBinding
        assert count("rolebindings", "-n", release.watched[0]) == 1
        assert count(cluster_scoped) == 3  # 2 ClusterRoles, 1 ClusterRoleBinding (the workloads one is a RoleBinding)

        helm("uninstall", release.name, "--namespace", release.namespace, "--wait", env=devcluster.env)

        assert count(namespaced, "-n", release.namespace) == 0
        assert count("rolebindings", "-n", release.watched[0]) == 0
        assert count(cluster_scoped) == 0
        assert get(devcluster, "crd", CRD_NAME) is not None


# --- RBAC as the apiserver decides it -----------------------------------------------------------


def resource_arg(group: str, resource: str, name: str | None) -> tuple[str, list[str]]:
    plural, _, subresource = resource.partition("/")
    target = f"{plural}.{group}" if group else plural
    return (f"{target}/{name}" if name else target), ([f"--subresource={subresource}"] if subresource else [])


def can_i(cluster: RunningCluster, release: Release, verb: str, resource: str, where: list[str]) -> bool:
    result = cluster.kubectl("auth", "can-i", verb, resource, *where, f"--as={release.service_account}", check=False)
    assert result.stdout.strip() in ("yes", "no"), result.stdout + result.stderr
    return result.stdout.strip() == "yes"


def where_of(need: Need, release: Release) -> list[str]:
    if need.scope == "cluster":
        return ["--all-namespaces"]
    if need.scope == "lease":
        return ["-n", release.namespace]
    return ["-n", release.workload_namespace]


@pytest.mark.parametrize("need", NEEDS, ids=[n.id for n in NEEDS])
def test_the_service_account_may(devcluster: RunningCluster, release: Release, need: Need) -> None:
    resource, sub = resource_arg(need.group, need.resource, need.name)
    assert can_i(devcluster, release, need.verb, resource, [*sub, *where_of(need, release)])


#: (verb, resource, where, id): requests the operator never makes, denied in both modes.
FORBIDDEN_EVERYWHERE = [
    ("*", "*", ["--all-namespaces"], "be cluster-admin"),
    ("delete", "nodes", ["--all-namespaces"], "delete nodes"),
    ("patch", "nodes", ["--all-namespaces"], "cordon nodes"),
    ("create", "clusterroles.rbac.authorization.k8s.io", ["--all-namespaces"], "create ClusterRoles"),
    ("create", "rolebindings.rbac.authorization.k8s.io", ["-n", "{served}"], "bind roles"),
    ("impersonate", "users", ["--all-namespaces"], "impersonate users"),
    ("create", "pods", ["--subresource=exec", "-n", "{served}"], "exec into pods"),
    ("get", "secrets/some-secret", ["-n", "kube-system"], "read a secret in kube-system by name"),
    ("create", "disaggreplicasets.disagg.dev", ["-n", "{served}"], "create DisaggReplicaSets"),
    ("delete", "disaggreplicasets.disagg.dev", ["-n", "{served}"], "delete DisaggReplicaSets"),
    ("update", "leases.coordination.k8s.io/another-lease", ["-n", "{release}"], "take another Lease"),
    ("create", "leases.coordination.k8s.io", ["-n", "{served}"], "create Leases outside its namespace"),
    ("delete", "customresourcedefinitions.apiextensions.k8s.io", ["--all-namespaces"], "delete CRDs"),
]
#: Denied only when the release serves a list of namespaces ("default" is not among them).
FORBIDDEN_OUTSIDE_SERVED = [
    ("list", "secrets", ["-n", "default"], "list secrets in a namespace it does not serve"),
    ("list", "secrets", ["--all-namespaces"], "list secrets in every namespace"),
    ("create", "pods", ["-n", "default"], "create pods in a namespace it does not serve"),
    ("create", "deployments.apps", ["-n", "kube-system"], "create Deployments in kube-system"),
]


def fill(where: list[str], release: Release) -> list[str]:
    return [w.format(served=release.workload_namespace, release=release.namespace) for w in where]


@pytest.mark.parametrize(
    ("verb", "resource", "where"), [f[:3] for f in FORBIDDEN_EVERYWHERE], ids=[f[3] for f in FORBIDDEN_EVERYWHERE]
)
def test_the_service_account_may_not(
    devcluster: RunningCluster, release: Release, verb: str, resource: str, where: list[str]
) -> None:
    assert not can_i(devcluster, release, verb, resource, fill(where, release))


@pytest.mark.parametrize(
    ("verb", "resource", "where"),
    [f[:3] for f in FORBIDDEN_OUTSIDE_SERVED],
    ids=[f[3] for f in FORBIDDEN_OUTSIDE_SERVED],
)
def test_serving_one_namespace_the_service_account_may_not(
    devcluster: RunningCluster, scoped_release: Release, verb: str, resource: str, where: list[str]
) -> None:
    assert not can_i(devcluster, scoped_release, verb, resource, where)


def test_serving_every_namespace_the_service_account_may_write_children_anywhere(
    devcluster: RunningCluster, cluster_wide_release: Release
) -> None:
    """The documented price of the default mode (helm/README.md): the same four requests are allowed."""
    for verb, resource, where, _ in FORBIDDEN_OUTSIDE_SERVED:
        assert can_i(devcluster, cluster_wide_release, verb, resource, where), (verb, resource, where)


# --- the operator under the ServiceAccount's token ----------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def service_account_kubeconfig(cluster: RunningCluster, release: Release, path: Path) -> Path:
    """The dev cluster's kubeconfig with the admin's credentials swapped for a token of the
    release's ServiceAccount (TokenRequest, as the kubelet would mount it)."""
    token = cluster.kubectl("create", "token", release.fullname, "-n", release.namespace, "--duration=1h").stdout
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    for user in config["users"]:
        user["user"] = {"token": token.strip()}
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


class Operator:
    """``drs operator`` with the installed Deployment's own arguments (ports made free), as a local
    process authenticated as the release's ServiceAccount."""

    def __init__(self, cluster: RunningCluster, release: Release, kubeconfig: Path, log: Path, pod_name: str) -> None:
        deployment = get(cluster, "deployment", release.fullname, "-n", release.namespace)
        assert deployment is not None
        (c,) = deployment["spec"]["template"]["spec"]["containers"]
        self.metrics_port, self.health_port = free_port(), free_port()
        ports = {"--metrics-port": self.metrics_port, "--health-port": self.health_port}
        args = [f"{a.split('=')[0]}={ports[a.split('=')[0]]}" if a.split("=")[0] in ports else a for a in c["args"]]
        assert c["command"] == ["drs", "operator"]
        self.argv = [DRS, "operator", *args]
        self.env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "POD_NAME": pod_name,
            "POD_NAMESPACE": release.namespace,
        }
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Operator:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def get(self, port: int, path: str) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
                return str(resp.read().decode())
        except OSError:
            return None

    def is_leader(self) -> bool | None:
        """The ``drs_operator_leader`` gauge (None while the metrics endpoint is not up)."""
        text = self.get(self.metrics_port, "/metrics")
        if text is None:
            return None
        return any(line.startswith("drs_operator_leader ") and line.endswith(" 1.0") for line in text.splitlines())

    def errors(self) -> list[str]:
        """Log lines that mean the ServiceAccount lacked a permission."""
        marks = ("forbidden", " 403", "not enough permissions")
        text = self.log.read_text() if self.log.exists() else ""
        return [line for line in text.splitlines() if any(m in line.lower() for m in marks)]


@contextlib.contextmanager
def operators(*ops: Operator) -> Iterator[None]:
    try:
        yield
    finally:
        for op in ops:
            op.stop()


def lease_holder(cluster: RunningCluster, release: Release) -> str:
    lease = get(cluster, "lease", LEASE_NAME, "-n", release.namespace, check=False)
    return str((lease or {}).get("spec", {}).get("holderIdentity") or "")


def drs_status(cluster: RunningCluster, namespace: str, name: str) -> dict[str, Any]:
    obj = get(cluster, "drs", name, "-n", namespace)
    assert obj is not None
    status: dict[str, Any] = obj.get("status") or {}
    return status if status.get("observedGeneration") == obj["metadata"]["generation"] else {}


def test_the_operator_under_the_service_account_token_reconciles_an_example_and_hands_over_its_lease(
    devcluster: RunningCluster, scoped_release: Release, tmp_path: Path
) -> None:
    release = scoped_release
    served = release.workload_namespace
    kubeconfig = service_account_kubeconfig(devcluster, release, tmp_path / "kubeconfig")
    first = Operator(devcluster, release, kubeconfig, tmp_path / "first.log", "operator-first")
    second = Operator(devcluster, release, kubeconfig, tmp_path / "second.log", "operator-second")
    example = yaml.safe_load((ROOT / "examples" / "local-sim.yaml").read_text())
    name = example["metadata"]["name"]

    # the pod runner, so the example's host-network `drs` pods run and turn Ready from their probes
    with pod_runner(devcluster.cluster), operators(first, second):
        first.start()
        wait_for("the first operator to lead", first.is_leader, timeout=60)
        devcluster.kubectl("apply", "-n", served, "-f", "-", input=json.dumps(example))

        def ready_urls(count: int) -> list[str] | None:
            denied = first.errors() + second.errors()
            assert not denied, f"the ServiceAccount lacked a permission: {denied}"
            status = drs_status(devcluster, served, name)
            urls: list[str] = status.get("urls") or []
            return urls if status.get("phase") == Phase.READY and len(urls) == count else None

        assert wait_for("the example to be Ready with 4 URLs", lambda: ready_urls(4), timeout=WAIT_S)
        assert lease_holder(devcluster, release).startswith("operator-first_")

        second.start()
        wait_for("the second operator's metrics", lambda: second.is_leader() is False, timeout=60)
        first.stop()  # releases the Lease on a clean shutdown
        wait_for("the second operator to take the Lease", second.is_leader, timeout=60)
        assert lease_holder(devcluster, release).startswith("operator-second_")

        # the new leader scales down: deletes children, patches status
        devcluster.kubectl("patch", "drs", name, "-n", served, "--type=merge", "-p", '{"spec": {"replicas": 1}}')
        assert wait_for("the example to be Ready with 2 URLs", lambda: ready_urls(2), timeout=WAIT_S)

    assert not first.errors() + second.errors()


def test_a_follower_answers_healthz_so_the_liveness_probe_keeps_it(
    devcluster: RunningCluster, scoped_release: Release, tmp_path: Path
) -> None:
    kubeconfig = service_account_kubeconfig(devcluster, scoped_release, tmp_path / "kubeconfig")
    leader = Operator(devcluster, scoped_release, kubeconfig, tmp_path / "leader.log", "operator-leader")
    follower = Operator(devcluster, scoped_release, kubeconfig, tmp_path / "follower.log", "operator-follower")
    with operators(leader, follower):
        leader.start()
        wait_for("the leader", leader.is_leader, timeout=60)
        follower.start()
        wait_for("the follower's metrics", lambda: follower.is_leader() is False, timeout=60)
        assert wait_for("the follower's /healthz", lambda: follower.get(follower.health_port, "/healthz"), timeout=20)
