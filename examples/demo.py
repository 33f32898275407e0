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

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from drs_devcluster import build, inpod, nodeconfig
from drs_devcluster.cluster import DevCluster

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pod-network-sim.yaml"
CLIENT = ROOT / "examples" / "gym_client.py"
NAME = "pod-sim"
NAMESPACE = "default"
READY_TIMEOUT_S = 300.0
CLIENT_TIMEOUT_S = 300.0


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def kubectl(cluster: DevCluster, *args: str, input: str | None = None, check: bool = True) -> str:
    out = subprocess.run(
        [str(cluster.layout.bin_dir / "kubectl"), *args],
        input=input,
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": str(cluster.layout.kubeconfig)},
        timeout=120,
        check=False,
    )
    if check and out.returncode != 0:
        raise SystemExit(f"kubectl {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def ensure_cluster() -> DevCluster:
    cluster = DevCluster.at()
    status = cluster.status()
    if status["components"] and all(c["running"] for c in status["components"].values()):
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


def wait_ready(cluster: DevCluster) -> dict[str, Any]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        body = json.loads(kubectl(cluster, "get", "drs", NAME, "-n", NAMESPACE, "-o", "json"))
        st = body.get("status") or {}
        progress = next((c["message"] for c in st.get("conditions", []) if c["type"] == "Progressing"), "")
        line = f"phase={st.get('phase')} ready={st.get('readyReplicas', 0)}/{st.get('replicas', '?')} {progress}"
        if line != last:
            say(line)
            last = line
        if st.get("phase") == "Ready" and st.get("observedGeneration") == body["metadata"]["generation"]:
            return st
        time.sleep(1)
    raise SystemExit(f"{NAME} not Ready after {READY_TIMEOUT_S:.0f}s; see `drs dev kubectl describe drs {NAME}`")


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
    status = wait_ready(cluster)
    say(f"{NAME} Ready in {time.monotonic() - t0:.0f}s; frontends: {status['urls']}")
    pods = kubectl(cluster, "get", "pods", "-n", NAMESPACE, "-o", "wide", "-l", f"disagg.dev/replicaset={NAME}")
    print(pods, end="")
    rc = run_client(cluster)
    say(f"demo finished in {time.monotonic() - started:.0f}s (rc {rc}); `make demo-down` stops everything")
    return rc


if __name__ == "__main__":
    sys.exit(main())
