"""The fleet on a real node: the operator installed by Helm from the image built here (a pod with
its ServiceAccount), a sim fleet in pod networking as containers, the trainer-side client in a pod
driving turns through the Service URLs of the status; the real NeMo-Gym 0.7.0 (its own
``vllm_model`` server, in the ``drs-gym`` image, configured by ``drs gym-config`` in an init
container) driving tool-calling conversations through them; then what kwok's instant readiness
hides: a roll, a deleted pod, a lost node (its kubelet stopped) and a killed operator pod."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_devcluster import images, inpod, nodeconfig, realnodes
from drs_devcluster.testing import RunningCluster
from drs_operator.api.constants import DEFAULT_MODEL_MOUNT_PATH, LABEL_ROLE
from drs_protocol.engine_config import SIM_DEFAULT_TOKENS_PER_BLOCK
from drs_protocol.enums import ROLES

from .pods import wait_phase

pytestmark = [pytest.mark.cluster, pytest.mark.realnode]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "pod-network-sim.yaml").read_text())
CLIENT = (ROOT / "examples" / "gym_client.py").read_text()
TRAINER = (ROOT / "examples" / "trainer" / "refit_in_pod.py").read_text()
GYM_AGENT = (ROOT / "examples" / "gym_agent.py").read_text()
READY_S = 300.0
POLL_S = 1.0
#: How long a pod's log is asked for again while the apiserver cannot reach its kubelet.
LOGS_DEADLINE_S = 60.0


def drs(cluster: RunningCluster, ns: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(cluster.kubectl("get", "drs", "pod-sim", "-n", ns, "-o", "json").stdout)
    return body


def wait_drs(cluster: RunningCluster, ns: str, ok: Any, what: str, timeout: float = READY_S) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        body = drs(cluster, ns)
        if ok(body):
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached after {timeout:.0f}s: {json.dumps(body.get('status'))[:3000]}")
        time.sleep(POLL_S)


def converged(body: dict[str, Any]) -> bool:
    st = body.get("status") or {}
    return bool(st.get("phase") == "Ready" and st.get("observedGeneration") == body["metadata"]["generation"])


def fleet_pods(cluster: RunningCluster, ns: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", ns, "-l", "disagg.dev/replicaset=pod-sim", "-o", "json").stdout
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def all_ready(pods: list[dict[str, Any]]) -> bool:
    return bool(pods) and all(
        any(c["type"] == "Ready" and c["status"] == "True" for c in (p.get("status", {}).get("conditions") or []))
        for p in pods
    )


def run_client(cluster: RunningCluster, ns: str, name: str = "gym-client") -> str:
    objs = inpod.client_objects(name, ns, CLIENT, ["--name", "pod-sim", "--namespace", ns])
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))
    phase = wait_phase(cluster, ns, name, {"Succeeded", "Failed"}, timeout=240)["status"]["phase"]
    out = pod_logs(cluster, ns, name)
    assert phase == "Succeeded", out
    return out


def pod_logs(cluster: RunningCluster, ns: str, name: str, deadline_s: float = LOGS_DEADLINE_S) -> str:
    """The pod's log, read through the apiserver from its node's kubelet. Right after a kubelet
    restart the apiserver's connection to it can time out (CI saw ``dial tcp …: i/o timeout`` once
    after the node-loss test's kubelet came back): such a failure is tried again until
    ``deadline_s``; any other failure, or one past the deadline, fails the test."""
    deadline = time.monotonic() + deadline_s
    attempts = 0
    while True:
        attempts += 1
        got = cluster.kubectl("logs", name, "-n", ns, check=False)
        if got.returncode == 0:
            if attempts > 1:
                print(f"kubectl logs {name}: answered at attempt {attempts}")
            return got.stdout
        transient = "dial tcp" in got.stderr or "i/o timeout" in got.stderr
        assert transient and time.monotonic() < deadline, (
            f"kubectl logs {name} failed ({attempts} attempts): {got.stderr}"
        )
        time.sleep(POLL_S)


@pytest.fixture
def fleet(realcluster: RunningCluster, operator: str, realns: str) -> str:
    realcluster.kubectl("apply", "-n", realns, "-f", "-", input=yaml.safe_dump(EXAMPLE))
    wait_drs(realcluster, realns, converged, "pod-sim Ready")
    return realns


def test_the_in_cluster_client_drives_turns_through_service_urls_of_the_status(
    realcluster: RunningCluster, fleet: str
) -> None:
    st = drs(realcluster, fleet)["status"]
    assert all(u.startswith("http://pod-sim-r") and f".{fleet}.svc:" in u for u in st["urls"]), st["urls"]
    pods = fleet_pods(realcluster, fleet)
    assert all_ready(pods) and {p["spec"]["nodeName"] for p in pods} <= {nodeconfig.node_name(i) for i in range(2)}
    assert all(not p["spec"].get("hostNetwork") for p in pods)
    for p in pods:  # the restrictive securityContext, as the real kubelet ran them
        assert p["spec"]["securityContext"]["runAsNonRoot"] is True
        assert p["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    out = run_client(realcluster, fleet)
    turns = [line for line in out.splitlines() if " turn " in line and " via http://pod-sim-r" in line]
    assert len(turns) == 12, out
    assert all("prefill=" in t and "prefill=None" not in t and "decode=None" not in t for t in turns), out
    later = [t for t in turns if " turn 0 " not in t]
    assert any(not t.endswith("hits 0/0") and " hits 0/" not in t for t in later), out  # the prefix cache held


@pytest.fixture(scope="module")
def gym_image(realcluster: RunningCluster) -> str:
    """``drs-gym:<version>`` built (cached by its inputs) and imported into the first real node
    (the Gym pod is pinned there: one 1.6 GB import, not one per node)."""
    realnodes.import_archive(realcluster.cluster.layout, images.ensure_gym_image(), only=[0])
    return images.gym_ref()


def test_the_real_nemo_gym_drives_the_fleet_from_a_pod_through_the_status_urls(
    realcluster: RunningCluster, fleet: str, gym_image: str
) -> None:
    args = ["--block-tokens", str(SIM_DEFAULT_TOKENS_PER_BLOCK)]
    objs = inpod.gym_objects("gym-rollouts", fleet, "pod-sim", GYM_AGENT, args, node=nodeconfig.node_name(0))
    realcluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))
    body = wait_phase(realcluster, fleet, "gym-rollouts", {"Succeeded", "Failed"}, timeout=300)
    out = realcluster.kubectl("logs", "gym-rollouts", "-n", fleet, "-c", "gym").stdout
    config = realcluster.kubectl("logs", "gym-rollouts", "-n", fleet, "-c", "gym-config").stdout
    assert body["status"]["phase"] == "Succeeded", out + config
    assert body["spec"]["containers"][0]["image"] == gym_image and body["spec"]["nodeName"] == nodeconfig.node_name(0)
    print(out)  # Gym's turns and the agent's JSON line, for the test's log
    result = json.loads(out.strip().splitlines()[-1])
    urls = drs(realcluster, fleet)["status"]["urls"]
    assert result["base_urls"] == [u + "/v1" for u in urls], result  # what drs gym-config wrote from the status
    assert result["ok"] is True and result["turns"] == "12/12" and result["ids_equal"] == "12/12", result
    assert result["continuity"] == "8/8" and result["prefill_affinity"] == "8/8", result
    assert result["url_affinity"]["ok"] and sum(result["url_affinity"]["per_frontend"]) == 12, result


def test_an_in_cluster_trainer_refits_every_engine_through_its_sidecar_container(
    realcluster: RunningCluster, fleet: str, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    checkpoints.chmod(0o777)  # written by the trainer container's non-root user
    volume = inpod.checkpoint_volume_objects("checkpoints", fleet, checkpoints)
    realcluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(volume))
    try:
        patch = {"spec": {"model": {"volume": {"persistentVolumeClaim": {"claimName": "checkpoints"}}}}}
        realcluster.kubectl("patch", "drs", "pod-sim", "-n", fleet, "--type=merge", "-p", json.dumps(patch))
        wait_drs(realcluster, fleet, lambda b: converged(b) and all_ready(fleet_pods(realcluster, fleet)), "rolled")
        objs = inpod.trainer_objects("trainer", fleet, "pod-sim", TRAINER, "checkpoints", DEFAULT_MODEL_MOUNT_PATH)
        realcluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))
        phase = wait_phase(realcluster, fleet, "trainer", {"Succeeded", "Failed"}, timeout=240)["status"]["phase"]
        out = realcluster.kubectl("logs", "trainer", "-n", fleet, "-c", "trainer").stdout
        assert phase == "Succeeded", (
            out + realcluster.kubectl("logs", "trainer", "-n", fleet, "-c", "refit-sidecar").stdout
        )
        (version,) = [p.name for p in checkpoints.iterdir()]  # what the trainer wrote into the volume
        assert f"version: {version}}} to the sidecar: complete=True engines=4 ok=4" in out, out
        st = drs(realcluster, fleet)["status"]
        assert st["weights"]["version"] == version
        engines = [e for r in st["replicaStatuses"] for e in r["engines"]]
        assert len(engines) == 4 and all(e["weightsVersion"] == version for e in engines), engines
        assert all(f"{e['name']}: weightsVersion {version}" in out for e in engines), out
    finally:
        realcluster.kubectl("delete", "pv", f"{fleet}-checkpoints", "--wait=false", check=False)


def test_a_roll_replaces_every_engine_and_status_tracks_real_readiness(realcluster: RunningCluster, fleet: str) -> None:
    before = {p["metadata"]["uid"] for p in fleet_pods(realcluster, fleet)}
    realcluster.kubectl(
        "patch", "drs", "pod-sim", "-n", fleet, "--type=merge", "-p", '{"spec":{"engine":{"simOptions":{"speed":0.2}}}}'
    )
    seen_ready_while_pods_unready = []
    deadline = time.monotonic() + READY_S
    while True:
        body = drs(realcluster, fleet)
        pods = fleet_pods(realcluster, fleet)
        if converged(body) and not all_ready(pods):
            seen_ready_while_pods_unready.append([p["metadata"]["name"] for p in pods])
        engines = [p for p in pods if p["metadata"]["labels"].get("disagg.dev/role") in ("prefill", "decode")]
        if converged(body) and all_ready(pods) and not ({p["metadata"]["uid"] for p in engines} & before):
            break
        assert time.monotonic() < deadline, json.dumps(body.get("status"))[:3000]
        time.sleep(POLL_S)
    assert not seen_ready_while_pods_unready
    run_client(realcluster, fleet, "client-after-roll")


def test_a_deleted_engine_pod_is_replaced_and_serves_again(realcluster: RunningCluster, fleet: str) -> None:
    engines = [p for p in fleet_pods(realcluster, fleet) if p["metadata"]["labels"]["disagg.dev/role"] == "decode"]
    victim = engines[0]
    realcluster.kubectl("delete", "pod", victim["metadata"]["name"], "-n", fleet, "--wait=false")
    wait_drs(realcluster, fleet, lambda b: not converged(b), "the fleet noticing the deleted pod", timeout=60)

    def back(body: dict[str, Any]) -> bool:
        pods = fleet_pods(realcluster, fleet)
        uids = {p["metadata"]["uid"] for p in pods}
        return converged(body) and all_ready(pods) and victim["metadata"]["uid"] not in uids

    wait_drs(realcluster, fleet, back, "the fleet Ready with a new engine pod")
    run_client(realcluster, fleet, "client-after-delete")


def test_a_killed_operator_pod_is_replaced_and_the_new_one_reconciles(
    realcluster: RunningCluster, operator: str, fleet: str
) -> None:
    out = realcluster.kubectl("get", "pods", "-n", operator, "-o", "json").stdout
    (op,) = json.loads(out)["items"]
    realcluster.kubectl("delete", "pod", op["metadata"]["name"], "-n", operator, "--grace-period=0", "--force")
    realcluster.kubectl("patch", "drs", "pod-sim", "-n", fleet, "--type=merge", "-p", '{"spec":{"replicas":1}}')

    def scaled(body: dict[str, Any]) -> bool:
        return converged(body) and body["status"].get("replicas") == 1 and len(body["status"]["urls"]) == 1

    wait_drs(realcluster, fleet, scaled, "the new operator pod scaling the fleet to 1")
    pods = json.loads(realcluster.kubectl("get", "pods", "-n", operator, "-o", "json").stdout)["items"]
    assert [p["metadata"]["uid"] for p in pods] != [op["metadata"]["uid"]]


def test_a_lost_node_takes_the_fleet_down_and_its_return_brings_it_back(
    realcluster: RunningCluster, fleet: str
) -> None:
    layout = realcluster.cluster.layout
    # The node of an engine pod: losing it takes a replica, so the fleet down.
    engine = next(p for p in fleet_pods(realcluster, fleet) if p["metadata"]["labels"][LABEL_ROLE] in ROLES)
    lost = engine["spec"]["nodeName"]
    index = int(lost.split("-")[1])
    assert lost == nodeconfig.node_name(index)
    realnodes.stop_kubelet(layout, index)
    try:

        def node_not_ready() -> bool:
            node = json.loads(realcluster.kubectl("get", "node", lost, "-o", "json").stdout)
            return any(c["type"] == "Ready" and c["status"] != "True" for c in node["status"]["conditions"])

        deadline = time.monotonic() + 60
        while not node_not_ready():
            assert time.monotonic() < deadline, "node still Ready 60 s after its kubelet stopped"
            time.sleep(POLL_S)
        wait_drs(realcluster, fleet, lambda b: (b.get("status") or {}).get("phase") != "Ready", "fleet not Ready", 120)
    finally:
        realnodes.start_kubelet(layout, index)
    wait_drs(realcluster, fleet, lambda b: converged(b) and all_ready(fleet_pods(realcluster, fleet)), "fleet back")
    run_client(realcluster, fleet, "client-after-node-loss")
