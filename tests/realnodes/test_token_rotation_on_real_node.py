"""Token rotation on a real node: a real kubelet updates the mounted Secrets of the fleet's pods
(containers of the image built here), under load from an in-cluster client retrying as the OpenAI
SDK does (2 retries). One rotation by annotation, window 90 s; the client's turns lost must be 0.
Prints, per pod, when its processes logged a token change (the kubelet's propagation, read from
the pods' own logs), against when the operator wrote each phase (its Events)."""

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
from .test_fleet_on_real_node import EXAMPLE, converged, fleet_pods, wait_drs

pytestmark = [pytest.mark.cluster, pytest.mark.realnode]

ROOT = Path(__file__).resolve().parents[2]
LOAD = (ROOT / "examples" / "load_client.py").read_text()
WINDOW_S = 90
LOAD_SECONDS = 2 * WINDOW_S + 60


def secret_phases(cluster: RunningCluster, ns: str) -> dict[str, str | None]:
    out = cluster.kubectl("get", "secrets", "-n", ns, "-o", "json").stdout
    return {
        s["metadata"]["name"]: (s["metadata"].get("annotations") or {}).get("disagg.dev/token-rotation-phase")
        for s in json.loads(out)["items"]
        if s["metadata"]["name"].startswith("pod-sim-")
    }


def test_a_rotation_under_load_on_a_real_node_loses_no_turn(
    realcluster: RunningCluster, operator: str, realns: str
) -> None:
    body: dict[str, Any] = json.loads(json.dumps(EXAMPLE))
    body["metadata"].setdefault("annotations", {})["disagg.dev/token-rotation-window-seconds"] = str(WINDOW_S)
    realcluster.kubectl("apply", "-n", realns, "-f", "-", input=yaml.safe_dump(body))
    wait_drs(realcluster, realns, converged, "pod-sim Ready")

    args = ["--name", "pod-sim", "--namespace", realns, "--seconds", str(LOAD_SECONDS), "--sessions", "8"]
    realcluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(inpod.client_objects("load", realns, LOAD, args)))
    deadline = time.monotonic() + 120
    while "[load] started" not in realcluster.kubectl("logs", "load", "-n", realns, check=False).stdout:
        assert time.monotonic() < deadline, realcluster.kubectl("describe", "pod", "load", "-n", realns).stdout
        time.sleep(0.5)
    started = time.strftime("%H:%M:%S")
    realcluster.kubectl("annotate", "drs", "pod-sim", "-n", realns, "disagg.dev/rotate-tokens=r1", "--overwrite")

    phase = wait_phase(realcluster, realns, "load", {"Succeeded", "Failed"}, timeout=LOAD_SECONDS + 180)
    out = realcluster.kubectl("logs", "load", "-n", realns).stdout
    assert phase["status"]["phase"] == "Succeeded", out
    result = json.loads(out.strip().splitlines()[-1])["load"]
    events = json.loads(realcluster.kubectl("get", "events", "-n", realns, "-o", "json").stdout)["items"]
    phases = sorted(
        (e.get("lastTimestamp") or e.get("eventTime") or "", e["reason"], e["message"][:60])
        for e in events
        if e["reason"].startswith("TokenRotation")
    )
    changes = {
        p["metadata"]["name"]: [
            line.split(" INFO")[0]
            for line in realcluster.kubectl(
                "logs", p["metadata"]["name"], "-n", realns, check=False
            ).stdout.splitlines()
            if "token changed" in line
        ]
        for p in fleet_pods(realcluster, realns)
    }
    print(f"rotation on a real node (annotated {started} UTC): {json.dumps(result)}")
    print(f"operator phases: {phases}")
    print(f"token changes logged per pod: {json.dumps(changes)}")
    print(f"secrets: {secret_phases(realcluster, realns)}")
    assert result["lost"] == 0, result
    assert result["turns"] > 100, result
    assert {"TokenRotationStarted", "TokenRotationSwitched"} <= {r for _, r, _ in phases}
