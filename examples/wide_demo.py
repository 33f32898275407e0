"""The wide GB200 example on the local control plane: a TP16 prefill engine as a gang of four pods.

1. bring up the dev control plane with eight simulated 4-GPU GB200 trays (one NVL72 clique), or
   reuse the running one; install the CRD; start the operator (free ports) and the pod runner;
2. apply ``examples/gb200-wide.yaml`` made local: the ``sim`` backend (the CPU test double) and
   host networking (the pod runner runs host-network pods as processes on their node's loopback
   address), no model volume;
3. wait until Ready, then print ``kubectl get drs``, every engine's ranks from the status (pod,
   node, joined), the leader's ``GET /v1/gang`` (one Ray actor per GPU on each tray) and one turn
   through the frontend URL.

Real Ray: the leader pod runs ``ray start --head``, the three other rank pods ``ray start
--address=…``, each bound to its tray's address. Everything keeps running afterwards
(``drs dev down`` with the same ``DRS_DEV_STATE_DIR`` stops it).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from demo import kubectl, say, wait_serving
from drs_devcluster import build, processes, runner_daemon
from drs_devcluster.cluster import DevCluster
from drs_protocol import routes

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gb200-wide.yaml"
NAME = "gb200-wide"
TRAYS = 8
READY_TIMEOUT_S = 600.0


def local_variant() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["model"] = {"path": "sim-qwen3", "maxModelLen": 32768}
    spec["engine"] = {"backend": "sim", "simOptions": {"speed": 0}}
    spec["network"] = {"hostNetwork": True}
    spec["images"] = {"engine": "drs:dev", "frontend": "drs:dev", "pullPolicy": "Never"}
    return doc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def ensure_cluster() -> DevCluster:
    """The dev cluster of ``$DRS_DEV_STATE_DIR`` (on ``$DRS_DEV_PORT_BASE`` when set), up with 8 trays."""
    port_base = int(os.environ.get("DRS_DEV_PORT_BASE", "0")) or None
    cluster = DevCluster.at(port_base=port_base)
    status = cluster.status()
    if status["components"] and all(c["running"] for c in status["components"].values()):
        say(f"reusing the running dev cluster ({status.get('nodes')})")
        return DevCluster.at(bin_dir=build.bin_dir())
    cluster.down()
    cluster = DevCluster.at(port_base=port_base)
    cluster.up("gb200", TRAYS)
    return cluster


def ensure_operator(cluster: DevCluster) -> None:
    pids = cluster.layout.state_dir / "operator-pids.json"
    if any(processes.is_running(t) for t in processes.load(pids)):
        return
    drs = str(Path(sys.executable).parent / "drs")
    argv = [sys.executable, drs, "operator", "--metrics-port", str(free_port()), "--health-port", str(free_port())]
    argv += ["--lease-namespace", "default"]
    env = {**os.environ, "KUBECONFIG": str(cluster.layout.kubeconfig)}
    tracked = processes.start("operator", argv, cluster.layout.log("operator"), env=env)
    processes.save(pids, [tracked])
    say(f"operator started (pid {tracked.pid})")


def wait_ready(cluster: DevCluster) -> dict[str, Any]:
    started, last = time.monotonic(), ""
    while time.monotonic() - started < READY_TIMEOUT_S:
        body = json.loads(kubectl(cluster, "get", "drs", NAME, "-o", "json"))
        st = body.get("status") or {}
        line = f"phase={st.get('phase')} ready={st.get('readyReplicas', 0)}/{st.get('replicas', '?')}"
        if line != last:
            say(f"{line} after {time.monotonic() - started:.0f}s")
            last = line
        if st.get("phase") == "Ready" and st.get("observedGeneration") == body["metadata"]["generation"]:
            return st
        time.sleep(1)
    raise SystemExit(f"{NAME} not Ready after {READY_TIMEOUT_S:.0f}s")


def rank_table(status: dict[str, Any]) -> str:
    rows = [("ENGINE", "RANK", "POD", "NODE", "JOINED", "READY")]
    for replica in status["replicaStatuses"]:
        for e in replica["engines"]:
            ranks = e.get("ranks") or [{"rank": 0, "pod": e["name"], "node": e["node"], "joined": e["ready"]}]
            for r in ranks:
                rows.append((e["name"], str(r["rank"]), r["pod"], str(r["node"]), str(r["joined"]), str(e["ready"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def main() -> None:
    cluster = ensure_cluster()
    kubectl(cluster, "apply", "-f", str(ROOT / "crds"))
    kubectl(cluster, "wait", "--for=condition=Established", "crd/disaggreplicasets.disagg.dev", "--timeout=60s")
    ensure_operator(cluster)
    if runner_daemon.running_runner(cluster) is None:
        runner_daemon.start_runner(cluster)
    kubectl(cluster, "apply", "-f", "-", input=json.dumps(local_variant()))
    say(f"applied {EXAMPLE.relative_to(ROOT)} (sim backend, host networking); waiting for Ready")
    status = wait_ready(cluster)
    print(kubectl(cluster, "get", "drs", NAME), flush=True)
    print(rank_table(status), flush=True)
    wide = next(e for e in status["replicaStatuses"][0]["engines"] if e.get("ranks"))
    report = httpx.get(wide["url"] + routes.GANG, timeout=5).json()
    say(f"{wide['url']}{routes.GANG}: phase={report['phase']} session={report['session']} ray={report['ray_address']}")
    for r in report["ranks"]:
        say(
            f"  rank {r['rank']}: node_ip={r['node_ip']} joined={r['joined']} gpus={r['gpus']} actors={r['workers_alive']}"
        )
    wait_serving(status["urls"])
    url = status["urls"][0]
    reply = httpx.post(
        url + routes.Endpoint.CHAT,
        json={"model": "sim-qwen3", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8},
        timeout=60,
    )
    say(f"a turn via {url}: HTTP {reply.status_code}, prefill={reply.headers.get('x-drs-prefill')}")


if __name__ == "__main__":
    main()
