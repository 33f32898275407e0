"""The operator against the real control plane: apiserver, scheduler, controller-manager, kwok GPU nodes."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from drs_devcluster import profiles
from drs_devcluster.testing import RunningCluster
from kubernetes import client as k8s
from operator_harness import (
    OperatorProcess,
    apply,
    condition,
    drs_status,
    engine_pods,
    get_json,
    load_example,
    models_volume,
    pods,
    wait_for,
    wait_ready,
)

pytestmark = pytest.mark.cluster


def node_of(pod: dict[str, Any]) -> str:
    node: str = pod["spec"]["nodeName"]
    return node


def nodes_by_name(devcluster: RunningCluster) -> dict[str, dict[str, Any]]:
    return {n["metadata"]["name"]: n for n in get_json(devcluster, "nodes")["items"]}


# --------------------------------------------------------------------------- placement on hgx / gb200
def test_reference_example_on_hgx_binds_each_replica_to_one_8_gpu_node_and_publishes_urls(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess
) -> None:
    models_volume(devcluster, namespace)
    drs = load_example("reference.yaml")
    apply(devcluster, namespace, drs)
    status = wait_ready(devcluster, namespace, "reference", 2)

    live = engine_pods(devcluster, namespace)
    assert len(live) == 2 * 3
    nodes = nodes_by_name(devcluster)
    for rs in status["replicaStatuses"]:
        assert len(rs["nodes"]) == 1, rs
        assert nodes[rs["nodes"][0]]["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        for engine in rs["engines"]:
            pod = live[engine["name"]]
            # bound by the real scheduler (not by us) to the node the status names
            assert node_of(pod) == engine["node"] == rs["nodes"][0]
            scheduled = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
            assert scheduled["status"] == "True"
            assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(engine["width"])
            assert engine["ready"] is True
    f = drs["spec"]["frontend"]["workers"]
    base = drs["spec"]["frontend"]["basePort"]
    expected = [f"http://reference-r{r}-f{i}.{namespace}.svc:{base + r * f + i}" for r in range(2) for i in range(f)]
    assert status["urls"] == expected
    table = devcluster.kubectl("get", "drs", "-n", namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "REPLICAS", "READY", "GPUS", "PHASE", "WEIGHTS", "AGE"]
    assert table[1].split()[:5] == ["reference", "2", "2", "16", "Ready"]


def test_gb200_example_keeps_each_replica_inside_one_clique(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess
) -> None:
    models_volume(devcluster, namespace)
    apply(devcluster, namespace, load_example("gb200.yaml"))
    status = wait_ready(devcluster, namespace, "reference-gb200", 2)
    nodes = nodes_by_name(devcluster)
    live = engine_pods(devcluster, namespace)
    for rs in status["replicaStatuses"]:
        members = [p for p in live.values() if p["metadata"]["labels"]["disagg.dev/replica"] == str(rs["index"])]
        cliques = {nodes[node_of(p)]["metadata"]["labels"][profiles.CLIQUE_LABEL] for p in members}
        assert cliques == {rs["segment"]}, (rs["index"], cliques)
        assert all(nodes[node_of(p)]["status"]["allocatable"]["nvidia.com/gpu"] == "4" for p in members)


# --------------------------------------------------------------------------- lifecycle
def small(name: str, replicas: int = 2, **spec: Any) -> dict[str, Any]:
    """A small fleet on hgx nodes: 1 prefill TP2 + 1 decode TP2 + 1 frontend per replica."""
    body: dict[str, Any] = {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggReplicaSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "model": {"path": "/models/m"},
            "prefill": {"engines": 1, "tensorParallelSize": 2},
            "decode": {"engines": 1, "tensorParallelSize": 2},
            "frontend": {"workers": 1, "basePort": 9100},
            "topology": {"gpusPerNode": 8},
        },
    }
    body["spec"].update(spec)
    return body


def test_a_deleted_engine_pod_comes_back_with_its_name_on_its_node_and_urls_do_not_change(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess
) -> None:
    apply(devcluster, namespace, small("heal"))
    before = wait_ready(devcluster, namespace, "heal", 2)
    victim = before["replicaStatuses"][1]["engines"][0]
    old_uid = engine_pods(devcluster, namespace)[victim["name"]]["metadata"]["uid"]
    devcluster.kubectl("delete", "pod", victim["name"], "-n", namespace, "--wait=false")

    def recreated() -> dict[str, Any] | None:
        pod = engine_pods(devcluster, namespace).get(victim["name"])
        return pod if pod and pod["metadata"]["uid"] != old_uid else None

    def bound() -> dict[str, Any] | None:
        pod = recreated()
        return pod if pod and pod["spec"].get("nodeName") else None

    pod = wait_for("the engine pod to be recreated", recreated)
    assert node_of(wait_for("it to be bound", bound)) == victim["node"]
    after = wait_ready(devcluster, namespace, "heal", 2)
    assert after["urls"] == before["urls"]
    assert pod["metadata"]["name"] == victim["name"]


def test_a_failed_engine_pod_is_replaced_with_its_name_on_its_node(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess
) -> None:
    apply(devcluster, namespace, small("fail", replicas=1))
    before = wait_ready(devcluster, namespace, "fail", 1)
    victim = before["replicaStatuses"][0]["engines"][1]
    old_uid = engine_pods(devcluster, namespace)[victim["name"]]["metadata"]["uid"]
    # kwok's chaos stage turns the pod Failed, as an eviction or a crashed container would
    devcluster.kubectl(
        "label", "pod", victim["name"], "-n", namespace, "pod-container-running-failed.stage.kwok.x-k8s.io=true"
    )

    def replaced() -> dict[str, Any] | None:
        pod = engine_pods(devcluster, namespace).get(victim["name"])
        ok = pod and pod["metadata"]["uid"] != old_uid and pod["spec"].get("nodeName")
        return pod if ok else None

    pod = wait_for("the failed pod to be replaced", replaced)
    assert node_of(pod) == victim["node"]
    wait_ready(devcluster, namespace, "fail", 1)
    events = devcluster.kubectl("get", "events", "-n", namespace, "--field-selector", "reason=EngineFailed").stdout
    assert victim["name"] in events


@pytest.mark.parametrize("how", ["node marked NotReady", "node deleted"])
def test_losing_a_node_moves_only_the_replica_on_it(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess, how: str
) -> None:
    # width-8 replicas: one per 8-GPU node, so losing one node touches exactly one replica
    wide = {"engines": 1, "tensorParallelSize": 4}
    # moves at once (the toleration of a node that is not Ready: tests/cluster/test_node_toleration.py)
    topology = {"gpusPerNode": 8, "notReadyTolerationSeconds": 0}
    apply(devcluster, namespace, small("move", replicas=2, prefill=wide, decode=wide, topology=topology))
    before = wait_ready(devcluster, namespace, "move", 2)
    lost = before["replicaStatuses"][0]["nodes"][0]
    kept = before["replicaStatuses"][1]
    all_nodes = profiles.build_nodes("hgx", 8)
    try:
        if how == "node deleted":
            devcluster.kubectl("delete", "node", lost, "--wait=false")
        else:
            devcluster.kubectl("label", "node", lost, "node-not-ready.stage.kwok.x-k8s.io=true")

        def moved() -> dict[str, Any] | None:
            st = drs_status(devcluster, namespace, "move")
            reps = st.get("replicaStatuses", [])
            return (
                st
                if reps and reps[0]["nodes"] and lost not in reps[0]["nodes"] and st.get("readyReplicas") == 2
                else None
            )

        after = wait_for("replica 0 to move and become ready", moved, timeout=120)
        assert kept["nodes"] != [lost]
        assert after["replicaStatuses"][1]["nodes"] == kept["nodes"]
        assert [e["node"] for e in after["replicaStatuses"][1]["engines"]] == [e["node"] for e in kept["engines"]]
        assert after["urls"] == before["urls"]  # pod networking: Service names do not move
        live = engine_pods(devcluster, namespace)
        assert all(node_of(p) != lost for p in live.values() if p["spec"].get("nodeName"))
        events = devcluster.kubectl("get", "events", "-n", namespace, "--field-selector", "reason=ReplicaMoved").stdout
        assert "replica 0 moved" in events
    finally:
        if how == "node deleted":
            devcluster.cluster.create_nodes([n for n in all_nodes if n["metadata"]["name"] == lost])
        else:
            devcluster.kubectl("label", "node", lost, "node-not-ready.stage.kwok.x-k8s.io-")
            wait_for(
                "the node to be Ready again",
                lambda: any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in get_json(devcluster, "node", lost)["status"]["conditions"]
                ),
            )


def test_scale_2_to_3_to_1_adds_and_removes_whole_replicas(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess
) -> None:
    apply(devcluster, namespace, small("scale", frontend={"workers": 2, "basePort": 9200}))
    wait_ready(devcluster, namespace, "scale", 2)
    devcluster.kubectl("scale", "drs", "scale", "-n", namespace, "--replicas=3")
    st = wait_ready(devcluster, namespace, "scale", 3)
    assert st["urls"] == [
        f"http://scale-r{r}-f{f}.{namespace}.svc:{9200 + r * 2 + f}" for r in range(3) for f in range(2)
    ]
    devcluster.kubectl("scale", "drs", "scale", "-n", namespace, "--replicas=1")
    st = wait_ready(devcluster, namespace, "scale", 1)
    assert st["urls"] == [f"http://scale-r0-f{f}.{namespace}.svc:{9200 + f}" for f in range(2)]
    wait_for(
        "children of replicas 1 and 2 to be gone",
        lambda: (
            {
                p["metadata"]["labels"]["disagg.dev/replica"]
                for p in pods(devcluster, namespace)
                if not p["metadata"].get("deletionTimestamp")
            }
            == {"0"}
        ),
    )
    deployments = get_json(devcluster, "deployments", "-n", namespace)["items"]
    # each URL runs a standby (pod networking, frontend.standby unset)
    assert sorted(d["metadata"]["name"] for d in deployments) == [
        f"scale-r0-f{f}{s}" for f in range(2) for s in ("", "-standby")
    ]


def test_a_rolling_change_never_has_more_than_one_replica_unavailable(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess
) -> None:
    apply(devcluster, namespace, small("roll", replicas=3))
    wait_ready(devcluster, namespace, "roll", 3)
    before = {n: p["metadata"]["uid"] for n, p in engine_pods(devcluster, namespace).items()}

    samples: list[int] = []
    stop = threading.Event()
    # The pods listed straight from the API (tens of ms), not by kubectl (about half a second on a
    # loaded 2-core machine, where CI's sampler once took 5 samples in a whole roll): each step of
    # the roll is seen by several samples (the guard below: at least one saw a replica down).
    api = devcluster.api_client()
    core = k8s.CoreV1Api(api)

    def sample() -> None:
        while not stop.is_set():
            listed = core.list_namespaced_pod(namespace, label_selector="disagg.dev/role in (prefill,decode)")
            items: list[dict[str, Any]] = api.sanitize_for_serialization(listed)["items"]
            live = {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}
            down = set()
            for r in range(3):
                for role in ("prefill", "decode"):
                    pod = live.get(f"roll-r{r}-{role}-0")
                    ready = pod is not None and any(
                        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or []
                    )
                    if not ready:
                        down.add(r)
            samples.append(len(down))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        patch = {"spec": {"decode": {"gpuMemoryUtilization": 0.5}}}
        devcluster.kubectl("patch", "drs", "roll", "-n", namespace, "--type=merge", "-p", json.dumps(patch))

        def progressing_seen() -> bool:
            return condition(drs_status(devcluster, namespace, "roll"), "Progressing").get("status") == "True"

        wait_for("Progressing=True during the roll", progressing_seen, timeout=30)
        wait_ready(devcluster, namespace, "roll", 3)
    finally:
        stop.set()
        sampler.join(timeout=10)
    after = {n: p["metadata"]["uid"] for n, p in engine_pods(devcluster, namespace).items()}
    assert all(before[n] != after[n] for n in before if "decode" in n), "every decode pod was replaced"
    assert all(before[n] == after[n] for n in before if "prefill" in n), "prefill pods were left alone"
    assert any(samples), f"the sampler never saw the roll in progress (a replica down): {samples}"
    assert max(samples) <= 1, f"more than one replica unavailable during the roll: {samples}"


def test_operator_killed_mid_reconcile_converges_without_duplicates_and_a_resync_writes_nothing(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    operator.kill()
    try:
        second = OperatorProcess(devcluster, tmp_path / "first.log").start()
        apply(devcluster, namespace, small("crash", replicas=4, frontend={"workers": 2, "basePort": 9300}))
        wait_for("the first children", lambda: len(pods(devcluster, namespace)) > 0, timeout=30)
        second.kill(signal.SIGKILL)  # mid-reconcile: children half created
        engines_at_kill = {
            p["metadata"]["name"]
            for p in pods(devcluster, namespace)
            if "-prefill-" in p["metadata"]["name"] or "-decode-" in p["metadata"]["name"]
        }
        third = OperatorProcess(devcluster, tmp_path / "second.log").start()
        try:
            wait_ready(devcluster, namespace, "crash", 4)
            live = pods(devcluster, namespace)
            names = [p["metadata"]["name"] for p in live if not p["metadata"].get("deletionTimestamp")]
            assert len(names) == len(set(names))
            engine_names = {n for n in names if "-prefill-" in n or "-decode-" in n}
            assert len(engine_names) == 8
            deployments = get_json(devcluster, "deployments", "-n", namespace)["items"]
            assert sorted(d["metadata"]["name"] for d in deployments) == sorted(
                f"crash-r{r}-f{f}{s}" for r in range(4) for f in range(2) for s in ("", "-standby")
            )
            assert all(d["status"].get("replicas") == 1 for d in deployments)
            assert engines_at_kill <= engine_names, "the half-created engine pods were adopted, not duplicated"
            # converged: once a reconcile has run after Ready, count writes over several resyncs
            settled = third.reconciles()
            wait_for("a reconcile after Ready", lambda: third.reconciles() >= settled + 1, timeout=30)
            writes, reconciles = third.writes(), third.reconciles()
            wait_for("three more reconciles", lambda: third.reconciles() >= reconciles + 3, timeout=30)
            assert third.writes() == writes
        finally:
            third.kill(signal.SIGTERM)
    finally:
        operator.start()


# --------------------------------------------------------------------------- bad input
def test_an_invalid_spec_the_schema_cannot_reject_is_reported_and_creates_nothing(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess
) -> None:
    # widths 4 + 4 packed on 6-GPU nodes cross a node boundary: a rule CEL cannot express.
    body = small(
        "untileable", prefill={"engines": 1, "tensorParallelSize": 4}, decode={"engines": 1, "tensorParallelSize": 4}
    )
    body["spec"]["topology"] = {"gpusPerNode": 6}
    apply(devcluster, namespace, body)

    def invalid() -> dict[str, Any] | None:
        c = condition(drs_status(devcluster, namespace, "untileable"), "Valid")
        return c if c.get("status") == "False" else None

    cond = wait_for("Valid=False", invalid)
    assert "spec.topology.gpusPerNode" in cond["message"] and "do not tile 6-GPU nodes" in cond["message"]
    assert drs_status(devcluster, namespace, "untileable")["phase"] == "Invalid"
    seen = operator.reconciles()
    wait_for("two more reconciles of the invalid spec", lambda: operator.reconciles() >= seen + 2, timeout=60)
    assert pods(devcluster, namespace) == []
    assert get_json(devcluster, "deployments", "-n", namespace)["items"] == []
    events = devcluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout
    assert "SpecInvalid" in events


def test_not_enough_gpus_places_nothing_then_places_when_nodes_appear(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess
) -> None:
    pool = f"pool-{namespace}"[:63]
    body = small("starved", replicas=1, topology={"gpusPerNode": 8, "nodeSelector": {"drs-test-pool": pool}})
    apply(devcluster, namespace, body)

    def unplaced() -> dict[str, Any] | None:
        c = condition(drs_status(devcluster, namespace, "starved"), "Placed")
        return c if c.get("status") == "False" else None

    cond = wait_for("Placed=False", unplaced)
    assert "replica 0" in cond["message"]
    seen = operator.reconciles()
    wait_for("two more reconciles of the unplaceable spec", lambda: operator.reconciles() >= seen + 2, timeout=60)
    assert pods(devcluster, namespace) == [], "nothing is half-created"
    node = "hgx-007"
    devcluster.kubectl("label", "node", node, f"drs-test-pool={pool}")
    try:
        st = wait_ready(devcluster, namespace, "starved", 1)
        assert st["replicaStatuses"][0]["nodes"] == [node]
        assert condition(st, "Placed")["status"] == "True"
    finally:
        devcluster.kubectl("label", "node", node, "drs-test-pool-")


def test_deleting_the_resource_removes_every_child(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess
) -> None:
    apply(devcluster, namespace, small("gone", replicas=1))
    wait_ready(devcluster, namespace, "gone", 1)
    devcluster.kubectl("delete", "drs", "gone", "-n", namespace)

    def empty() -> bool:
        kinds = "pods,deployments,services,configmaps,secrets"
        items = get_json(devcluster, kinds, "-n", namespace, "-l", "disagg.dev/replicaset=gone")["items"]
        return not items

    wait_for("garbage collection of every child", empty, timeout=90)


def test_a_second_operator_waits_for_the_lease_and_takes_over_when_the_leader_dies(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    follower = OperatorProcess(devcluster, tmp_path / "follower.log").start()
    try:
        wait_for(
            "the follower found the lease held",
            lambda: "waiting to become leader" in (tmp_path / "follower.log").read_text(),
            timeout=30,
        )
        assert (follower.metrics() or {}).get("drs_operator_leader", 0.0) == 0.0
        assert follower.reconciles() == 0
        operator.kill(signal.SIGKILL)
        apply(devcluster, namespace, small("handover", replicas=1))
        wait_ready(devcluster, namespace, "handover", 1, timeout=120)
        assert (follower.metrics() or {}).get("drs_operator_leader") == 1.0
        assert "waiting to become leader" in (tmp_path / "follower.log").read_text()
    finally:
        follower.kill(signal.SIGTERM)
        operator.start()
