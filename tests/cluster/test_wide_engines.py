"""Engines wider than a node on the real control plane, launched for real as gangs over Ray.

The operator places a sim fleet on the session cluster's 4-GPU GB200 nodes with one engine of 8
GPUs (two trays); the pod runner runs every pod as a ``drs engine`` process bound to its node's
loopback address; the leader pod starts a real Ray head, the other rank pod joins it with a real
``ray start``, and the sim backend places one Ray actor per GPU across both. Then a rank is killed,
and a node is lost.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from drs_devcluster.testing import RunningCluster
from operator_harness import (
    OperatorProcess,
    apply,
    drs_status,
    engine_pods,
    get_json,
    running_operator,
    serving_auth,
    wait_for,
)

pytestmark = pytest.mark.cluster

UP_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def stack(
    devcluster: RunningCluster, pod_runner: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    devcluster.install_crd()
    with running_operator(devcluster, tmp_path_factory.mktemp("wide") / "operator.log") as op:
        yield op


def wide_fleet(name: str, wide_role: str, engine_port: int, base_port: int) -> dict[str, Any]:
    """One replica on GB200 trays: the ``wide_role`` engine is TP8 over two trays (MoE EP8), the other TP4."""
    wide = {"engines": 1, "tensorParallelSize": 8, "moeTensorParallelSize": 1, "moeExpertParallelSize": 8}
    narrow = {"engines": 1, "tensorParallelSize": 4, "moeTensorParallelSize": 2, "moeExpertParallelSize": 2}
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggReplicaSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "model": {"path": "sim-qwen3"},
            "engine": {"backend": "sim", "simOptions": {"speed": 0}},
            "prefill": wide if wide_role == "prefill" else narrow,
            "decode": wide if wide_role == "decode" else narrow,
            "frontend": {"workers": 1, "basePort": base_port},
            "trtllm": {"enginePort": engine_port},
            "network": {"hostNetwork": True},
            "topology": {"gpusPerNode": 4, "segmentLabel": "nvidia.com/gpu.clique", "notReadyTolerationSeconds": 0},
            "images": {"engine": "drs:dev", "frontend": "drs:dev", "pullPolicy": "Never"},
        },
    }


def wide_engine(status: dict[str, Any], role: str) -> dict[str, Any]:
    engine: dict[str, Any] = next(e for e in status["replicaStatuses"][0]["engines"] if e["role"] == role)
    return engine


def gang_serving(cluster: RunningCluster, namespace: str, name: str, role: str) -> dict[str, Any] | None:
    """The status once the replica is ready, every rank joined and the leader's gang serves."""
    st = drs_status(cluster, namespace, name)
    if st.get("readyReplicas") != 1:
        return None
    engine = wide_engine(st, role)
    if not engine.get("ready") or not all(r["joined"] for r in engine.get("ranks") or [{"joined": False}]):
        return None
    try:
        report = httpx.get(engine["url"] + "/v1/gang", headers=serving_auth(cluster, namespace, name), timeout=3).json()
    except (httpx.HTTPError, ValueError):
        return None
    return st if report.get("phase") == "serving" else None


def chat_turn(url: str, session: str) -> httpx.Headers:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model="sim-qwen3",
        messages=[{"role": "user", "content": "hello from a wide engine"}],
        max_tokens=6,
        extra_body={"conversation_params": {"conversation_id": session}},
    )
    reply: Any = raw.parse()
    assert reply.choices[0].message.generation_token_ids, "the turn generated tokens"
    return httpx.Headers(list(raw.headers.items()))


def frontend_serves(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def restarts(pod: dict[str, Any]) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    return int(statuses[0].get("restartCount") or 0)


def events(cluster: RunningCluster, namespace: str, reason: str) -> str:
    return cluster.kubectl("get", "events", "-n", namespace, "--field-selector", f"reason={reason}").stdout


def test_a_wide_prefill_engine_serves_as_one_gang_and_a_killed_rank_restarts_it_whole(
    devcluster: RunningCluster, namespace: str, stack: OperatorProcess
) -> None:
    apply(devcluster, namespace, wide_fleet("wide", "prefill", engine_port=19100, base_port=19300))
    before = wait_for(
        "the wide engine's gang to serve", lambda: gang_serving(devcluster, namespace, "wide", "prefill"), UP_TIMEOUT_S
    )
    engine = wide_engine(before, "prefill")
    assert [r["pod"] for r in engine["ranks"]] == ["wide-r0-prefill-0", "wide-r0-prefill-0-w1"]
    assert [r["node"] for r in engine["ranks"]] == engine["nodes"] and len(set(engine["nodes"])) == 2
    report = httpx.get(
        engine["url"] + "/v1/gang", headers=serving_auth(devcluster, namespace, "wide"), timeout=5
    ).json()
    addresses = {
        n["metadata"]["name"]: n["status"]["addresses"][0]["address"] for n in get_json(devcluster, "nodes")["items"]
    }
    assert [(r["rank"], r["node_ip"], r["joined"], r["workers_alive"]) for r in report["ranks"]] == [
        (0, addresses[engine["nodes"][0]], True, 4),
        (1, addresses[engine["nodes"][1]], True, 4),
    ], "one Ray actor per GPU on each rank's node"

    (url,) = before["urls"]
    wait_for("the frontend to serve", lambda: frontend_serves(url), 60)
    assert chat_turn(url, "wide-1")["x-drs-prefill"] == engine["url"]

    pods = engine_pods(devcluster, namespace)
    leader_restarts = restarts(pods["wide-r0-prefill-0"])
    old_uid = pods["wide-r0-prefill-0-w1"]["metadata"]["uid"]
    devcluster.kubectl("delete", "pod", "-n", namespace, "wide-r0-prefill-0-w1", "--wait=false")

    wait_for(
        "the engine to go down as a whole (GangRestarting)",
        lambda: "wide-r0-prefill-0" in events(devcluster, namespace, "GangRestarting"),
        120,
    )
    after = wait_for(
        "the gang to serve again", lambda: gang_serving(devcluster, namespace, "wide", "prefill"), UP_TIMEOUT_S
    )
    pods = engine_pods(devcluster, namespace)
    assert pods["wide-r0-prefill-0-w1"]["metadata"]["uid"] != old_uid, "the killed rank's pod was recreated"
    assert restarts(pods["wide-r0-prefill-0"]) > leader_restarts, "the leader restarted with the gang"
    assert "wide-r0-prefill-0" in events(devcluster, namespace, "BackOff"), "an Event for the leader's restart"
    assert "wide-r0-prefill-0" in events(devcluster, namespace, "GangReady")
    assert wide_engine(after, "prefill")["nodes"] == engine["nodes"], "the gang came back on its nodes"
    assert after["urls"] == before["urls"]
    headers = serving_auth(devcluster, namespace, "wide")
    new_session = httpx.get(engine["url"] + "/v1/gang", headers=headers, timeout=5).json()["session"]
    assert new_session != report["session"], "a new Ray cluster, not the old one half-alive"
    wait_for("the frontend to serve again", lambda: frontend_serves(url), 60)
    assert chat_turn(url, "wide-2")["x-drs-prefill"] == engine["url"]


def test_losing_the_node_of_a_rank_moves_the_replica_with_its_wide_decode_engine_as_a_whole(
    devcluster: RunningCluster, namespace: str, stack: OperatorProcess
) -> None:
    apply(devcluster, namespace, wide_fleet("move", "decode", engine_port=19200, base_port=19400))
    before = wait_for(
        "the wide decode engine's gang to serve",
        lambda: gang_serving(devcluster, namespace, "move", "decode"),
        UP_TIMEOUT_S,
    )
    lost = wide_engine(before, "decode")["nodes"][1]  # rank 1's node
    devcluster.kubectl("label", "node", lost, "node-not-ready.stage.kwok.x-k8s.io=true")
    try:

        def moved() -> dict[str, Any] | None:
            st = gang_serving(devcluster, namespace, "move", "decode")
            return st if st is not None and lost not in st["replicaStatuses"][0]["nodes"] else None

        after = wait_for("the replica to move and its gang to serve", moved, UP_TIMEOUT_S)
        engine = wide_engine(after, "decode")
        assert lost not in engine["nodes"] and len(set(engine["nodes"])) == 2
        assert [r["joined"] for r in engine["ranks"]] == [True, True]
        live = engine_pods(devcluster, namespace)
        assert all(p["spec"].get("nodeName") != lost for p in live.values())
        (url,) = after["urls"]
        wait_for("the frontend to serve", lambda: frontend_serves(url), 60)
        assert chat_turn(url, "moved")["x-drs-decode"] == engine["url"]
    finally:
        devcluster.kubectl("label", "node", lost, "node-not-ready.stage.kwok.x-k8s.io-")
