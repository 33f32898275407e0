"""The operator killed mid-refit on a real node (issue 22: "kill the operator mid-refit").

Under Gym-shaped load from a client pod over the status URLs, the trainer's refit step as a pod
refits by checkpoint path, its sidecar loading one engine at a time. As soon as the sidecar has
stored the new desired weights on the resource, every operator pod is deleted (grace 0): the
operator's Deployment starts a new one, which knows nothing but what the cluster holds. The refit
goes on without it (the sidecar calls the engines), the trainer pod succeeds, and the new operator
shows the stored desired weights and every engine at their digest, observed from the engines.
Every turn stamped at or after the cut-over is answered at the refit's weights, none lost.

What would break it: desired weights the operator kept only in memory (the new operator would show
none: ``status.weights.desired`` is checked against the stored annotation), or an operator that
must be up for a refit to finish (the trainer pod would fail)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_devcluster.testing import RunningCluster

from bench import chaos_realnodes_sidecar as refit_pod

from .load import load_answers, off_policy, start_load
from .pods import OPERATOR_NS, logs, wait_phase
from .test_weights_on_real_node import EXAMPLE, NAME, TRAINER, checkpoint_fleet, drs, engines, wait

pytestmark = [pytest.mark.cluster, pytest.mark.realnode]

#: the client's load: long enough to span the kill, the rest of the refit and the new operator's start
LOAD_S = 75
STORE_S = 180.0


@pytest.fixture
def fleet(realcluster: RunningCluster, operator: str, realns: str, tmp_path: Path) -> Iterator[None]:
    yield from checkpoint_fleet(realcluster, realns, tmp_path, EXAMPLE)


def operator_pods(cluster: RunningCluster) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = json.loads(cluster.kubectl("get", "pods", "-n", OPERATOR_NS, "-o", "json").stdout)[
        "items"
    ]
    return items


def ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_an_operator_killed_mid_refit_comes_back_showing_the_stored_weights_every_engine_reached(
    realcluster: RunningCluster, fleet: None, realns: str
) -> None:
    start_load(realcluster, realns, "load-op-killed", LOAD_S)

    before = refit_pod.stored(realcluster, realns, NAME)
    old = {p["metadata"]["uid"] for p in operator_pods(realcluster)}
    assert old, "no operator pod to kill"
    trainer = refit_pod.trainer_pod("trainer", realns, NAME, TRAINER, sidecar_args=("--concurrency", "1"))
    realcluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(trainer))
    deadline = time.monotonic() + STORE_S
    while (desired := refit_pod.stored(realcluster, realns, NAME)) == before or desired is None:
        assert time.monotonic() < deadline, f"no new desired weights stored after {STORE_S:.0f}s"
    names = [p["metadata"]["name"] for p in operator_pods(realcluster)]
    realcluster.kubectl("delete", "pod", *names, "-n", OPERATOR_NS, "--grace-period=0", "--force")
    trainer_phase = json.loads(realcluster.kubectl("get", "pod", "trainer", "-n", realns, "-o", "json").stdout)
    # the kill came mid-refit: the trainer pod had not ended (its sidecar still loading engines)
    assert trainer_phase["status"].get("phase") not in ("Succeeded", "Failed"), trainer_phase["status"]

    phase = wait_phase(realcluster, realns, "trainer", {"Succeeded", "Failed"}, timeout=240)["status"]["phase"]
    assert phase == "Succeeded", logs(realcluster, realns, "trainer", "-c", "trainer")
    wait(
        "a new operator pod Ready",
        lambda: any(ready(p) and p["metadata"]["uid"] not in old for p in operator_pods(realcluster)),
    )

    def shown_at_desired() -> bool:
        st = drs(realcluster, realns).get("status") or {}
        shown = engines(st)
        return (
            ((st.get("weights") or {}).get("desired") or {}).get("digest") == desired.digest
            and len(shown) == 4
            and all(e.get("weightsDigest") == desired.digest and e.get("ready") for e in shown)
        )

    wait("the new operator showing the stored desired weights and every engine at their digest", shown_at_desired)
    conditions = {c["type"]: c["status"] for c in drs(realcluster, realns)["status"].get("conditions") or []}
    assert conditions.get("WeightsPending") != "True" and conditions.get("WeightsSplit") != "True", conditions

    load, answers = load_answers(realcluster, realns, "load-op-killed", LOAD_S)
    assert load["lost"] == 0 and load["turns"] > 0, load
    assert desired.effective_at is not None
    after = [a for a in answers if a[0] is not None and a[0] >= desired.effective_at]
    assert after and not off_policy(answers, desired.version, desired.effective_at), load
    print(
        f"operator killed mid-refit: {load['turns']} turns, {load['lost']} lost, "
        f"{len(after)} after the cut-over, 0 off-policy; every engine at {desired.version}"
    )
