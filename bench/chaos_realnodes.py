"""Benchmark: turns lost on the real-node cluster while the fleet is broken, from a client in the cluster.

``bench/chaos.py``'s experiment on real nodes (pod networking, kubelets, kube-proxy, CoreDNS): the
chart installed with the image built here (the operator a pod), ``examples/pod-network-sim.yaml``
with ``frontend.standby`` on, and ``examples/load_client.py`` in a pod: 8 Gym-shaped sessions on
``status.urls[sha256(session) % len(urls)]``, retrying as the OpenAI SDK does by default
(``max_retries=2``: two more attempts after ~0.5 s and ~1 s). Scenarios, one after the other,
each a fresh client pod running through the event:

* ``baseline`` — nothing happens;
* ``frontend_killed`` — per URL, the frontend pod the client is talking to (its affinity chose one
  of the URL's two processes; read from the pods' own request counters) deleted with grace 0;
* ``frontend_process_killed`` — per URL, the same pod's frontend *process* killed (SIGKILL from the
  host to the container's first process, found by its container id in ``/proc/*/cgroup``): the pod
  stays and the kubelet restarts the container in place;
* ``prefill_killed`` / ``decode_killed`` — replica 0's engine pod deleted with grace 0;
* ``operator_killed`` — a roll, with the operator pod deleted (grace 0) once the roll has begun;
* ``roll`` — a spec change that replaces every engine pod, replica by replica.

Prints one JSON line: per scenario the load client's ``turns``, ``lost``, ``retried``, errors and
latency. A scenario that lost turns keeps its evidence before the cluster goes (its path is the
scenario's ``evidence``): the cluster's component logs (kubelet, apiserver, kube-router, …), every
pod's log in the fleet's namespace and the operator's (the previous container's too), and the
Events of all namespaces. Needs root and the real-node build (``drs dev up --real-nodes``); wrap it in
``flock /tmp/drs-realnodes.lock`` where other real-node work may run.

    python bench/chaos_realnodes.py [--seconds 40] [--scenarios frontend_killed,roll] [--no-standby]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from drs_devcluster import inpod
from drs_devcluster.testing import BENCH_REAL_PORT_BASE, REAL_STATE_DIR, RunningCluster, real_node_cluster
from drs_protocol import routes

ROOT = Path(__file__).resolve().parents[1]
NAME = "pod-sim"
NS = "chaos"
LOAD = (ROOT / "examples" / "load_client.py").read_text()
SCENARIOS = (
    "baseline",
    "prefill_killed",
    "decode_killed",
    "roll",
    "operator_killed",
    "frontend_killed",
    "frontend_process_killed",
)
STANDBY = [True]
READY_S = 300.0


def say(msg: str) -> None:
    print(f"[chaos-real] {msg}", file=sys.stderr, flush=True)


def fleet() -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "pod-network-sim.yaml").read_text())
    body["spec"]["frontend"]["standby"] = STANDBY[0]
    return body


def get_json(cluster: RunningCluster, *args: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
    return body


def pods(cluster: RunningCluster, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get_json(cluster, "pods", "-n", NS, "-l", selector)["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def converged(cluster: RunningCluster) -> bool:
    body = get_json(cluster, "drs", NAME, "-n", NS)
    st = body.get("status") or {}
    fronts = [f for r in st.get("replicaStatuses") or [] for f in r["frontends"]]
    return bool(
        st.get("phase") == "Ready"
        and st.get("observedGeneration") == body["metadata"]["generation"]
        and fronts
        and all(f["ready"] and (f.get("standbyReady") or not STANDBY[0]) for f in fronts)
    )


def wait(what: str, check: Callable[[], bool], timeout: float = READY_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not reached after {timeout:.0f}s")
        time.sleep(1.0)


def kill(cluster: RunningCluster, namespace: str, victims: list[dict[str, Any]]) -> None:
    names = [p["metadata"]["name"] for p in victims]
    say(f"deleting {names} with grace 0")
    cluster.kubectl("delete", "pod", *names, "-n", namespace, "--grace-period=0", "--force")


METRICS = (
    "import sys, urllib.request; "
    "text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode(); "
    "print(sum(float(l.rsplit(' ', 1)[1]) for l in text.splitlines() if l.startswith('drs_frontend_requests_total{')))"
)


def served(cluster: RunningCluster, pod: dict[str, Any]) -> float:
    """A frontend pod's own count of answered requests (its /metrics, read from inside the pod)."""
    port = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
    url = f"http://{pod['status']['podIP']}:{port}{routes.METRICS}"
    return float(cluster.kubectl("exec", pod["metadata"]["name"], "-n", NS, "--", "python", "-c", METRICS, url).stdout)


def busy_frontends(cluster: RunningCluster) -> list[dict[str, Any]]:
    """Per URL, the pod the client's ClientIP affinity chose (the one that served its requests)."""
    by_url: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for pod in pods(cluster, f"disagg.dev/replicaset={NAME},disagg.dev/role=frontend"):
        by_url.setdefault(pod["metadata"]["labels"]["disagg.dev/replica"], []).append((served(cluster, pod), pod))
    return [max(candidates, key=lambda sp: sp[0])[1] for candidates in by_url.values()]


def kill_frontends(cluster: RunningCluster) -> None:
    kill(cluster, NS, busy_frontends(cluster))


def container_init(container_id: str) -> int:
    """The host pid of a container's first process: the process in the container's cgroup whose
    pid in its own namespace is 1 (``NSpid`` of ``/proc/<pid>/status``)."""
    cid = container_id.split("://", 1)[-1]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if cid not in (proc / "cgroup").read_text():
                continue
            nspid = next(line for line in (proc / "status").read_text().splitlines() if line.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        if nspid.split()[-1] == "1":
            return int(proc.name)
    raise SystemExit(f"no process of container {cid} found in /proc")


def kill_frontend_processes(cluster: RunningCluster) -> None:
    """Per URL, the busy pod's frontend process killed (SIGKILL); the pod stays, its container restarts."""
    for pod in busy_frontends(cluster):
        [status] = pod["status"]["containerStatuses"]
        pid = container_init(status["containerID"])
        say(f"SIGKILL to {pod['metadata']['name']}'s frontend (host pid {pid}, restarts {status['restartCount']})")
        os.kill(pid, signal.SIGKILL)


def kill_engine(role: str) -> Callable[[RunningCluster], None]:
    def event(cluster: RunningCluster) -> None:
        kill(cluster, NS, pods(cluster, f"disagg.dev/replicaset={NAME},disagg.dev/role={role},disagg.dev/replica=0"))

    return event


SPEED = [0.1]


def roll(cluster: RunningCluster) -> None:
    SPEED[0] = 0.12 if SPEED[0] == 0.1 else 0.1
    patch = {"spec": {"engine": {"simOptions": {"speed": SPEED[0]}}}}
    cluster.kubectl("patch", "drs", NAME, "-n", NS, "--type=merge", "-p", json.dumps(patch))
    say(f"rolling to sim speed {SPEED[0]}")


def roll_and_kill_operator(cluster: RunningCluster) -> None:
    roll(cluster)
    wait("the roll to begin", lambda: not converged(cluster), timeout=60)
    kill(cluster, "drs-system", get_json(cluster, "pods", "-n", "drs-system")["items"])


EVENTS: dict[str, Callable[[RunningCluster], None]] = {
    "baseline": lambda cluster: None,
    "frontend_killed": kill_frontends,
    "frontend_process_killed": kill_frontend_processes,
    "prefill_killed": kill_engine("prefill"),
    "decode_killed": kill_engine("decode"),
    "operator_killed": roll_and_kill_operator,
    "roll": roll,
}


def keep_evidence(cluster: RunningCluster, scenario: str) -> Path:
    """Copy what explains a lost turn out of the cluster before it is deleted: the component logs,
    the pods' logs (previous containers too) in the fleet's and the operator's namespaces, the Events."""
    out = Path(tempfile.mkdtemp(prefix=f"drs-chaos-real-{scenario}-"))
    shutil.copytree(cluster.cluster.layout.log_dir, out / "components", dirs_exist_ok=True)
    for ns in (NS, "drs-system"):
        for pod in get_json(cluster, "pods", "-n", ns)["items"]:
            name = pod["metadata"]["name"]
            for previous in ("", "--previous"):
                got = cluster.kubectl(
                    "logs", name, "-n", ns, "--all-containers", *filter(None, [previous]), check=False
                )
                if got.stdout:
                    (out / f"{ns}_{name}{previous.replace('--', '.')}.log").write_text(got.stdout)
    events = cluster.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", "-o", "wide", check=False).stdout
    (out / "events.txt").write_text(events)
    return out


def run_scenario(cluster: RunningCluster, scenario: str, seconds: float) -> dict[str, Any]:
    wait("the fleet Ready with a standby per URL", lambda: converged(cluster))
    pod = f"load-{scenario.replace('_', '-')}"
    args = ["--name", NAME, "--namespace", NS, "--seconds", str(seconds), "--sessions", "8", "--max-retries", "2"]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(inpod.client_objects(pod, NS, LOAD, args)))
    wait(
        "the load client's first turn",
        lambda: "[load] started" in cluster.kubectl("logs", pod, "-n", NS, check=False).stdout,
    )
    time.sleep(5)
    began = time.monotonic()
    EVENTS[scenario](cluster)
    wait(
        "the load client to finish",
        lambda: get_json(cluster, "pod", pod, "-n", NS)["status"].get("phase") in ("Succeeded", "Failed"),
        timeout=seconds + 180,
    )
    out = cluster.kubectl("logs", pod, "-n", NS).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])["load"]
    result["event_s"] = round(time.monotonic() - began, 1)
    if result["lost"]:
        result["evidence"] = str(keep_evidence(cluster, scenario))
    say(f"{scenario}: {json.dumps(result)}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="load per scenario (the roll scenarios double it)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--no-standby", action="store_true", help="spec.frontend.standby off (one process per URL)")
    args = parser.parse_args()
    STANDBY[0] = not args.no_standby
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in scenarios if s not in EVENTS]
    if unknown:
        raise SystemExit(f"--scenarios: unknown {unknown}; known: {list(EVENTS)}")
    results: dict[str, Any] = {}
    load_start = list(os.getloadavg())
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    # beside the test session's real-node cluster: its own state dir, ports and pod network
    state_dir = REAL_STATE_DIR.with_name(REAL_STATE_DIR.name + "-chaos")
    for cluster in real_node_cluster(state_dir, BENCH_REAL_PORT_BASE, nodes=1, net_offset=1):
        inpod.helm_install(cluster.cluster, release="drs", namespace="drs-system")
        cluster.kubectl("create", "namespace", NS)
        cluster.kubectl("wait", "--for=create", "serviceaccount/default", "-n", NS, "--timeout=60s")
        cluster.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(fleet()))
        for scenario in scenarios:
            rolls = scenario in ("roll", "operator_killed")
            results[scenario] = run_scenario(cluster, scenario, args.seconds * (2 if rolls else 1))
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    line = {
        "bench": "chaos_realnodes",
        "started_utc": started,
        "commit": commit.stdout.strip(),
        "load_avg": {"start": load_start, "end": list(os.getloadavg())},
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "fleet": f"examples/pod-network-sim.yaml, frontend.standby {STANDBY[0]}: 2 replicas x (1 prefill + "
        f"1 decode), 1 frontend URL each ({2 if STANDBY[0] else 1} process(es)), sim speed 0.1, pod networking, "
        "1 real node",
        "standby": STANDBY[0],
        "client": "examples/load_client.py in a pod: 8 sessions, max_retries=2 (the OpenAI SDK default)",
        "scenarios": results,
        "lost_total": sum(r["lost"] for r in results.values()),
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
