"""Weights as desired state on a real node (issue 22's verification): the trainer's refit step as a
pod refits the fleet by checkpoint path and ends (its sidecar with it); then, under Gym-shaped load
from a client pod over the status URLs, a decode and then a prefill engine pod are deleted. The
replacement is a real container started by the kubelet: it must serve no turn at other weights,
status must never show a Ready engine at other weights, and every engine ends at the desired
digest. What would break it: a replacement that ignores the desired weights (the weights
ConfigMap's ``desired`` key empty) starts at the base weights and serves turns at them."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_devcluster import inpod
from drs_devcluster.testing import RunningCluster
from drs_operator.api.constants import ANNOTATION_DESIRED_WEIGHTS, DEFAULT_MODEL_MOUNT_PATH

from .pods import explain, logs, wait_phase

pytestmark = [pytest.mark.cluster, pytest.mark.realnode]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "pod-network-sim.yaml").read_text())
LOAD = (ROOT / "examples" / "load_client.py").read_text()
TRAINER = (ROOT / "examples" / "trainer" / "refit_in_pod.py").read_text()
NAME = EXAMPLE["metadata"]["name"]
CLAIM = "checkpoints"
READY_S = 300.0
POLL_S = 1.0
LOAD_S = 45


def drs(cluster: RunningCluster, ns: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(cluster.kubectl("get", "drs", NAME, "-n", ns, "-o", "json").stdout)
    return body


def engines(st: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for r in st.get("replicaStatuses") or [] for e in r.get("engines") or []]


def ready_fleet(cluster: RunningCluster, ns: str) -> bool:
    body = drs(cluster, ns)
    st = body.get("status") or {}
    return bool(st.get("phase") == "Ready" and st.get("observedGeneration") == body["metadata"]["generation"])


def wait(what: str, ok: Any, timeout: float = READY_S, why: Callable[[], str] | None = None) -> None:
    """Until ``ok()``; past ``timeout`` fails, with ``why()`` (the cluster's state) in the message."""
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not reached after {timeout:.0f}s" + (f"\n{why()}" if why else ""))
        time.sleep(POLL_S)


class StaleWatch:
    """Samples the status every second: every Ready engine shown at other weights than ``desired``."""

    def __init__(self, cluster: RunningCluster, ns: str, desired: str) -> None:
        self.cluster, self.ns, self.desired = cluster, ns, desired
        self.samples = 0
        self.stale: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StaleWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            got = self.cluster.kubectl("get", "drs", NAME, "-n", self.ns, "-o", "json", check=False)
            if got.returncode != 0:
                continue
            self.samples += 1
            for e in engines(json.loads(got.stdout).get("status") or {}):
                if e.get("ready") and e.get("weightsVersion") not in (None, self.desired):
                    self.stale.append((e["name"], e["weightsVersion"]))


@pytest.fixture
def refitted(realcluster: RunningCluster, operator: str, realns: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The fleet, mounting a checkpoint volume, refitted by the trainer's pod (ended): its desired weights."""
    yield from refit_fleet(realcluster, realns, tmp_path, EXAMPLE)


#: Per-replica NetworkPolicies: each replica's engines admit its own pods, the fleet's engines,
#: the trainer's pod (its sidecar refits them) and the operator's pods (it asks what they hold).
POLICY = {
    "enabled": True,
    "engineClients": [
        {"podSelector": {"matchLabels": {"app": "trainer"}}},
        # not the operator: the policies admit its pods themselves (the chart tells it their labels)
    ],
}


@pytest.fixture
def refitted_under_policy(
    realcluster: RunningCluster, operator: str, realns: str, tmp_path: Path
) -> Iterator[dict[str, Any]]:
    """``refitted`` with ``spec.networkPolicy`` on (kube-router enforces it on the real node)."""
    fleet = json.loads(json.dumps(EXAMPLE))
    fleet["spec"]["networkPolicy"] = POLICY
    yield from refit_fleet(realcluster, realns, tmp_path, fleet)


def checkpoint_fleet(
    realcluster: RunningCluster, realns: str, tmp_path: Path, example: dict[str, Any]
) -> Iterator[None]:
    """``example`` Ready, mounting a checkpoint volume (a host directory the trainer's pod writes)."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    checkpoints.chmod(0o777)  # written by the trainer container's non-root user
    objs = inpod.checkpoint_volume_objects(CLAIM, realns, checkpoints)
    realcluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))
    try:
        fleet = json.loads(json.dumps(example))
        fleet["spec"]["model"]["volume"] = {"persistentVolumeClaim": {"claimName": CLAIM}}
        realcluster.kubectl("apply", "-n", realns, "-f", "-", input=yaml.safe_dump(fleet))
        wait("the fleet Ready", lambda: ready_fleet(realcluster, realns), why=lambda: explain(realcluster, realns))
        yield
    finally:
        realcluster.kubectl("delete", "pv", f"{realns}-{CLAIM}", "--wait=false", check=False)


def refit_fleet(
    realcluster: RunningCluster, realns: str, tmp_path: Path, example: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    """``example`` (mounting a checkpoint volume) Ready, refitted by the trainer's pod: the desired weights."""
    for _ in checkpoint_fleet(realcluster, realns, tmp_path, example):
        objs = inpod.trainer_objects("trainer", realns, NAME, TRAINER, CLAIM, DEFAULT_MODEL_MOUNT_PATH)
        realcluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))
        phase = wait_phase(realcluster, realns, "trainer", {"Succeeded", "Failed"}, timeout=240)["status"]["phase"]
        out = logs(realcluster, realns, "trainer", "-c", "trainer")
        assert phase == "Succeeded", out
        desired: dict[str, Any] = drs(realcluster, realns)["status"]["weights"]["desired"]
        yield desired


def drop_path(cluster: RunningCluster, ns: str) -> None:
    """The stored desired weights rewritten without their checkpoint path (as a broadcast leaves
    them); returns once the weights ConfigMap has them so, with the fleet's engines as ``peers``."""
    stored = json.loads(drs(cluster, ns)["metadata"]["annotations"][ANNOTATION_DESIRED_WEIGHTS])
    stored.pop("path")
    annotation = json.dumps(stored, separators=(",", ":"))
    cluster.kubectl("annotate", "drs", NAME, "-n", ns, "--overwrite", f"{ANNOTATION_DESIRED_WEIGHTS}={annotation}")

    def pathless() -> bool:
        got = json.loads(cluster.kubectl("get", "configmap", f"{NAME}-weights", "-n", ns, "-o", "json").stdout)
        data = got.get("data") or {}
        return bool(data.get("peers")) and "path" not in json.loads(data.get("desired") or "{}")

    wait("the weights ConfigMap with path-less desired weights and peers", pathless, timeout=60)


def pods_of(cluster: RunningCluster, ns: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = json.loads(
        cluster.kubectl("get", "pods", "-n", ns, "-l", selector, "-o", "json").stdout
    )["items"]
    return items


def kill_under_load(cluster: RunningCluster, ns: str, role: str, desired: dict[str, Any]) -> list[str]:
    """Replica 0's ``role`` pods (``role``: a label selector term of ``disagg.dev/role``) deleted
    (grace 0) while a client pod drives turns over the status URLs; the replacements Ready, the
    client's every turn at the desired weights, status true. Returns the replacements' names."""
    version, digest = desired["version"], desired["digest"]
    client = "load-replica" if " in " in role else f"load-{role}"  # a pod name: no selector syntax
    args = ["--name", NAME, "--namespace", ns, "--seconds", str(LOAD_S), "--sessions", "8", "--answers"]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(inpod.client_objects(client, ns, LOAD, args)))
    wait(
        f"{client}'s first turn",
        lambda: "[load] started" in cluster.kubectl("logs", client, "-n", ns, check=False).stdout,
    )
    term = role if " in " in role else f"disagg.dev/role={role}"
    selector = f"disagg.dev/replicaset={NAME},{term},disagg.dev/replica=0"
    victims = pods_of(cluster, ns, selector)
    uids = {v["metadata"]["uid"] for v in victims}

    def replacements() -> list[str]:
        return [
            p["metadata"]["name"]
            for p in pods_of(cluster, ns, selector)
            if p["metadata"]["uid"] not in uids
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
        ]

    with StaleWatch(cluster, ns, version) as watch:
        names = [v["metadata"]["name"] for v in victims]
        cluster.kubectl("delete", "pod", *names, "-n", ns, "--grace-period=0", "--force")
        wait(
            f"Ready replacements of the {role} pods",
            lambda: len(replacements()) == len(victims),
            why=lambda: explain(cluster, ns),
        )
        phase = wait_phase(cluster, ns, client, {"Succeeded", "Failed"}, timeout=LOAD_S + 120)["status"]["phase"]
    out = logs(cluster, ns, client)
    assert phase == "Succeeded", out
    load = json.loads(out.strip().splitlines()[-1])["load"]
    assert load["lost"] == 0 and load["turns"] > 0, {k: v for k, v in load.items() if k != "answers"}
    # every turn answered at the desired weights (the refit was over before this load began)
    assert load["versions"] == {version: load["turns"]}, (role, load["versions"])
    assert watch.samples > 0 and not watch.stale, (role, watch.samples, watch.stale[:5])

    def all_at_desired() -> bool:
        shown = engines(drs(cluster, ns)["status"])
        return len(shown) == 4 and all(e.get("weightsDigest") == digest for e in shown)

    wait("every engine's status digest the desired one", all_at_desired, timeout=60)
    return replacements()


def test_a_replacement_engine_serves_no_turn_at_other_weights_and_status_stays_true(
    realcluster: RunningCluster, refitted: dict[str, Any], realns: str
) -> None:
    for role in ("decode", "prefill"):
        kill_under_load(realcluster, realns, role, refitted)


def test_a_replica_replaced_under_path_less_weights_catches_up_from_the_other_replica_through_the_policies(
    realcluster: RunningCluster, refitted_under_policy: dict[str, Any], realns: str
) -> None:
    """The desired weights as a broadcast leaves them (no checkpoint path), per-replica policies on:
    both engine pods of replica 0 deleted at once have no holder in their own replica; each must
    stream the weights from replica 1's engines. What would break it: a replica policy that admits
    only its own replica's pods (the stream refused; the replacements never Ready)."""
    desired = refitted_under_policy
    drop_path(realcluster, realns)
    fresh = kill_under_load(realcluster, realns, "disagg.dev/role in (prefill,decode)", refitted_under_policy)
    urls = {e["name"]: e["url"] for e in engines(drs(realcluster, realns)["status"])}
    replica1 = {url for name, url in urls.items() if name.startswith(f"{NAME}-r1-")}
    assert len(fresh) == 2 and len(replica1) == 2, (fresh, urls)
    for pod in fresh:
        got = realcluster.kubectl("exec", pod, "-n", realns, "--", *inpod.held_weights_command(urls[pod]))
        held = json.loads(got.stdout)
        catch_up = held.get("catch_up") or {}
        assert held["weights_digest"] == desired["digest"], (pod, held)
        assert catch_up.get("source") == "peers" and catch_up.get("reached_from") in replica1, (pod, catch_up)
