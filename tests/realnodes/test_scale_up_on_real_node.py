"""A replica added after a refit comes up at the desired weights, on a real node (issue 22: "scale
up by one replica after a refit: new engines come up current"), with its failing control first.

The fleet with per-replica NetworkPolicies (kube-router enforces them), refitted by the trainer's
pod, its desired weights stored again without their checkpoint path (as a broadcast leaves them):
the new replica's engines have no path and no holder in their own replica; they must stream the
weights from an engine of replicas 0 and 1. Under a client pod's load over the status URLs:

1. the control: replicas 0 and 1's policies narrowed to their own replica's pods and
   ``engineClients`` (the fleet's engines of other replicas dropped, the rule before the peer
   catch-up), then one replica added: its engines stay not Ready, each catch-up naming the peers
   that refused it;
2. the policies put back as the operator rendered them: the same engines, still retrying, catch up
   from a peer of replica 0 or 1 and are Ready at the desired digest, with no turn lost and every
   turn at the desired version.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_devcluster import inpod
from drs_devcluster.testing import RunningCluster

from .pods import explain, logs, wait_phase
from .test_weights_on_real_node import EXAMPLE, LOAD, NAME, POLICY, drop_path, drs, engines, pods_of, refit_fleet, wait

pytestmark = [pytest.mark.cluster, pytest.mark.realnode]

#: the client's load: the control's wait, the put-back and the catch-up
LOAD_S = 150
#: the control's failed catch-up attempts per new engine before it is judged (each asks every peer)
CONTROL_ATTEMPTS = 2
NEW = f"disagg.dev/replicaset={NAME},disagg.dev/replica=2,disagg.dev/role in (prefill,decode)"


@pytest.fixture
def refitted_under_policy(
    realcluster: RunningCluster, operator: str, realns: str, tmp_path: Path
) -> Iterator[dict[str, Any]]:
    """The fleet with per-replica policies, refitted by the trainer's pod (ended): its desired weights."""
    yield from refit_fleet(
        realcluster, realns, tmp_path, {**EXAMPLE, "spec": {**EXAMPLE["spec"], "networkPolicy": POLICY}}
    )


def fleet_engines_peer(peer: dict[str, Any]) -> bool:
    """A policy's ``from`` entry admitting the fleet's engines of every replica (no replica label)."""
    labels = (peer.get("podSelector") or {}).get("matchLabels") or {}
    return "disagg.dev/replicaset" in labels and "disagg.dev/replica" not in labels


def set_from(cluster: RunningCluster, ns: str, froms: dict[str, list[dict[str, Any]]]) -> None:
    for name, peers in froms.items():
        patch = [{"op": "replace", "path": "/spec/ingress/0/from", "value": peers}]
        cluster.kubectl("patch", "networkpolicy", name, "-n", ns, "--type=json", "-p", json.dumps(patch))


def is_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def held(cluster: RunningCluster, ns: str, pod: str) -> dict[str, Any]:
    """The engine's own ``GET /control/weights`` ({} while the status lists no URL for it)."""
    url = next((e["url"] for e in engines(drs(cluster, ns)["status"]) if e["name"] == pod and e.get("url")), None)
    if url is None:
        return {}
    got = cluster.kubectl("exec", pod, "-n", ns, "--", *inpod.held_weights_command(url), check=False)
    body: dict[str, Any] = json.loads(got.stdout) if got.returncode == 0 else {}
    return body


def failed_attempts(cluster: RunningCluster, ns: str, pod: str) -> int:
    catch_up = held(cluster, ns, pod).get("catch_up") or {}
    return int(catch_up.get("attempts") or 0) if catch_up.get("phase") == "pending" else 0


def test_a_replica_added_after_a_refit_catches_up_from_the_other_replicas_and_not_when_they_refuse(
    realcluster: RunningCluster, refitted_under_policy: dict[str, Any], realns: str
) -> None:
    desired = refitted_under_policy
    drop_path(realcluster, realns)
    policies = json.loads(realcluster.kubectl("get", "networkpolicy", "-n", realns, "-o", "json").stdout)["items"]
    rendered = {p["metadata"]["name"]: p["spec"]["ingress"][0]["from"] for p in policies if p["spec"].get("ingress")}
    assert len(rendered) >= 2 and all(any(fleet_engines_peer(f) for f in peers) for peers in rendered.values())
    args = ["--name", NAME, "--namespace", realns, "--seconds", str(LOAD_S), "--sessions", "8", "--answers"]
    realcluster.kubectl(
        "apply", "-f", "-", input=yaml.safe_dump_all(inpod.client_objects("load-up", realns, LOAD, args))
    )
    wait(
        "the client's first turn",
        lambda: "[load] started" in realcluster.kubectl("logs", "load-up", "-n", realns, check=False).stdout,
    )
    # 1. the control: the other replicas refuse the new engines' stream
    set_from(realcluster, realns, {n: [f for f in peers if not fleet_engines_peer(f)] for n, peers in rendered.items()})
    realcluster.kubectl("patch", "drs", NAME, "-n", realns, "--type=merge", "-p", '{"spec": {"replicas": 3}}')
    wait("the new replica's two engine pods", lambda: len(pods_of(realcluster, realns, NEW)) == 2, timeout=120)
    new = pods_of(realcluster, realns, NEW)
    names = [p["metadata"]["name"] for p in new]
    wait(
        f"{CONTROL_ATTEMPTS} failed catch-up attempts of each new engine",
        lambda: all(failed_attempts(realcluster, realns, n) >= CONTROL_ATTEMPTS for n in names),
        timeout=180,
    )
    assert not any(is_ready(p) for p in pods_of(realcluster, realns, NEW)), names
    # 2. the policies as rendered: the same engines catch up on a later attempt (back-off <= 30 s)
    set_from(realcluster, realns, rendered)
    wait(
        "the new engines Ready",
        lambda: all(is_ready(p) for p in pods_of(realcluster, realns, NEW)),
        timeout=150,
        why=lambda: explain(realcluster, realns),
    )
    others = {e["url"] for e in engines(drs(realcluster, realns)["status"]) if not e["name"].startswith(f"{NAME}-r2-")}
    for pod in new:
        shown = held(realcluster, realns, pod["metadata"]["name"])
        assert shown["weights_digest"] == desired["digest"], shown
        assert (shown.get("catch_up") or {}).get("reached_from") in others, shown
    client = wait_phase(realcluster, realns, "load-up", {"Succeeded", "Failed"}, timeout=LOAD_S + 120)
    out = logs(realcluster, realns, "load-up")
    assert client["status"]["phase"] == "Succeeded", out
    load = json.loads(out.strip().splitlines()[-1])["load"]
    load.pop("answers")
    assert load["lost"] == 0 and load["turns"] > 0, load
    assert load["versions"] == {desired["version"]: load["turns"]}, load["versions"]
