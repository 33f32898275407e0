"""Nothing lost, on the real control plane with the pod runner: a short chaos run (``bench/chaos.py``)
loses no turn, and the status sampled through a roll agrees with the pods.

The fleet is ``make demo``'s (2 replicas x 1 prefill + 1 decode, 2 frontends each, sim engines,
host networking); Gym-shaped clients hash sessions over ``status.urls`` and retry 5xx a few times.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from drs_devcluster.testing import RunningCluster, namespace_for

from bench.chaos import NAME, Fleet, deployed, run_scenarios

pytestmark = pytest.mark.cluster

#: A status may lag the pods by one reconcile; a disagreement must not outlive this.
STATUS_LAG_S = 3.0
SAMPLE_S = 0.25


@pytest.fixture(scope="module")
def chaos_fleet(devcluster: RunningCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    namespace = namespace_for("chaos-fleet")
    devcluster.kubectl("create", "namespace", namespace)
    try:
        with deployed(devcluster, namespace, tmp_path_factory.mktemp("chaos")) as fleet:
            yield fleet
    finally:
        devcluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_a_short_chaos_run_loses_no_turn(chaos_fleet: Fleet) -> None:
    results = run_scenarios(chaos_fleet, ("roll", "decode_killed", "prefill_killed"), clients=4, settle_s=2.0)
    for name, r in results.items():
        assert r["turns"] > 0, name
        assert r["failed"] == 0, (name, r)


def _serving_replicas(pods: list[dict[str, Any]]) -> set[int]:
    """Replicas whose every pod (engines and frontends) is Ready and not terminating."""
    by_replica: dict[int, list[bool]] = {}
    for p in pods:
        labels = p["metadata"].get("labels") or {}
        replica = int(labels.get("disagg.dev/replica", -1))
        ready = not p["metadata"].get("deletionTimestamp") and any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (p.get("status") or {}).get("conditions") or []
        )
        by_replica.setdefault(replica, []).append(ready)
    # a full replica: its 2 engine pods and 2 frontend pods
    return {r for r, states in by_replica.items() if len(states) >= 4 and all(states)}


def test_the_status_sampled_through_a_roll_agrees_with_the_pods(chaos_fleet: Fleet) -> None:
    violations: list[tuple[float, str]] = []
    lasting: dict[str, float] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            body = chaos_fleet.body()
            pods = chaos_fleet.pods(f"disagg.dev/replicaset={NAME}")
            now = time.monotonic()
            st = body.get("status") or {}
            serving = _serving_replicas(pods)
            at_generation = st.get("observedGeneration") == body["metadata"]["generation"]
            problems: dict[str, str] = {}
            if at_generation and st.get("phase") == "Ready" and serving != {0, 1}:
                problems["ready"] = f"phase Ready while only replicas {sorted(serving)} serve"
            if st.get("readyReplicas", 0) == 0 and serving:
                problems["zero"] = f"readyReplicas 0 while replicas {sorted(serving)} serve"
            if st.get("readyReplicas", 0) > len(serving):
                problems["over"] = f"readyReplicas {st.get('readyReplicas')} but {len(serving)} replica(s) serve"
            for kind in ("ready", "zero", "over"):
                if kind not in problems:
                    lasting.pop(kind, None)
                    continue
                first = lasting.setdefault(kind, now)
                if now - first > STATUS_LAG_S:
                    violations.append((round(now - first, 1), problems[kind]))
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        chaos_fleet.roll()
        chaos_fleet.wait_ready()
    finally:
        done.set()
        sampler.join(30)
    assert not violations, violations[:5]
