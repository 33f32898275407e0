"""Two real nodes in one cluster, and a second cluster with real nodes beside it: nothing a real
node uses is named machine-wide (device-plugin socket, nftables table, bridge, CNI state,
containerd's shim and runc state, cgroup roots), and ``drs dev down`` leaves the host as it was."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from drs_devcluster import hostshare, nodeconfig, profiles
from drs_devcluster.testing import REAL_STATE_DIR, SECOND_REAL_PORT_BASE, RunningCluster, real_node_cluster

from .pods import apply, image_pod, logs, pod, wait_phase

pytestmark = [pytest.mark.cluster, pytest.mark.realnode]


def on_node(body: dict[str, Any], index: int) -> dict[str, Any]:
    body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": nodeconfig.node_name(index)}
    return body


def test_both_nodes_are_ready_with_gpus_from_their_own_device_plugins(realcluster: RunningCluster) -> None:
    for i in range(2):
        node = json.loads(realcluster.kubectl("get", "node", nodeconfig.node_name(i), "-o", "json").stdout)
        assert node["status"]["allocatable"][profiles.GPU_RESOURCE] == str(nodeconfig.GPUS_PER_REAL_NODE)
        assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"
        addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
        assert addresses["InternalIP"] == nodeconfig.network(realcluster.cluster.layout).node_ip(i)


# The Service is programmed by kube-proxy asynchronously: until its nftables sync has the new
# ClusterIP, the cluster's namespace has no route for it and connect() fails at once with
# ENETUNREACH (seen once in CI under load). The client waits for that sync the way any client of a
# new Service must: it retries a failed connection until a deadline, and says how many it took.
CLIENT = """
import socket, sys, time, urllib.request
svc, pod_ip = sys.argv[1], sys.argv[2]
def get(url):
    deadline, attempts = time.monotonic() + 60, 0
    while True:
        attempts += 1
        try:
            return urllib.request.urlopen(url, timeout=10).read().decode().strip(), attempts
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
print("resolved", socket.gethostbyname("web"))
body, attempts = get("http://web:8080/who.txt")
print("service", body)
print("service attempts", attempts)
print("direct", get(f"http://{pod_ip}:8080/who.txt")[0])
"""


def test_a_pod_on_one_node_reaches_a_pod_on_the_other_directly_and_through_a_service(
    realcluster: RunningCluster, realns: str
) -> None:
    net = nodeconfig.network(realcluster.cluster.layout)
    server = on_node(
        image_pod(
            "web",
            realns,
            'mkdir -p /tmp/www && echo "web on $NODE" > /tmp/www/who.txt && exec python -m http.server 8080 -d /tmp/www',
            container={
                "ports": [{"containerPort": 8080}],
                "env": [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
            },
        ),
        1,
    )
    server["metadata"]["labels"] = {"app": "web"}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": realns},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 8080, "targetPort": 8080}]},
    }
    apply(realcluster, server, service)
    realcluster.kubectl("wait", "--for=condition=Ready", "pod/web", "-n", realns, "--timeout=120s")
    web_ip = pod(realcluster, realns, "web")["status"]["podIP"]
    cluster_ip = realcluster.kubectl("get", "svc", "web", "-n", realns, "-o", "jsonpath={.spec.clusterIP}").stdout
    client = on_node(image_pod("client", realns, f"exec python -c '{CLIENT}' {cluster_ip} {web_ip}"), 0)
    apply(realcluster, client)
    body = wait_phase(realcluster, realns, "client", {"Succeeded", "Failed"})
    out = logs(realcluster, realns, "client")
    assert body["status"]["phase"] == "Succeeded", out
    assert body["spec"]["nodeName"] == nodeconfig.node_name(0)
    assert pod(realcluster, realns, "web")["spec"]["nodeName"] == nodeconfig.node_name(1)
    # Each node hands out addresses from its own slice of the cluster's network.
    for ip, index in ((body["status"]["podIP"], 0), (web_ip, 1)):
        first, last = net.pod_range(index)
        assert ipaddress.IPv4Address(first) <= ipaddress.IPv4Address(ip) <= ipaddress.IPv4Address(last), (ip, index)
    assert f"resolved {cluster_ip}" in out, out
    assert f"service web on {nodeconfig.node_name(1)}" in out, out
    assert f"direct web on {nodeconfig.node_name(1)}" in out, out


# ------------------------------------------------------------------ a second cluster beside


def _run(*argv: str) -> str:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False).stdout


def host_snapshot() -> dict[str, Any]:
    """What of the host a real-node cluster could leave changed."""
    links = sorted(re.findall(r"^\d+: ([^:@]+)", _run("ip", "-o", "link"), flags=re.M))
    netns = sorted(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else []
    rules = [line for line in _run("iptables-save").splitlines() if not line.startswith(("#", ":"))]
    with open("/proc/self/mountinfo") as f:
        mounts = sorted(line.split()[4] for line in f)
    return {
        "links": links,
        "netns": netns,
        "nftTables": sorted(_run("nft", "list", "tables").splitlines()),
        "iptables": rules,
        "routes": sorted(_run("ip", "-4", "route").splitlines()),
        "mounts": mounts,
        "sysctls": {n: hostshare.read_sysctl(n) for n in (*hostshare.KUBELET_SYSCTLS, "net.ipv4.ip_forward")},
        "paths": {str(p): p.exists() for p in nodeconfig.NODE_BINDS},
    }


def processes_under(root: Path) -> list[str]:
    """Processes whose command line names a path under ``root`` (what a cluster there started)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(root) in argv:
            found.append(f"{pid}: {argv.replace(chr(0), ' ')[:200]}")
    return found


# A pod's way to the API server, as the operator's: the `kubernetes` Service (kube-proxy's DNAT in
# the cluster's network namespace), the bridge, the veth to the host, with the pod's own token. The
# script prints the HTTP status it got (an error status too) and the test wants 200 (/version needs
# no role); a refused or timed-out connection fails the pod.
API_CLIENT = """
import ssl, urllib.request, urllib.error
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
req = urllib.request.Request("https://kubernetes.default.svc/version",
                             headers={"Authorization": "Bearer " + open(f"{sa}/token").read()})
try:
    status = urllib.request.urlopen(req, timeout=10, context=ctx).status
except urllib.error.HTTPError as exc:
    status = exc.code
print("api server answered", status)
"""


def reaches_the_api_server(cluster: RunningCluster, ns: str, index: int) -> str:
    """Run ``API_CLIENT`` in a pod on node ``index``; its log (the pod must succeed)."""
    name = f"api-from-{index}"
    apply(cluster, on_node(image_pod(name, ns, f"exec python -c '{API_CLIENT}'"), index))
    body = wait_phase(cluster, ns, name, {"Succeeded", "Failed"})
    out = logs(cluster, ns, name)
    assert body["status"]["phase"] == "Succeeded", out
    return out


def unbothered(cluster: RunningCluster, index: int) -> None:
    """Node ``index`` is Ready, under no pressure and untainted: what a second cluster on the same
    machine must not change (its image import on a nearly full disk once set DiskPressure here,
    whose taint kept this cluster's pods off both nodes for five minutes, with Ready still True)."""
    node = json.loads(cluster.kubectl("get", "node", nodeconfig.node_name(index), "-o", "json").stdout)
    true = sorted(c["type"] for c in node["status"]["conditions"] if c["status"] == "True")
    assert true == ["Ready"], (nodeconfig.node_name(index), true)
    assert not node["spec"].get("taints"), (nodeconfig.node_name(index), node["spec"]["taints"])


def test_a_second_cluster_with_real_nodes_runs_beside_and_leaves_nothing_behind(
    realcluster: RunningCluster, realns: str
) -> None:
    before = host_snapshot()
    state = REAL_STATE_DIR.with_name(REAL_STATE_DIR.name + "-second")
    gen = real_node_cluster(state, SECOND_REAL_PORT_BASE, nodes=1, net_offset=1)
    second = next(gen)
    try:
        first_net = nodeconfig.network(realcluster.cluster.layout)
        second_net = nodeconfig.network(second.cluster.layout)
        assert first_net.netns != second_net.netns and first_net.cidr != second_net.cidr
        during = host_snapshot()
        assert second_net.netns in during["netns"] and second_net.host_veth in during["links"]
        # The second cluster's node runs pods while the first cluster's nodes stay Ready.
        second.kubectl("wait", "--for=create", "serviceaccount/default", "--timeout=60s")
        apply(second, image_pod("hello", "default", "echo hello-from-the-second-cluster"))
        assert wait_phase(second, "default", "hello", {"Succeeded", "Failed"})["status"]["phase"] == "Succeeded"
        assert "hello-from-the-second-cluster" in logs(second, "default", "hello")
        for i in range(2):
            unbothered(realcluster, i)
        assert processes_under(state)
    finally:
        next(gen, None)  # the fixture's `drs dev down`
    after = host_snapshot()
    assert processes_under(state) == []
    assert not state.exists()
    assert after == before
    assert realcluster.cluster.layout.state_dir.exists()
    for i in range(2):  # the first cluster is untouched: its nodes, and its pods' way to the API server
        unbothered(realcluster, i)
        assert "api server answered 200" in reaches_the_api_server(realcluster, realns, i)


def test_dev_status_lists_every_real_node_process_with_its_pid_and_state(realcluster: RunningCluster) -> None:
    from click.testing import CliRunner
    from drs_devcluster.cli import dev

    state = str(realcluster.cluster.layout.state_dir)
    info = json.loads(CliRunner().invoke(dev, ["status", "--state-dir", state, "-o", "json"]).output)
    real = info["realNodes"]
    firewall = {"kube-router"} if profiles.network_policies() else set()  # NetworkPolicies enforced by default
    expected = (
        {"kube-proxy", "coredns"}
        | firewall
        | {
            f"{what} {nodeconfig.node_name(i)}"
            for i in range(2)
            for what in ("kubelet", "containerd", "device-plugin", "mount-namespace")
        }
    )
    assert set(real) == expected
    for name, proc in real.items():
        assert proc["running"] and proc["state"] in {"sleeping", "running", "idle"}, (name, proc)
        assert Path(f"/proc/{proc['pid']}").is_dir()
    text = CliRunner().invoke(dev, ["status", "--state-dir", state])
    assert text.exit_code == 0, text.output
    line = next(line for line in text.output.splitlines() if "kubelet real-001" in line)
    assert f"pid {real['kubelet real-001']['pid']}" in line
