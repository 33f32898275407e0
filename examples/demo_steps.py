"""The steps the local demos share (`make demo`, `make demo-kwok`, ``examples/wide_demo.py``).

``kubectl`` against the dev cluster, bringing up a dev cluster of simulated nodes (or reusing the
running one), the operator as a local process, and waiting for a DisaggReplicaSet to be Ready and
its frontends to serve. The trainer-side client loop is ``examples/gym_client.py``'s ``drive``
(one client for the in-pod demo and the local one).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from drs_devcluster import build, processes
from drs_devcluster.cluster import DevCluster
from drs_protocol import routes

ROOT = Path(__file__).resolve().parents[1]
#: ``DRS_DEV_PORT_BASE``: the ports of a dev cluster the demo brings up (the saved ones when reused).
PORT_BASE_ENV = "DRS_DEV_PORT_BASE"


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def running(cluster: DevCluster) -> bool:
    """Whether every component of the dev cluster of ``$DRS_DEV_STATE_DIR`` is running."""
    status = cluster.status()
    return bool(status["components"]) and all(c["running"] for c in status["components"].values())


def ensure_sim_cluster(profile: str, nodes: int) -> DevCluster:
    """The dev cluster of ``$DRS_DEV_STATE_DIR`` (on ``$DRS_DEV_PORT_BASE`` when set): the running
    one, or a new one with ``nodes`` simulated nodes of ``profile``."""
    port_base = int(os.environ.get(PORT_BASE_ENV, "0")) or None
    cluster = DevCluster.at(port_base=port_base)
    if running(cluster):
        say(f"reusing the running dev cluster ({cluster.status().get('nodes')})")
        return DevCluster.at(bin_dir=build.bin_dir())
    cluster.down()
    cluster = DevCluster.at(port_base=port_base)
    cluster.up(profile, nodes, port_setting=PORT_BASE_ENV)
    return cluster


def install_crd(cluster: DevCluster) -> None:
    kubectl(cluster, "apply", "-f", str(ROOT / "crds"))
    kubectl(cluster, "wait", "--for=condition=Established", "crd/disaggreplicasets.disagg.dev", "--timeout=60s")


def ensure_operator(cluster: DevCluster, metrics_port: int, health_port: int) -> None:
    """The operator as a local process (tracked in the state directory, so `drs dev down` stops it)."""
    pids = cluster.layout.state_dir / "operator-pids.json"
    if any(processes.is_running(t) for t in processes.load(pids)):
        say("operator already running")
        return
    log = cluster.layout.log("operator")
    drs = str(Path(sys.executable).parent / "drs")
    env = {**os.environ, "KUBECONFIG": str(cluster.layout.kubeconfig)}
    # argv[0] is the interpreter, so the pid file names the executable /proc shows for it and
    # `drs dev down` recognises (and stops) the process.
    argv = [sys.executable, drs, "operator", "--metrics-port", str(metrics_port), "--health-port", str(health_port)]
    argv += ["--lease-namespace", "default"]
    tracked = processes.start("operator", argv, log, env=env)
    processes.save(pids, [tracked])
    say(f"operator started (pid {tracked.pid}, log {log}, metrics http://127.0.0.1:{metrics_port}{routes.METRICS})")


def wait_ready(cluster: DevCluster, name: str, timeout_s: float, namespace: str = "default") -> dict[str, Any]:
    """The DisaggReplicaSet's status once it is Ready at its generation, showing progress meanwhile."""
    started, last = time.monotonic(), ""
    while time.monotonic() - started < timeout_s:
        body = json.loads(kubectl(cluster, "get", "drs", name, "-n", namespace, "-o", "json"))
        st = body.get("status") or {}
        progress = next((c["message"] for c in st.get("conditions", []) if c["type"] == "Progressing"), "")
        line = f"phase={st.get('phase')} ready={st.get('readyReplicas', 0)}/{st.get('replicas', '?')} {progress}"
        if line != last:
            say(f"{line} (after {time.monotonic() - started:.0f}s)")
            last = line
        if st.get("phase") == "Ready" and st.get("observedGeneration") == body["metadata"]["generation"]:
            status: dict[str, Any] = st
            return status
        time.sleep(1)
    raise SystemExit(f"{name} not Ready after {timeout_s:.0f}s; see `drs dev kubectl describe drs {name}` and the logs")


def wait_serving(urls: list[str], timeout_s: float) -> None:
    """Until every frontend answers /ready (the pod runner makes a pod Ready from its real probe;
    this checks the real thing from here)."""
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        for url in list(pending):
            try:
                with urllib.request.urlopen(url + routes.READY, timeout=2) as resp:
                    if resp.status == 200:
                        pending.remove(url)
            except OSError:
                pass
        if pending:
            time.sleep(0.5)
    if pending:
        raise SystemExit(f"frontends not serving after {timeout_s:.0f}s: {pending}")
