"""New desired weights touch every engine pod (``drs_operator.weights_touch``), on the local control
plane with the real operator: no pod is touched before a refit; once the DisaggReplicaSet's
``disagg.dev/desired-weights`` annotation changes, each engine pod carries the touch annotation
naming the new desired weights (one patch per pod, the same pods: nothing recreated), further
reconciles patch nothing, and the next desired weights touch each pod once more. A patch of a pod
that is gone is logged, not raised (a real Applier against the same apiserver)."""

from __future__ import annotations

import asyncio
import json

import pytest
from drs_devcluster.testing import RunningCluster
from drs_operator.api.constants import ANNOTATION_DESIRED_WEIGHTS, ANNOTATION_DESIRED_WEIGHTS_TOUCH
from drs_operator.kube.apply import Applier
from drs_operator.metrics import OperatorMetrics
from drs_operator.weights_touch import touch_pods, touch_value
from drs_protocol.weights_digest import digest_bytes
from drs_protocol.weights_state import DesiredWeights
from kubernetes_asyncio import config
from operator_harness import OperatorProcess, apply, engine_pods, wait_for, wait_ready
from test_operator import small

pytestmark = pytest.mark.cluster

NAME = "touch"


def _pod_patches(op: OperatorProcess) -> float:
    """The operator's pod patches so far (``drs_operator_api_writes_total``, verb patch, kind Pod)."""
    return sum(
        v
        for k, v in (op.metrics() or {}).items()
        if k.startswith("drs_operator_api_writes_total{") and 'verb="patch"' in k and 'kind="Pod"' in k
    )


def _store(cluster: RunningCluster, namespace: str, desired: DesiredWeights) -> None:
    cluster.kubectl(
        "annotate", "drs", "-n", namespace, NAME, f"{ANNOTATION_DESIRED_WEIGHTS}={desired.dump()}", "--overwrite"
    )


def _touched(cluster: RunningCluster, namespace: str) -> dict[str, str | None]:
    return {
        n: (p["metadata"].get("annotations") or {}).get(ANNOTATION_DESIRED_WEIGHTS_TOUCH)
        for n, p in engine_pods(cluster, namespace).items()
    }


def test_new_desired_weights_touch_every_engine_pod_once_and_a_reconcile_again_patches_nothing(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess
) -> None:
    apply(devcluster, namespace, small(NAME))
    wait_ready(devcluster, namespace, NAME, 2)
    before = engine_pods(devcluster, namespace)
    assert len(before) == 4
    assert set(_touched(devcluster, namespace).values()) == {None}, "a fleet that never had a refit: untouched"
    patches = _pod_patches(operator)

    for step in (1, 2):
        desired = DesiredWeights(
            version=f"step-{step}", path=f"/ckpt/{step}", digest=digest_bytes(b"%d" % step), effective_at=1e9 + step
        )
        value = touch_value(desired)
        _store(devcluster, namespace, desired)
        wait_for(
            f"every engine pod touched for step {step}",
            lambda v=value: set(_touched(devcluster, namespace).values()) == {v},  # type: ignore[misc]
            timeout=30,
        )
        assert _pod_patches(operator) == patches + 4 * step, "one patch per engine pod"
        uids = {n: p["metadata"]["uid"] for n, p in engine_pods(devcluster, namespace).items()}
        assert uids == {n: p["metadata"]["uid"] for n, p in before.items()}, "no pod recreated"
        seen = operator.reconciles()
        wait_for("three more reconciles", lambda s=seen: operator.reconciles() >= s + 3, timeout=60)  # type: ignore[misc]
        assert _pod_patches(operator) == patches + 4 * step, "a reconcile again patches nothing"


def test_a_touch_of_a_pod_that_is_gone_is_logged_not_raised(devcluster: RunningCluster, namespace: str) -> None:
    async def run() -> int:
        api = await config.new_client_from_config(config_file=str(devcluster.kubeconfig))
        async with api:
            return await touch_pods(Applier(api, OperatorMetrics.create()), namespace, {"no-such-pod": "0" * 16})

    assert asyncio.run(run()) == 0
    assert json.loads(devcluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"] == []
