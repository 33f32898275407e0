"""``spec.frontend.standby`` on the real node: a frontend pod killed (grace 0) under load from an
in-cluster client that retries as the OpenAI SDK does by default (2 retries) loses no turn, since
the URL's Service still has the other process of the URL. Every frontend pod of the fleet is killed
once (process 0 of each URL, then, once those are back, each standby), so whichever process the
client's ClientIP affinity had picked, it lost it mid-load."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_devcluster import inpod
from drs_devcluster.testing import RunningCluster

from .pods import wait_phase
from .test_fleet_on_real_node import EXAMPLE, converged, drs, fleet_pods, operator, wait_drs

pytestmark = [pytest.mark.cluster, pytest.mark.realnode]

__all__ = ["operator"]  # the module-scoped chart install, shared with the fleet tests

ROOT = Path(__file__).resolve().parents[2]
LOAD = (ROOT / "examples" / "load_client.py").read_text()
LOAD_SECONDS = 60
PROCESS_LABEL = "disagg.dev/frontend-process"


def standby_fleet() -> dict[str, Any]:
    body: dict[str, Any] = json.loads(json.dumps(EXAMPLE))
    body["spec"]["frontend"]["standby"] = True
    return body


def frontend_pods(cluster: RunningCluster, ns: str, standby: bool) -> list[dict[str, Any]]:
    pods = [p for p in fleet_pods(cluster, ns) if p["metadata"]["labels"].get("disagg.dev/role") == "frontend"]
    return [p for p in pods if (p["metadata"]["labels"].get(PROCESS_LABEL) == "1") == standby]


def every_url_has_both(body: dict[str, Any]) -> bool:
    fronts = [f for r in (body.get("status") or {}).get("replicaStatuses") or [] for f in r["frontends"]]
    return converged(body) and bool(fronts) and all(f["ready"] and f.get("standbyReady") for f in fronts)


def kill(cluster: RunningCluster, ns: str, pods: list[dict[str, Any]]) -> None:
    names = [p["metadata"]["name"] for p in pods]
    cluster.kubectl("delete", "pod", *names, "-n", ns, "--grace-period=0", "--force")


def test_killed_frontend_pods_under_load_lose_no_turn_of_a_client_retrying_twice(
    realcluster: RunningCluster, operator: str, realns: str
) -> None:
    realcluster.kubectl("apply", "-n", realns, "-f", "-", input=yaml.safe_dump(standby_fleet()))
    wait_drs(realcluster, realns, every_url_has_both, "pod-sim Ready with a standby per URL")
    urls = drs(realcluster, realns)["status"]["urls"]
    assert len(urls) == 2 and len(frontend_pods(realcluster, realns, standby=True)) == 2

    args = ["--name", "pod-sim", "--namespace", realns, "--seconds", str(LOAD_SECONDS), "--sessions", "8"]
    objs = inpod.client_objects("load", realns, LOAD, args)
    realcluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))
    deadline = time.monotonic() + 120
    while "[load] started" not in realcluster.kubectl("logs", "load", "-n", realns, check=False).stdout:
        assert time.monotonic() < deadline, realcluster.kubectl("describe", "pod", "load", "-n", realns).stdout
        time.sleep(0.5)
    time.sleep(5)
    killed = frontend_pods(realcluster, realns, standby=False)
    kill(realcluster, realns, killed)
    gone = {p["metadata"]["uid"] for p in killed}

    def back(body: dict[str, Any]) -> bool:
        fresh = frontend_pods(realcluster, realns, standby=False)
        return every_url_has_both(body) and len(fresh) == 2 and not ({p["metadata"]["uid"] for p in fresh} & gone)

    wait_drs(realcluster, realns, back, "process 0 of every URL back", timeout=45)
    standbys = frontend_pods(realcluster, realns, standby=True)
    kill(realcluster, realns, standbys)

    phase = wait_phase(realcluster, realns, "load", {"Succeeded", "Failed"}, timeout=LOAD_SECONDS + 120)
    out = realcluster.kubectl("logs", "load", "-n", realns).stdout
    assert phase["status"]["phase"] == "Succeeded", out
    result = json.loads(out.strip().splitlines()[-1])["load"]
    print(f"standby: frontend pods killed under load: {json.dumps(result)}")
    assert result["lost"] == 0, result
    assert result["turns"] > 100, result
    wait_drs(realcluster, realns, every_url_has_both, "every URL with both processes again", timeout=120)
