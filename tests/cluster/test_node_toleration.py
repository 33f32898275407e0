"""A node that is not Ready keeps its replica for ``topology.notReadyTolerationSeconds``.

On the real control plane: kwok's node-not-ready stage turns a node's Ready condition False (with
the transition time a kubelet's node would report, ``drs_devcluster.kwok_stages``), the node
lifecycle controller taints it and marks its pods not ready, and the operator reads it through its
node watch. A blip shorter than the toleration moves nothing (and the pods serve again once the
node is back); a node held NotReady past it moves its replica, and not before.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import pytest
from drs_devcluster.testing import RunningCluster
from operator_harness import (
    OperatorProcess,
    apply,
    drs_status,
    engine_pods,
    get_json,
    running_operator,
    wait_for,
    wait_ready,
)

pytestmark = pytest.mark.cluster

NOT_READY_LABEL = "node-not-ready.stage.kwok.x-k8s.io"
#: Long enough that the blip (flip, seen, flip back, seen) ends well inside it on a loaded machine.
BLIP_TOLERATION_S = 120
#: Short, so the held case moves within the test's patience.
HELD_TOLERATION_S = 12


@pytest.fixture(scope="module")
def operator(devcluster: RunningCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    devcluster.install_crd()
    with running_operator(devcluster, tmp_path_factory.mktemp("operator") / "operator.log") as op:
        yield op


def fleet(name: str, toleration_s: int, base_port: int) -> dict[str, Any]:
    """Two width-8 replicas (one per 8-GPU node)."""
    wide = {"engines": 1, "tensorParallelSize": 4}
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggReplicaSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": 2,
            "model": {"path": "/models/m"},
            "prefill": wide,
            "decode": wide,
            "frontend": {"workers": 1, "basePort": base_port},
            "topology": {"gpusPerNode": 8, "notReadyTolerationSeconds": toleration_s},
        },
    }


def node_ready(devcluster: RunningCluster, node: str) -> dict[str, Any]:
    cond: dict[str, Any] = next(
        c for c in get_json(devcluster, "node", node)["status"]["conditions"] if c["type"] == "Ready"
    )
    return cond


def waiting_reason(devcluster: RunningCluster, namespace: str, name: str) -> str | None:
    reason = drs_status(devcluster, namespace, name)["replicaStatuses"][0].get("reason")
    return reason if reason and "not Ready" in reason else None


def events(devcluster: RunningCluster, namespace: str, reason: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get_json(
        devcluster, "events", "-n", namespace, "--field-selector", f"reason={reason}"
    )["items"]
    return items


def test_a_not_ready_blip_shorter_than_the_toleration_moves_nothing(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess
) -> None:
    apply(devcluster, namespace, fleet("blip", BLIP_TOLERATION_S, 9500))
    before = wait_ready(devcluster, namespace, "blip", 2)
    node = before["replicaStatuses"][0]["nodes"][0]
    uids = {name: p["metadata"]["uid"] for name, p in engine_pods(devcluster, namespace).items()}
    flipped = datetime.datetime.now(datetime.UTC)
    devcluster.kubectl("label", "node", node, f"{NOT_READY_LABEL}=true")
    try:
        # the operator saw it NotReady and decided to wait, saying until when
        reason = wait_for(
            "the operator to hold replica 0 on its NotReady node",
            lambda: waiting_reason(devcluster, namespace, "blip"),
            60,
        )
        since = datetime.datetime.fromisoformat(node_ready(devcluster, node)["lastTransitionTime"])
        assert abs((since - flipped).total_seconds()) < 10, "the Ready transition time is the flip, not creation"
        until = (since + datetime.timedelta(seconds=BLIP_TOLERATION_S)).strftime("%Y-%m-%dT%H:%M:%SZ")
        assert f"until {until}" in reason
    finally:
        devcluster.kubectl("label", "node", node, f"{NOT_READY_LABEL}-")
    wait_for("the node to be Ready again", lambda: node_ready(devcluster, node)["status"] == "True", 60)
    wait_for("the operator to see it Ready", lambda: waiting_reason(devcluster, namespace, "blip") is None, 60)
    # the node controller marked its pods not ready; back on a Ready node they serve again (a
    # kubelet re-posts readiness; kwok's pod-ready-again stage does here), with no pod replaced
    after = wait_ready(devcluster, namespace, "blip", 2)
    assert datetime.datetime.now(datetime.UTC) < since + datetime.timedelta(seconds=BLIP_TOLERATION_S)
    assert [r["nodes"] for r in after["replicaStatuses"]] == [r["nodes"] for r in before["replicaStatuses"]]
    now = {name: p["metadata"]["uid"] for name, p in engine_pods(devcluster, namespace).items()}
    assert now == uids, "an engine pod was deleted or recreated during the blip"
    assert not events(devcluster, namespace, "ReplicaMoved")


def test_a_node_held_not_ready_past_the_toleration_moves_its_replica_then_and_not_before(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess
) -> None:
    apply(devcluster, namespace, fleet("held", HELD_TOLERATION_S, 9600))
    before = wait_ready(devcluster, namespace, "held", 2)
    node = before["replicaStatuses"][0]["nodes"][0]
    devcluster.kubectl("label", "node", node, f"{NOT_READY_LABEL}=true")
    try:
        wait_for("the operator to hold replica 0", lambda: waiting_reason(devcluster, namespace, "held"), 60)
        since = datetime.datetime.fromisoformat(node_ready(devcluster, node)["lastTransitionTime"])

        def moved() -> list[str] | None:
            nodes: list[str] = drs_status(devcluster, namespace, "held")["replicaStatuses"][0]["nodes"]
            return nodes if nodes and node not in nodes else None

        new_nodes = wait_for("replica 0 to move", moved, HELD_TOLERATION_S + 60)
        seen = datetime.datetime.now(datetime.UTC)
        (event,) = events(devcluster, namespace, "ReplicaMoved")
        at = datetime.datetime.fromisoformat(event.get("eventTime") or event["firstTimestamp"])
        held_s = (at - since).total_seconds()
        assert held_s >= HELD_TOLERATION_S - 1, f"moved {held_s:.1f}s after NotReady, before the toleration"
        assert (seen - since).total_seconds() < HELD_TOLERATION_S + 45, "the move waited far past the toleration"
        wait_ready(devcluster, namespace, "held", 2)
        live = engine_pods(devcluster, namespace)
        assert all(p["spec"].get("nodeName") != node for n, p in live.items() if "-r0-" in n)
        assert new_nodes != [node]
    finally:
        devcluster.kubectl("label", "node", node, f"{NOT_READY_LABEL}-")
        wait_for("the node to be Ready again", lambda: node_ready(devcluster, node)["status"] == "True", 60)
