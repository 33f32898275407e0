"""The operator's Kubernetes layer against the real control plane: watch caches (a restarted
operator lists before it reconciles and writes nothing; GPUs held by other pods come from the
field-selected pod watch) and the write throttle (429 answers from the apiserver's priority and
fairness are retried after the Retry-After they carry, within the in-flight bound, and the fleet
converges). Each test runs its own operator limited to its
namespace, so counts are its alone."""

from __future__ import annotations

import base64
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_devcluster.testing import RunningCluster
from operator_harness import OperatorProcess, apply, drs_status, engine_pods, pods, wait_for, wait_ready

pytestmark = pytest.mark.cluster


def fleet(name: str, replicas: int, width: int = 2, frontends: int = 2, **topology: Any) -> dict[str, Any]:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggReplicaSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "model": {"path": "/models/m"},
            "prefill": {"engines": 1, "tensorParallelSize": width},
            "decode": {"engines": 1, "tensorParallelSize": width},
            "frontend": {"workers": frontends, "basePort": 9500},
            "topology": {"gpusPerNode": 8, **topology},
        },
    }


def start(devcluster: RunningCluster, log: Path, namespace: str, **kw: Any) -> OperatorProcess:
    args = ("--namespace", namespace, "--lease-namespace", namespace, *kw.pop("extra", ()))
    op = OperatorProcess(devcluster, log, extra_args=args, **kw).start()
    wait_for("the operator to lead with its caches listed", op.leading, timeout=60)
    return op


def test_a_restarted_operator_lists_before_it_reconciles_and_a_converged_fleet_costs_it_no_write(
    devcluster: RunningCluster, namespace: str, crd: None, tmp_path: Path
) -> None:
    first = start(devcluster, tmp_path / "first.log", namespace)
    try:
        apply(devcluster, namespace, fleet("restart", 3))
        wait_ready(devcluster, namespace, "restart", 3)
        assert first.writes() > 0
    finally:
        first.kill(signal.SIGKILL)
    second = start(devcluster, tmp_path / "second.log", namespace, resync_s=1.0)
    try:
        reconciles = second.reconciles()
        wait_for("three reconciles", lambda: second.reconciles() >= reconciles + 3, timeout=60)
        # nothing recreated, nothing patched, no Event: every child was in its cache before the
        # first reconcile, and the placement came back from status
        assert second.writes() == 0, (tmp_path / "second.log").read_text()[-3000:]
        assert drs_status(devcluster, namespace, "restart")["readyReplicas"] == 3
    finally:
        second.kill(signal.SIGTERM)


def test_gpus_held_by_another_pod_keep_a_replica_off_that_node(
    devcluster: RunningCluster, namespace: str, crd: None, tmp_path: Path
) -> None:
    pool = f"pool-{namespace}"[:63]
    nodes = ["hgx-005", "hgx-006"]
    for node in nodes:
        devcluster.kubectl("label", "node", node, f"drs-test-pool={pool}")
    op = start(devcluster, tmp_path / "operator.log", namespace)
    try:
        squatter = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "squatter"},
            "spec": {
                "nodeName": nodes[0],
                "containers": [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "8"}}}],
            },
        }
        apply(devcluster, namespace, squatter)
        wait_for(
            "the squatter's watch event",
            lambda: op.total('drs_operator_watch_events_total{cache="GpuPod"}') > 0,
            timeout=30,
        )
        apply(devcluster, namespace, fleet("wide", 1, width=4, nodeSelector={"drs-test-pool": pool}))
        st = wait_ready(devcluster, namespace, "wide", 1)
        assert st["replicaStatuses"][0]["nodes"] == [nodes[1]]
        assert {p["spec"]["nodeName"] for p in engine_pods(devcluster, namespace).values()} == {nodes[1]}
    finally:
        op.kill(signal.SIGTERM)
        for node in nodes:
            devcluster.kubectl("label", "node", node, "drs-test-pool-")


# --------------------------------------------------------------------------- 429 from the apiserver
@pytest.fixture
def throttled_identity(devcluster: RunningCluster, namespace: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    """A ServiceAccount whose creates the apiserver's priority and fairness admits ~3 at a time
    and rejects the rest with 429 (a priority level of one share, no queue, no borrowing); the
    env of a process that acts as it."""
    sa, level = "drs-operator", f"drs-tight-{namespace}"[:60]
    devcluster.kubectl("create", "serviceaccount", sa, "-n", namespace)
    devcluster.kubectl(
        "create", "clusterrolebinding", level, "--clusterrole=cluster-admin", f"--serviceaccount={namespace}:{sa}"
    )
    objects = [
        {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "PriorityLevelConfiguration",
            "metadata": {"name": level},
            "spec": {
                "type": "Limited",
                "limited": {
                    "nominalConcurrencyShares": 1,
                    "lendablePercent": 0,
                    "borrowingLimitPercent": 0,
                    "limitResponse": {"type": "Reject"},
                },
            },
        },
        {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "FlowSchema",
            "metadata": {"name": level},
            "spec": {
                "priorityLevelConfiguration": {"name": level},
                "matchingPrecedence": 500,
                "distinguisherMethod": {"type": "ByUser"},
                "rules": [
                    {
                        "subjects": [
                            {"kind": "ServiceAccount", "serviceAccount": {"name": sa, "namespace": namespace}}
                        ],
                        "resourceRules": [
                            {
                                "verbs": ["create"],
                                "apiGroups": ["*"],
                                "resources": ["*"],
                                "namespaces": ["*"],
                                "clusterScope": True,
                            }
                        ],
                    }
                ],
            },
        },
    ]
    devcluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    token = devcluster.kubectl("create", "token", sa, "-n", namespace, "--duration=1h").stdout.strip()
    admin = yaml.safe_load(devcluster.kubeconfig.read_text())
    cluster = admin["clusters"][0]["cluster"]
    kubeconfig = tmp_path / "operator-sa.kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": sa, "user": {"token": token}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": sa}}],
                "current-context": "c",
            }
        )
    )
    assert base64.b64decode(cluster["certificate-authority-data"])  # TLS verified, as the admin's is
    try:
        yield {"KUBECONFIG": str(kubeconfig)}
    finally:
        for kind in ("flowschema", "prioritylevelconfiguration", "clusterrolebinding"):
            devcluster.kubectl("delete", kind, level, "--ignore-not-found", check=False)


#: The operator's in-flight limit in the 429 test: above the ~3 the priority level admits, so
#: the apiserver really rejects, and small enough that the bound is reached and measurable.
TIGHT_IN_FLIGHT = 6


def test_creates_the_apiserver_rejects_with_429_are_retried_after_retry_after_within_the_in_flight_bound(
    devcluster: RunningCluster, namespace: str, crd: None, tmp_path: Path, throttled_identity: dict[str, str]
) -> None:
    op = start(
        devcluster,
        tmp_path / "operator.log",
        namespace,
        env=throttled_identity,
        extra=("--max-in-flight", str(TIGHT_IN_FLIGHT)),
    )
    try:
        apply(devcluster, namespace, fleet("tight", 4, frontends=3))
        wait_ready(devcluster, namespace, "tight", 4, timeout=180)
        retried = op.total('drs_operator_api_retries_total{code="429"}')
        assert retried > 0, "the apiserver never answered 429: the priority level did not bind"
        # every 429 of priority and fairness carries Retry-After, and the retry waited what it asked
        # (the back-off would start at 0.2 s with jitter: a mean of 1 s or more is the header's)
        asked = op.total('drs_operator_api_retry_wait_seconds_count{source="retry-after"}')
        waited = op.total('drs_operator_api_retry_wait_seconds_sum{source="retry-after"}')
        assert asked == retried, "a 429 without Retry-After, or one whose Retry-After was not used"
        assert waited / asked >= 1.0, f"retries waited {waited / asked:.2f}s on average"
        peak = op.total("drs_operator_api_in_flight_peak")
        assert 2 <= peak <= TIGHT_IN_FLIGHT, f"in flight at once: {peak} (limit {TIGHT_IN_FLIGHT})"
        names = [p["metadata"]["name"] for p in pods(devcluster, namespace)]
        assert len(names) == len(set(names)) == 4 * 2 + 4 * 3 * 2  # each URL with its standby
    finally:
        op.kill(signal.SIGTERM)
