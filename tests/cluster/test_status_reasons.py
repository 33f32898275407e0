"""A child that cannot run says why, on the real control plane: ``examples/reference.yaml`` applied
without its ``models`` PersistentVolumeClaim (as a new user would) leaves every engine pod
unschedulable, and the status and an Event name the pod and the scheduler's reason."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest
from drs_devcluster.testing import RunningCluster
from operator_harness import ROOT, OperatorProcess, apply, condition, drs_status, get_json, load_example, wait_for

pytestmark = pytest.mark.cluster

MISSING_PVC = 'persistentvolumeclaim "models" not found'


@pytest.fixture(scope="module")
def operator(devcluster: RunningCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    devcluster.kubectl("apply", "-f", str(ROOT / "crds"))
    wait_for(
        "the CRD to be Established",
        lambda: (
            devcluster.kubectl(
                "wait", "--for=condition=Established", "crd/disaggreplicasets.disagg.dev", "--timeout=10s", check=False
            ).returncode
            == 0
        ),
    )
    op = OperatorProcess(devcluster, tmp_path_factory.mktemp("operator") / "operator.log").start()
    yield op
    op.kill(signal.SIGTERM)


def test_engine_pods_without_their_volume_claim_are_named_with_the_cause_in_status_and_an_event(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess
) -> None:
    apply(devcluster, namespace, load_example("reference.yaml"))  # no `models` PVC in this namespace

    def degraded() -> dict[str, Any] | None:
        """Degraded naming the claim, once every engine pod's problem is in (the scheduler reports
        the pods one by one, and the status follows each)."""
        st = drs_status(devcluster, namespace, "reference")
        cond = condition(st, "Degraded")
        every = [e for r in st.get("replicaStatuses", []) for e in r["engines"]]
        reported = bool(every) and all("problem" in e for e in every)
        named = cond.get("reason") == "PodsNotRunning" and MISSING_PVC in cond.get("message", "")
        return st if named and reported else None

    status = wait_for("Degraded=PodsNotRunning naming the missing claim on every engine", degraded, timeout=120)
    assert status["phase"] == "Degraded"
    assert MISSING_PVC in condition(status, "Progressing")["message"]
    engines = [e for r in status["replicaStatuses"] for e in r["engines"]]
    assert {e["problem"] for e in engines} == {"Unschedulable"}
    assert all(e["name"] in e["message"] and MISSING_PVC in e["message"] for e in engines)
    assert status["readyReplicas"] == 0 and status["updatedReplicas"] == 0

    def events() -> list[dict[str, Any]]:
        items = get_json(devcluster, "events", "-n", namespace)["items"]
        return [e for e in items if e.get("reason") == "PodNotRunning"]

    named = wait_for("a PodNotRunning Event per engine pod", lambda: len(events()) >= len(engines) and events())
    assert all(e["type"] == "Warning" and MISSING_PVC in e["message"] for e in named)
    assert {e["name"] for e in engines} <= {m.split(":")[0].removeprefix("pod ") for m in (e["message"] for e in named)}
