"""``spec.frontend.standby`` on the real nodes: the frontend pod a client is talking to, killed
(grace 0) under load from an in-cluster client that retries as the OpenAI SDK does by default (2
retries), loses no turn, since the URL's Service still has the other process of the URL. Which of
a URL's two pods the client's ClientIP affinity chose is read from the pods' own request counters;
that pod is the one killed, for every URL."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_devcluster import inpod
from drs_devcluster.testing import RunningCluster

from .pods import logs, wait_phase
from .test_fleet_on_real_node import EXAMPLE, converged, drs, fleet_pods, wait_drs

pytestmark = [pytest.mark.cluster, pytest.mark.realnode]

ROOT = Path(__file__).resolve().parents[2]
LOAD = (ROOT / "examples" / "load_client.py").read_text()
LOAD_SECONDS = 45
PROCESS_LABEL = "disagg.dev/frontend-process"
METRICS = (
    "import sys, urllib.request; "
    "text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode(); "
    "print(sum(float(l.rsplit(' ', 1)[1]) for l in text.splitlines() if l.startswith('drs_frontend_requests_total{')))"
)


def standby_fleet() -> dict[str, Any]:
    body: dict[str, Any] = json.loads(json.dumps(EXAMPLE))
    body["spec"]["frontend"]["standby"] = True
    return body


def frontend_pods(cluster: RunningCluster, ns: str) -> list[dict[str, Any]]:
    return [p for p in fleet_pods(cluster, ns) if p["metadata"]["labels"].get("disagg.dev/role") == "frontend"]


def every_url_has_both(body: dict[str, Any]) -> bool:
    fronts = [f for r in (body.get("status") or {}).get("replicaStatuses") or [] for f in r["frontends"]]
    return converged(body) and bool(fronts) and all(f["ready"] and f.get("standbyReady") for f in fronts)


def turns_served(cluster: RunningCluster, ns: str, pod: dict[str, Any]) -> float:
    """The pod's own count of answered client requests (its /metrics, read from inside the pod)."""
    port = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
    url = f"http://{pod['status']['podIP']}:{port}/metrics"
    out = cluster.kubectl("exec", pod["metadata"]["name"], "-n", ns, "--", "python", "-c", METRICS, url)
    return float(out.stdout.strip())


def test_the_killed_frontend_pod_of_a_client_retrying_twice_loses_no_turn(
    realcluster: RunningCluster, operator: str, realns: str
) -> None:
    realcluster.kubectl("apply", "-n", realns, "-f", "-", input=yaml.safe_dump(standby_fleet()))
    wait_drs(realcluster, realns, every_url_has_both, "pod-sim Ready with a standby per URL")
    assert len(drs(realcluster, realns)["status"]["urls"]) == 2 and len(frontend_pods(realcluster, realns)) == 4

    args = ["--name", "pod-sim", "--namespace", realns, "--seconds", str(LOAD_SECONDS), "--sessions", "8"]
    objs = inpod.client_objects("load", realns, LOAD, args)
    realcluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))
    deadline = time.monotonic() + 120
    while "[load] started" not in realcluster.kubectl("logs", "load", "-n", realns, check=False).stdout:
        assert time.monotonic() < deadline, realcluster.kubectl("describe", "pod", "load", "-n", realns).stdout
        time.sleep(0.5)
    time.sleep(8)
    by_url: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for pod in frontend_pods(realcluster, realns):
        labels = pod["metadata"]["labels"]
        by_url.setdefault(labels["disagg.dev/replica"], []).append((turns_served(realcluster, realns, pod), pod))
    chosen = [max(pods, key=lambda sp: sp[0]) for pods in by_url.values()]
    counts = {p["metadata"]["name"]: n for pods in by_url.values() for n, p in pods}
    assert all(n > 0 for n, _ in chosen), counts  # the client's affinity picked one pod of each URL
    victims = [p["metadata"]["name"] for _, p in chosen]
    realcluster.kubectl("delete", "pod", *victims, "-n", realns, "--grace-period=0", "--force")

    phase = wait_phase(realcluster, realns, "load", {"Succeeded", "Failed"}, timeout=LOAD_SECONDS + 120)
    out = logs(realcluster, realns, "load")
    assert phase["status"]["phase"] == "Succeeded", out
    result = json.loads(out.strip().splitlines()[-1])["load"]
    print(f"standby: requests per frontend pod before the kill {counts}; killed {victims}; {json.dumps(result)}")
    assert result["lost"] == 0, result
    assert result["turns"] > 100, result
    alive = {p["metadata"]["name"] for p in frontend_pods(realcluster, realns)}
    assert not alive & set(victims)
