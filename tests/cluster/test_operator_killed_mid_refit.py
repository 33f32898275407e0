"""On the real control plane with the pod runner: the operator is SIGKILLed while a refit runs
(the sidecar has stored the desired weights on the resource and the engines are loading), an
engine pod is deleted while it is down, and once it is back the desired weights are reached and
status says so: ``status.weights.desired`` and the weights ConfigMap are the refit's, the
replacement pod (created by the restarted operator) starts at them, and ``WeightsPending`` is
False with every engine's observed digest the refit's. What the restarted operator knows comes
from the annotation alone (``disagg.dev/desired-weights``)."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from drs_devcluster.testing import RunningCluster
from drs_protocol import env
from drs_protocol.weights_digest import digest_files
from drs_protocol.weights_state import parse_desired_weights
from operator_harness import OperatorProcess, apply, condition, drs_status, engine_pods, free_port, wait_for, wait_ready
from test_end_to_end import _get, _post, engine_weights, sim_fleet, start_sidecar, stop_sidecar

pytestmark = pytest.mark.cluster

NAME = "midrefit"
ENGINES = 3  # 1 replica x (2 prefill + 1 decode)


def desired_annotation(devcluster: RunningCluster, namespace: str) -> Any:
    body = json.loads(devcluster.kubectl("get", "drs", "-n", namespace, NAME, "-o", "json").stdout)
    return parse_desired_weights((body["metadata"].get("annotations") or {}).get("disagg.dev/desired-weights"))


def settled(devcluster: RunningCluster, namespace: str, digest: str) -> dict[str, Any] | None:
    """The status once it shows the refit's desired weights, every engine at ``digest`` and
    ``WeightsPending`` False."""
    status = drs_status(devcluster, namespace, NAME)
    desired = (status.get("weights") or {}).get("desired") or {}
    digests = [e.get("weightsDigest") for r in status.get("replicaStatuses", []) for e in r["engines"]]
    pending = condition(status, "WeightsPending").get("status")
    ok = desired.get("version") == "step-1" and digests == [digest] * ENGINES and pending == "False"
    return status if ok else None


def test_an_operator_killed_mid_refit_comes_back_to_the_desired_weights_reached(
    devcluster: RunningCluster, namespace: str, stack: OperatorProcess, tmp_path: Path
) -> None:
    fleet = sim_fleet(NAME)
    fleet["spec"]["replicas"] = 1
    fleet["spec"]["frontend"]["basePort"] = 18800
    fleet["spec"]["trtllm"]["enginePort"] = 18250
    # a load takes speed x weightsLoadSeconds = 6 s: the refit is still loading when the operator dies
    fleet["spec"]["engine"]["simOptions"] = {"speed": 0.1, "weightsLoadSeconds": 60}
    apply(devcluster, namespace, fleet)
    wait_ready(devcluster, namespace, NAME, 1, timeout=180)
    checkpoint = tmp_path / "step-1"
    checkpoint.write_bytes(b"policy weights after step 1, operator down")
    digest = digest_files(checkpoint)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sidecar = start_sidecar(devcluster, namespace, NAME, port)
    try:
        wait_for("the sidecar to serve", lambda: _get(url + "/healthz") is not None, timeout=30)
        with ThreadPoolExecutor(max_workers=1) as pool:
            refitting = pool.submit(
                _post, url + "/v1/refit", {"path": str(checkpoint), "version": "step-1", "digest": digest}
            )
            wait_for(
                "the sidecar to store the desired weights on the resource",
                lambda: (d := desired_annotation(devcluster, namespace)) is not None and d.version == "step-1",
                timeout=30,
                poll_s=0.1,
            )
            stack.kill(signal.SIGKILL)
            assert not refitting.done(), "the operator was killed while the refit ran"
            report = refitting.result(timeout=120)
        assert report["complete"] is True and report["ok"] == ENGINES, report
    finally:
        stop_sidecar(sidecar)

    try:
        # with the operator down, an engine pod dies: nothing recreates it until the operator is back
        victim = f"{NAME}-r0-decode-0"
        old_uid = engine_pods(devcluster, namespace)[victim]["metadata"]["uid"]
        devcluster.kubectl("delete", "pod", "-n", namespace, victim, "--grace-period=0", "--force", "--wait=false")
        wait_for("the pod to be gone", lambda: victim not in engine_pods(devcluster, namespace), timeout=60)
    finally:
        stack.start()

    status = wait_for(
        "the restarted operator to show the desired weights reached",
        lambda: settled(devcluster, namespace, digest),
        timeout=180,
    )
    desired = status["weights"]["desired"]
    assert (desired["version"], desired["path"], desired["digest"]) == ("step-1", str(checkpoint), digest)
    assert desired["effectiveAt"], "the refit's cut-over"
    assert condition(status, "WeightsPending")["reason"] == "AllEnginesHoldDesiredWeights"
    cm = json.loads(devcluster.kubectl("get", "configmap", "-n", namespace, f"{NAME}-weights", "-o", "json").stdout)
    stored = parse_desired_weights(cm["data"][env.DESIRED_WEIGHTS_KEY])
    assert stored == desired_annotation(devcluster, namespace) and stored is not None and stored.digest == digest
    replacement = engine_pods(devcluster, namespace)[victim]
    assert replacement["metadata"]["uid"] != old_uid
    held = engine_weights(devcluster, namespace, NAME, victim)
    assert held is not None and (held["weights_version"], held["weights_digest"]) == ("step-1", digest), held
