"""The watch caches' bookkeeping (kube/informer.py, kube/cache.py) without a server: how watch
events and the operator's own writes are ordered, the owner index, the GPU sums per node, and
which node changes wake the reconciles. The list/watch itself runs against the real control
plane in tests/cluster/test_operator_scale.py."""

from __future__ import annotations

from typing import Any

from drs_operator.api.constants import GPU_RESOURCE, LABEL_REPLICASET
from drs_operator.kube.cache import GpuUsage, node_change_matters, project_gpu_pod, project_node
from drs_operator.kube.informer import Informer


def obj(name: str, rv: int, owner: str | None = "fleet", namespace: str = "ns", **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "resourceVersion": str(rv)}
    if owner:
        meta["labels"] = {LABEL_REPLICASET: owner}
    return {"metadata": meta, **extra}


def informer(changes: list[tuple[Any, Any]] | None = None) -> Informer:
    def index(o: dict[str, Any]) -> tuple[str, str] | None:
        owner = (o["metadata"].get("labels") or {}).get(LABEL_REPLICASET)
        return (o["metadata"]["namespace"], owner) if owner else None

    return Informer(
        "Pod",
        lambda **_: None,
        index=index,
        on_change=(lambda old, new: changes.append((old, new))) if changes is not None else None,
    )


def rv(o: dict[str, Any] | None) -> str | None:
    return None if o is None else str(o["metadata"]["resourceVersion"])


def test_a_watch_event_older_than_our_own_write_is_skipped() -> None:
    inf = informer()
    inf._apply("ADDED", obj("p", 10))
    inf.upsert(obj("p", 12))  # our replace answered version 12
    inf._apply("MODIFIED", obj("p", 11))  # an update from before our write arrives late
    assert rv(inf.get("ns", "p")) == "12"
    inf._apply("MODIFIED", obj("p", 13))
    assert rv(inf.get("ns", "p")) == "13"


def test_our_write_older_than_what_the_watch_saw_is_not_put_in() -> None:
    inf = informer()
    inf._apply("MODIFIED", obj("p", 20))
    inf.upsert(obj("p", 15))
    assert rv(inf.get("ns", "p")) == "20"


def test_a_write_older_than_the_deletion_the_watch_reported_does_not_bring_the_object_back() -> None:
    inf = informer()
    inf._apply("ADDED", obj("p", 5))
    inf._apply("DELETED", obj("p", 9))
    inf.upsert(obj("p", 7))
    assert inf.get("ns", "p") is None
    inf.upsert(obj("p", 10))  # created again after the deletion
    assert rv(inf.get("ns", "p")) == "10"


def test_a_deletion_of_an_older_incarnation_does_not_remove_a_newer_one() -> None:
    inf = informer()
    inf.upsert(obj("p", 30))  # we created it anew
    inf._apply("DELETED", obj("p", 25))  # the previous one's deletion arrives late
    assert rv(inf.get("ns", "p")) == "30"


def test_our_delete_shows_as_terminating_until_the_watch_reports_it() -> None:
    inf = informer()
    inf._apply("ADDED", obj("p", 5))
    inf.mark_deleting("ns", "p", "2026-01-01T00:00:00Z")
    assert inf.get("ns", "p")["metadata"]["deletionTimestamp"] == "2026-01-01T00:00:00Z"  # type: ignore[index]
    inf._apply("DELETED", obj("p", 6))
    assert inf.get("ns", "p") is None
    inf.mark_deleting("ns", "gone", "2026-01-01T00:00:00Z")  # nothing to mark
    assert inf.get("ns", "gone") is None


def test_versions_that_are_not_integers_turn_our_writes_off_and_events_always_apply() -> None:
    inf = informer()
    inf._apply("ADDED", {"metadata": {"name": "p", "namespace": "ns", "resourceVersion": "abc"}})
    inf.upsert(obj("p", 99))
    assert rv(inf.get("ns", "p")) == "99"  # the store held no comparable version: ours is newer
    inf._apply("MODIFIED", {"metadata": {"name": "p", "namespace": "ns", "resourceVersion": "xyz"}})
    assert rv(inf.get("ns", "p")) == "xyz"
    inf.upsert({"metadata": {"name": "p", "namespace": "ns", "resourceVersion": "zzz"}})
    assert rv(inf.get("ns", "p")) == "xyz"


def test_the_owner_index_follows_relabels_and_deletions() -> None:
    changes: list[tuple[Any, Any]] = []
    inf = informer(changes)
    inf._apply("ADDED", obj("a", 1, owner="x"))
    inf._apply("ADDED", obj("b", 2, owner="x"))
    inf._apply("ADDED", obj("c", 3, owner="y", namespace="other"))
    assert set(inf.by_index(("ns", "x"))) == {("ns", "a"), ("ns", "b")}
    inf._apply("MODIFIED", obj("b", 4, owner="z"))
    inf._apply("DELETED", obj("a", 5, owner="x"))
    assert inf.by_index(("ns", "x")) == {}
    assert set(inf.by_index(("ns", "z"))) == {("ns", "b")}
    assert set(inf.by_index(("other", "y"))) == {("other", "c")}
    assert len(changes) == 5 and changes[-1][1] is None


def pod(name: str, node: str | None, gpus: int, owner: str | None = None, namespace: str = "ns") -> dict[str, Any]:
    body = obj(name, 1, owner=owner, namespace=namespace)
    body["spec"] = {
        "nodeName": node,
        "containers": [{"name": "c", "resources": {"limits": {GPU_RESOURCE: str(gpus)}}}] if gpus else [{"name": "c"}],
    }
    return body


def test_gpu_sums_per_node_exclude_the_asking_fleet_and_follow_changes() -> None:
    usage = GpuUsage()
    mine = project_gpu_pod(pod("m", "n1", 4, owner="fleet"))
    theirs = project_gpu_pod(pod("t", "n1", 2))
    namesake = project_gpu_pod(pod("s", "n2", 8, owner="fleet", namespace="elsewhere"))
    for p in (mine, theirs, namesake):
        usage.change(None, p)
    assert usage.used_by_others("ns", "fleet") == {"n1": 2, "n2": 8}
    assert usage.used_by_others("elsewhere", "fleet") == {"n1": 6}
    usage.change(theirs, None)
    assert usage.used_by_others("ns", "fleet") == {"n2": 8}


def test_pods_without_gpus_are_not_kept() -> None:
    assert project_gpu_pod(pod("cpu", "n1", 0)) is None
    assert project_gpu_pod(pod("gpu", "n1", 1))["gpus"] == 1  # type: ignore[index]


def node(heartbeat: str, ready: str = "True", labels: dict[str, str] | None = None, rv: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"name": "n1", "labels": labels or {}, "resourceVersion": str(rv), "managedFields": [{}]},
        "spec": {},
        "status": {
            "allocatable": {GPU_RESOURCE: "8", "cpu": "64"},
            "conditions": [
                {"type": "Ready", "status": ready, "reason": "KubeletReady", "lastHeartbeatTime": heartbeat},
                {"type": "MemoryPressure", "status": "False", "lastHeartbeatTime": heartbeat},
            ],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.2"}],
        },
    }


def test_node_heartbeats_do_not_wake_reconciles_but_readiness_and_labels_do() -> None:
    base = project_node(node("t1", rv=1))
    assert not node_change_matters(base, project_node(node("t2", rv=2)))
    assert node_change_matters(base, project_node(node("t2", ready="False", rv=3)))
    assert node_change_matters(base, project_node(node("t2", labels={"pool": "a"}, rv=4)))
    assert node_change_matters(None, base) and node_change_matters(base, None)
