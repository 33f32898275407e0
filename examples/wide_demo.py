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

import base64
import json
from typing import Any

import httpx
import yaml
from demo_steps import (
    ROOT,
    ensure_operator,
    ensure_sim_cluster,
    free_port,
    install_crd,
    kubectl,
    say,
    wait_ready,
    wait_serving,
)
from drs_devcluster import runner_daemon
from drs_protocol import auth, env, fields, routes

EXAMPLE = ROOT / "examples" / "gb200-wide.yaml"
NAME = "gb200-wide"
TRAYS = 8
READY_TIMEOUT_S = 600.0


def local_variant() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["model"] = {"path": "sim-qwen3", "maxModelLen": 32768}
    spec["engine"] = {"backend": "sim", "sim": {"speed": 0}}
    spec["network"] = {"hostNetwork": True}
    spec["images"] = {"engine": "drs:dev", "frontend": "drs:dev", "pullPolicy": "Never"}
    return doc


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
    cluster = ensure_sim_cluster("gb200", TRAYS)
    install_crd(cluster)
    ensure_operator(cluster, metrics_port=free_port(), health_port=free_port())
    if runner_daemon.running_runner(cluster) is None:
        runner_daemon.start_runner(cluster)
    kubectl(cluster, "apply", "-f", "-", input=json.dumps(local_variant()))
    say(f"applied {EXAMPLE.relative_to(ROOT)} (sim backend, host networking); waiting for Ready")
    status = wait_ready(cluster, NAME, READY_TIMEOUT_S)
    print(kubectl(cluster, "get", "drs", NAME), flush=True)
    print(rank_table(status), flush=True)
    wide = next(e for e in status["replicaStatuses"][0]["engines"] if e.get("ranks"))
    secret = json.loads(kubectl(cluster, "get", "secret", f"{NAME}-serving", "-o", "json"))
    token = base64.b64decode(secret["data"][env.TOKEN_SECRET_KEY]).decode()  # the engines' serving realm
    report = httpx.get(wide["url"] + routes.GANG, headers=auth.bearer(token), timeout=5).json()
    say(f"{wide['url']}{routes.GANG}: phase={report['phase']} session={report['session']} ray={report['ray_address']}")
    for r in report["ranks"]:
        say(
            f"  rank {r['rank']}: node_ip={r['node_ip']} joined={r['joined']} gpus={r['gpus']} actors={r['workers_alive']}"
        )
    wait_serving(status["urls"], READY_TIMEOUT_S)
    url = status["urls"][0]
    reply = httpx.post(
        url + routes.Endpoint.CHAT,
        json={"model": "sim-qwen3", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8},
        timeout=60,
    )
    say(f"a turn via {url}: HTTP {reply.status_code}, prefill={reply.headers.get(fields.HEADER_PREFILL_ENGINE)}")


if __name__ == "__main__":
    main()
