"""NetworkPolicies enforced on the real nodes (kube-router's firewall, iptables + ipset, started
with the cluster): actual TCP connections from pods to the engines' serving ports, admitted or
refused as the operator's per-replica policy and the chart's namespace policies say, and each
refusal turned into an admission by changing only the policy or the client's labels (so every
check can fail both ways).

One fleet (``examples/pod-network-sim.yaml``: 2 replicas of 1 prefill + 1 decode, a frontend
each) in a namespace of this module, with two probe pods beside it: ``sidecar`` (listed in
``engineClients``, as the trainer's refit sidecar is) and ``stranger`` (listed nowhere). A probe
is one ``connect()`` with ``CONNECT_TIMEOUT_S`` run by ``kubectl exec`` inside the source pod."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_devcluster import build, nodeconfig
from drs_devcluster.testing import RunningCluster, namespace_for, wait_for
from drs_operator.api.constants import LABEL_REPLICA, LABEL_REPLICASET, LABEL_ROLE

from .pods import OPERATOR_NS, apply, image_pod, wait_phase
from .test_fleet_on_real_node import EXAMPLE, converged, fleet_pods, run_client, wait_drs

pytestmark = [pytest.mark.cluster, pytest.mark.realnode]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "drs-operator"
#: How long one probe waits for the TCP handshake. kube-router REJECTs (an ICMP port-unreachable:
#: ECONNREFUSED at once); a dropped SYN would show as a timeout after this long.
CONNECT_TIMEOUT_S = 3.0
#: How long a policy or label change may take to reach kube-router's rules.
POLICY_SYNC_S = 60.0
#: Refusals in a row that count as "refused" once the rules are in place.
REFUSALS_IN_A_ROW = 3
PROBE_LABEL = "drs-test/probe"
SIDECAR = "trainer-sidecar"
#: The trainer-side client pod (``inpod.client_objects`` labels it ``app: <name>``).
CLIENT = "client-under-policy"
PROBE = """
import socket, sys
s = socket.socket()
s.settimeout(float(sys.argv[3]))
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("admitted")
except socket.timeout:
    print("timeout")
except ConnectionRefusedError:
    print("refused")
except OSError as exc:
    print(f"error {exc!r}")
"""


def policy_fleet(ns: str, enabled: bool) -> dict[str, Any]:
    """The example fleet with per-replica policies admitting the sidecar and the operator's namespace."""
    body: dict[str, Any] = json.loads(json.dumps(EXAMPLE))
    body["metadata"]["namespace"] = ns
    body["spec"]["networkPolicy"] = {
        "enabled": enabled,
        "engineClients": [
            {"podSelector": {"matchLabels": {PROBE_LABEL: SIDECAR}}},
            # the trainer-side client reads the prefill engines' /metrics (prefix-cache hits)
            {"podSelector": {"matchLabels": {"app": CLIENT}}},
            # not the operator: the policies admit its own pods (it asks every engine which weights
            # it holds: docs/weights.md), as the operator test below shows
        ],
    }
    return body


def probe_pod(name: str, ns: str, role: str) -> dict[str, Any]:
    body = image_pod(name, ns, "sleep 3600", terminationGracePeriodSeconds=0)
    body["metadata"]["labels"] = {PROBE_LABEL: role}
    return body


@pytest.fixture(scope="module")
def policy_ns(realcluster: RunningCluster, operator: str) -> Iterator[str]:
    """The fleet with its per-replica policies and the two probe pods, all Ready."""
    ns = namespace_for("network-policies")
    realcluster.kubectl("create", "namespace", ns)
    realcluster.kubectl("wait", "--for=create", "serviceaccount/default", "-n", ns, "--timeout=60s")
    try:
        realcluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(policy_fleet(ns, enabled=True)))
        apply(realcluster, probe_pod("sidecar", ns, SIDECAR), probe_pod("stranger", ns, "stranger"))
        for name in ("sidecar", "stranger"):
            wait_phase(realcluster, ns, name, {"Running"})
        wait_drs(realcluster, ns, converged, "pod-sim Ready with per-replica NetworkPolicies")
        yield ns
    finally:
        realcluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def engine(cluster: RunningCluster, ns: str, replica: int, role: str) -> tuple[str, int]:
    """The pod IP and serving port of ``role``'s engine of ``replica``."""
    for p in fleet_pods(cluster, ns):
        labels = p["metadata"]["labels"]
        if labels[LABEL_ROLE] == role and labels[LABEL_REPLICA] == str(replica):
            return p["status"]["podIP"], int(p["spec"]["containers"][0]["ports"][0]["containerPort"])
    raise AssertionError(f"no {role} pod of replica {replica} in {ns}")


def pod_of(cluster: RunningCluster, ns: str, replica: int, role: str) -> str:
    for p in fleet_pods(cluster, ns):
        labels = p["metadata"]["labels"]
        if labels[LABEL_ROLE] == role and labels[LABEL_REPLICA] == str(replica):
            return str(p["metadata"]["name"])
    raise AssertionError(f"no {role} pod of replica {replica} in {ns}")


def operator_pods(cluster: RunningCluster) -> list[str]:
    """The names of the chart's operator pods that are running."""
    out = cluster.kubectl("get", "pods", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=drs-operator", "-o", "json")
    names = [p["metadata"]["name"] for p in json.loads(out.stdout)["items"] if p["status"].get("phase") == "Running"]
    assert names, f"no running operator pod in {OPERATOR_NS}"
    return names


def probe(cluster: RunningCluster, ns: str, source: str, target: tuple[str, int]) -> str:
    """One TCP connect from inside pod ``source``: admitted, refused, timeout or error …"""
    ip, port = target
    argv = ["exec", source, "-n", ns, "--", "python", "-c", PROBE, ip, str(port), str(CONNECT_TIMEOUT_S)]
    t0 = time.monotonic()
    out = cluster.kubectl(*argv, check=False)
    outcome = out.stdout.strip() or f"kubectl exec failed: {out.stderr.strip()}"
    print(f"probe {source} -> {ip}:{port}: {outcome} ({time.monotonic() - t0:.1f}s with kubectl exec)")
    return outcome


def admitted(cluster: RunningCluster, ns: str, source: str, target: tuple[str, int]) -> None:
    """The connection is admitted (at once, or within ``POLICY_SYNC_S`` of a change)."""
    wait_for(
        f"{source} -> {target} admitted",
        lambda: probe(cluster, ns, source, target) == "admitted",
        timeout=POLICY_SYNC_S,
    )


def refused(cluster: RunningCluster, ns: str, source: str, target: tuple[str, int]) -> None:
    """The connection is refused ``REFUSALS_IN_A_ROW`` times in a row (within ``POLICY_SYNC_S``)."""
    streak: list[str] = []

    def blocked() -> bool:
        outcome = probe(cluster, ns, source, target)
        assert outcome in ("admitted", "refused", "timeout"), outcome  # a broken probe is no refusal
        streak[:] = [*streak, outcome][-REFUSALS_IN_A_ROW:] if outcome != "admitted" else []
        return len(streak) == REFUSALS_IN_A_ROW

    wait_for(f"{source} -> {target} refused {REFUSALS_IN_A_ROW} times in a row", blocked, timeout=POLICY_SYNC_S)


def set_replica_policies(cluster: RunningCluster, ns: str, enabled: bool) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(policy_fleet(ns, enabled=enabled)))
    wait_drs(cluster, ns, converged, f"pod-sim converged with networkPolicy.enabled={enabled}")
    want = 2 if enabled else 0

    def count() -> bool:
        out = cluster.kubectl("get", "networkpolicy", "-n", ns, "-l", f"{LABEL_REPLICASET}=pod-sim", "-o", "name")
        return len(out.stdout.split()) == want

    wait_for(f"{want} per-replica NetworkPolicies in {ns}", count, timeout=POLICY_SYNC_S)


def chart_policies(cluster: RunningCluster, ns: str, frontend_clients: list[dict[str, Any]]) -> str:
    """The chart's namespace policies for ``ns``, rendered by helm as an install would."""
    argv = [
        str(cluster.bin_dir / "helm"),
        "template",
        "drs",
        str(CHART),
        "--namespace",
        "drs-system",
        "--kube-version",
        build.KUBERNETES_VERSION,
        "--show-only",
        "templates/networkpolicy.yaml",
        "--set",
        "networkPolicy.enabled=true",
        "--set-json",
        f"networkPolicy.namespaces={json.dumps([ns])}",
        "--set-json",
        f"networkPolicy.engineClients={json.dumps([{'podSelector': {'matchLabels': {PROBE_LABEL: SIDECAR}}}])}",
        "--set-json",
        f"networkPolicy.frontendClients={json.dumps(frontend_clients)}",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    return out.stdout


def test_the_replica_policy_admits_its_own_frontend_engines_and_engine_clients_only(
    realcluster: RunningCluster, policy_ns: str
) -> None:
    ns = policy_ns
    realcluster.kubectl("delete", "networkpolicy", "-n", ns, "-l", "app.kubernetes.io/name=drs-operator", check=False)
    set_replica_policies(realcluster, ns, enabled=True)
    frontend0 = pod_of(realcluster, ns, 0, "frontend")
    decode0, decode1 = pod_of(realcluster, ns, 0, "decode"), pod_of(realcluster, ns, 1, "decode")
    prefill0, prefill1 = engine(realcluster, ns, 0, "prefill"), engine(realcluster, ns, 1, "prefill")
    decode1_addr = engine(realcluster, ns, 1, "decode")

    # A frontend reaches its own replica's engines; the same frontend is refused by the other's.
    admitted(realcluster, ns, frontend0, prefill0)
    admitted(realcluster, ns, frontend0, engine(realcluster, ns, 0, "decode"))
    refused(realcluster, ns, frontend0, prefill1)
    refused(realcluster, ns, frontend0, decode1_addr)
    # The KV handoff: a decode engine reaches its own replica's prefill engine; the other
    # replica's engines too (a path-less catch-up streams the desired weights from a peer engine
    # of any replica: docs/weights.md), while that replica's frontend stays refused (above).
    admitted(realcluster, ns, decode0, prefill0)
    admitted(realcluster, ns, decode1, prefill1)
    admitted(realcluster, ns, decode1, prefill0)
    # engineClients: the sidecar is admitted to every replica's engines, an unlisted pod to none.
    admitted(realcluster, ns, "sidecar", prefill0)
    admitted(realcluster, ns, "sidecar", decode1_addr)
    refused(realcluster, ns, "stranger", prefill0)
    refused(realcluster, ns, "stranger", decode1_addr)
    # The same pod and connection, once its labels make it the listed client: admitted; and back.
    realcluster.kubectl("label", "pod", "stranger", "-n", ns, f"{PROBE_LABEL}={SIDECAR}", "--overwrite")
    admitted(realcluster, ns, "stranger", prefill0)
    realcluster.kubectl("label", "pod", "stranger", "-n", ns, f"{PROBE_LABEL}=stranger", "--overwrite")
    refused(realcluster, ns, "stranger", prefill0)
    # The operator's own pods, listed nowhere in engineClients: admitted to every replica's
    # engines (the chart tells the operator the labels that select them).
    for operator_pod in operator_pods(realcluster):
        admitted(realcluster, OPERATOR_NS, operator_pod, prefill0)
        admitted(realcluster, OPERATOR_NS, operator_pod, decode1_addr)

    # Turns through the frontends' Service URLs complete, each through a prefill and a decode
    # engine of one replica (the decode engine fetched the prefill engine's KV over the network).
    out = run_client(realcluster, ns, name=CLIENT)
    turns = [line for line in out.splitlines() if " turn " in line and " via http://pod-sim-r" in line]
    assert len(turns) == 12, out
    assert all("prefill=" in t and "prefill=None" not in t and "decode=None" not in t for t in turns), out

    # Without the per-replica policies the refused connections are admitted.
    set_replica_policies(realcluster, ns, enabled=False)
    admitted(realcluster, ns, frontend0, prefill1)
    admitted(realcluster, ns, decode1, prefill0)
    admitted(realcluster, ns, "stranger", prefill0)


def test_the_chart_policies_admit_the_namespace_and_listed_clients_as_the_docs_say(
    realcluster: RunningCluster, policy_ns: str
) -> None:
    ns = policy_ns
    set_replica_policies(realcluster, ns, enabled=False)
    frontend0 = pod_of(realcluster, ns, 0, "frontend")
    prefill1 = engine(realcluster, ns, 1, "prefill")
    frontend1 = engine(realcluster, ns, 1, "frontend")
    # No policy: anyone reaches the engines and the frontends.
    admitted(realcluster, ns, "stranger", prefill1)
    admitted(realcluster, ns, "stranger", frontend1)

    only_sidecar = [{"podSelector": {"matchLabels": {PROBE_LABEL: SIDECAR}}}]
    realcluster.kubectl("apply", "-n", ns, "-f", "-", input=chart_policies(realcluster, ns, only_sidecar))
    # engines: every frontend and engine of the namespace (any replica, any fleet) and engineClients.
    refused(realcluster, ns, "stranger", prefill1)
    admitted(realcluster, ns, frontend0, prefill1)
    admitted(realcluster, ns, "sidecar", prefill1)
    # frontends: only frontendClients, on the pod's own address …
    refused(realcluster, ns, "stranger", frontend1)
    admitted(realcluster, ns, "sidecar", frontend1)
    # Through the frontend's Service too: kube-proxy masquerades Service traffic here, but only
    # after the filter hook (postrouting), so kube-router sees the client's own address.
    service_ip = realcluster.kubectl("get", "service", "pod-sim-r1-f0", "-n", ns, "-o", "jsonpath={.spec.clusterIP}")
    frontend1_service = (service_ip.stdout.strip(), frontend1[1])
    refused(realcluster, ns, "stranger", frontend1_service)
    admitted(realcluster, ns, "sidecar", frontend1_service)
    # frontendClients empty: the frontends are open to anyone again; the engines stay closed.
    realcluster.kubectl("apply", "-n", ns, "-f", "-", input=chart_policies(realcluster, ns, []))
    admitted(realcluster, ns, "stranger", frontend1)
    admitted(realcluster, ns, "stranger", frontend1_service)
    refused(realcluster, ns, "stranger", prefill1)
    realcluster.kubectl("delete", "networkpolicy", "-n", ns, "-l", "app.kubernetes.io/name=drs-operator")
    admitted(realcluster, ns, "stranger", prefill1)


def test_a_pod_on_the_second_real_node_is_filtered_too(realcluster: RunningCluster, policy_ns: str) -> None:
    """One kube-router filters every real node's pods (``nodebuild.KUBE_ROUTER_PATCH``): a server
    pinned to ``real-001``, behind a deny-all ingress policy, refuses a pod's connection."""
    ns = policy_ns
    server = image_pod("server", ns, "exec python -m http.server 8080", nodeName=nodeconfig.node_name(1))
    server["metadata"]["labels"] = {PROBE_LABEL: "server"}
    server["spec"]["terminationGracePeriodSeconds"] = 0
    apply(realcluster, server)
    target = (wait_phase(realcluster, ns, "server", {"Running"})["status"]["podIP"], 8080)
    admitted(realcluster, ns, "stranger", target)  # also waits for the server to listen
    deny = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "deny-server", "namespace": ns},
        "spec": {"podSelector": {"matchLabels": {PROBE_LABEL: "server"}}, "policyTypes": ["Ingress"]},
    }
    apply(realcluster, deny)
    refused(realcluster, ns, "stranger", target)
    realcluster.kubectl("delete", "networkpolicy", "deny-server", "-n", ns)
    admitted(realcluster, ns, "stranger", target)
