"""`make demo`: the main job, end to end, on a dev cluster with a real node.

1. bring up the dev control plane with one real node (kubelet + containerd + CNI + kube-proxy +
   CoreDNS + the fake GPU device plugin) and no simulated ones, building the project's image with
   no registry when it is missing (`drs dev images`); a running one is reused;
2. `helm install` the operator chart (helm/drs-operator) with that image: the operator runs as a
   pod with its ServiceAccount, talking to the apiserver through the `kubernetes` Service;
3. apply examples/pod-network-sim.yaml (sim engines, the CPU test double of a GPU engine, and
   frontends as containers on the real node, in pod networking) and wait until it is Ready;
4. run the trainer-side client (examples/gym_client.py) in a pod: it reads `status.urls` (Service
   names, resolved by the cluster's DNS) and drives multi-turn conversations through them, as
   NeMo-Gym does, printing which engines served each turn and the prefix-cache hits.

Everything keeps running afterwards; `make demo-down` (`drs dev down`) stops all of it and undoes
the host changes. `make demo-kwok` is the simulated-node demo (with the trainer sidecar's refit).
"""

from __future__ import annotations

import sys
import time

import yaml
from demo_steps import ROOT, kubectl, running, say, wait_ready
from drs_devcluster import build, inpod, nodeconfig
from drs_devcluster.cluster import DevCluster

EXAMPLE = ROOT / "examples" / "pod-network-sim.yaml"
CLIENT = ROOT / "examples" / "gym_client.py"
NAME = "pod-sim"
NAMESPACE = "default"
READY_TIMEOUT_S = 300.0
CLIENT_TIMEOUT_S = 300.0


def ensure_cluster() -> DevCluster:
    cluster = DevCluster.at()
    if running(cluster):
        nodes = kubectl(DevCluster.at(bin_dir=build.bin_dir()), "get", "nodes", "-o", "name", check=False)
        if f"node/{nodeconfig.node_name(0)}" in nodes:
            say("reusing the running dev cluster with its real node")
            return DevCluster.at(bin_dir=build.bin_dir())
        raise SystemExit("a dev cluster without real nodes is running: `make demo-down` first (or `make demo-kwok`)")
    cluster.down()
    cluster = DevCluster.at()
    t0 = time.monotonic()
    cluster.up("hgx", 0, real_nodes=1)
    say(f"dev cluster with 1 real node up in {time.monotonic() - t0:.0f}s")
    return cluster


def run_client(cluster: DevCluster) -> int:
    objs = inpod.client_objects("gym-client", NAMESPACE, CLIENT.read_text(), ["--name", NAME, "--namespace", NAMESPACE])
    kubectl(cluster, "delete", "pod", "gym-client", "-n", NAMESPACE, "--ignore-not-found", "--wait=true")
    kubectl(cluster, "apply", "-f", "-", input=yaml.safe_dump_all(objs))
    say("client pod gym-client started (image drs, in-cluster credentials, reads the status itself)")
    deadline = time.monotonic() + CLIENT_TIMEOUT_S
    phase = ""
    while time.monotonic() < deadline and phase not in ("Succeeded", "Failed"):
        phase = kubectl(cluster, "get", "pod", "gym-client", "-n", NAMESPACE, "-o", "jsonpath={.status.phase}")
        time.sleep(1)
    print(kubectl(cluster, "logs", "gym-client", "-n", NAMESPACE, check=False), end="", flush=True)
    return 0 if phase == "Succeeded" else 1


def main() -> int:
    started = time.monotonic()
    cluster = ensure_cluster()
    t0 = time.monotonic()
    inpod.helm_install(cluster)
    say(
        f"helm install of helm/drs-operator (image drs, pod with its ServiceAccount) Ready in {time.monotonic() - t0:.0f}s"
    )
    t0 = time.monotonic()
    kubectl(cluster, "apply", "-n", NAMESPACE, "-f", str(EXAMPLE))
    status = wait_ready(cluster, NAME, READY_TIMEOUT_S, NAMESPACE)
    say(f"{NAME} Ready in {time.monotonic() - t0:.0f}s; frontends: {status['urls']}")
    pods = kubectl(cluster, "get", "pods", "-n", NAMESPACE, "-o", "wide", "-l", f"disagg.dev/replicaset={NAME}")
    print(pods, end="")
    rc = run_client(cluster)
    say(f"demo finished in {time.monotonic() - started:.0f}s (rc {rc}); `make demo-down` stops everything")
    return rc


if __name__ == "__main__":
    sys.exit(main())
