"""On the real control plane with the pod runner: after a path-less refit (as a broadcast or CUDA
IPC refit leaves it: desired weights with a digest and no checkpoint path), a deleted engine pod's
replacement catches up from a serving peer of the fleet before it is Ready, and the operator lists
the peers in the weights ConfigMap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from drs_devcluster.testing import RunningCluster
from drs_protocol import env
from drs_protocol.weights_digest import digest_files
from drs_protocol.weights_state import DesiredWeights
from drs_protocol.weights_stream import WeightsPeers
from operator_harness import OperatorProcess, apply, engine_pods, wait_for, wait_ready
from test_end_to_end import engine_control, engine_weights, sim_fleet

pytestmark = pytest.mark.cluster


def test_after_a_pathless_refit_a_replaced_engine_catches_up_from_a_peer(
    devcluster: RunningCluster, namespace: str, stack: OperatorProcess, tmp_path: Path
) -> None:
    fleet = sim_fleet("heal")
    fleet["spec"]["replicas"] = 1
    fleet["spec"]["frontend"]["basePort"] = 18700
    fleet["spec"]["trtllm"]["enginePort"] = 18200
    apply(devcluster, namespace, fleet)
    wait_ready(devcluster, namespace, "heal", 1, timeout=180)
    engines = sorted(engine_pods(devcluster, namespace))
    assert len(engines) == 3
    checkpoint = tmp_path / "step-1"
    checkpoint.write_bytes(b"weights that came by broadcast")
    digest = digest_files(checkpoint)
    for engine in engines:  # every engine gets the new bytes (here by path; a broadcast leaves none)
        answer = engine_control(
            devcluster, namespace, "heal", engine, "/control/weights/load", {"path": str(checkpoint), "version": "s1"}
        )
        assert answer is not None and answer["weights_digest"] == digest, answer
    # the sim double sends what it loaded from its files, so they stay; the desired weights name
    # no path, so the replacement can only get them from a peer (``reached_from`` below)
    desired = DesiredWeights(version="s1", digest=digest)
    devcluster.kubectl(
        "annotate", "drs", "-n", namespace, "heal", f"disagg.dev/desired-weights={desired.dump()}", "--overwrite"
    )

    def peers() -> tuple[str, ...]:
        cm = json.loads(devcluster.kubectl("get", "configmap", "-n", namespace, "heal-weights", "-o", "json").stdout)
        text = (cm.get("data") or {}).get(env.WEIGHTS_PEERS_KEY)
        return WeightsPeers.model_validate_json(text).root if text else ()

    listed = wait_for(
        "the weights ConfigMap to list the fleet's engines as peers", lambda: len(peers()) == 3 and peers()
    )
    assert all(url.startswith("http://") for url in listed)

    victim = "heal-r0-decode-0"
    old_uid = engine_pods(devcluster, namespace)[victim]["metadata"]["uid"]
    devcluster.kubectl("delete", "pod", "-n", namespace, victim, "--wait=false")

    def replaced_and_ready() -> bool:
        pod = engine_pods(devcluster, namespace).get(victim)
        if pod is None or pod["metadata"]["uid"] == old_uid:
            return False
        return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))

    wait_for("the replaced engine pod to be Ready", replaced_and_ready, timeout=120)
    held = engine_weights(devcluster, namespace, "heal", victim)
    assert held is not None and (held["weights_version"], held["weights_digest"]) == ("s1", digest), held
    assert held["catch_up"]["phase"] == "reached" and held["catch_up"]["reached_from"] in listed, held
