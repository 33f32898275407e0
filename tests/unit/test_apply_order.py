"""The reconcile's act step (reconcile._apply_all): writes of one pass go concurrently, in phases,
so a replica's frontends are written only after every one of its engine pods, and a failed engine
write stops the frontends of that pass. The applier here is a double that records each write's
start and end (the real one is exercised against the control plane in tests/cluster)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from drs_operator.reconcile import _apply_all
from drs_operator.rollout import compute_actions
from kubernetes_asyncio.client.exceptions import ApiException
from operator_fixtures import build, hgx, spec


class RecordingApplier:
    """Double of kube/apply.py Applier: each write takes a random few milliseconds."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.log: list[tuple[str, str, str, int | None]] = []  # (start|end, kind, name, replica)
        self.fail = fail or set()
        self.now = 0
        self.peak = 0

    async def _write(self, kind: str, name: str, labels: dict[str, str]) -> None:
        replica = int(labels["disagg.dev/replica"]) if "disagg.dev/replica" in labels else None
        self.log.append(("start", kind, name, replica))
        self.now += 1
        self.peak = max(self.peak, self.now)
        await asyncio.sleep(random.uniform(0, 0.004))
        self.now -= 1
        if name in self.fail:
            raise ApiException(status=422, reason="refused")
        self.log.append(("end", kind, name, replica))

    async def create(self, obj: dict[str, Any]) -> bool:
        await self._write(obj["kind"], obj["metadata"]["name"], obj["metadata"].get("labels") or {})
        return True

    async def replace(self, obj: dict[str, Any], live: dict[str, Any]) -> None:
        await self._write(obj["kind"], obj["metadata"]["name"], obj["metadata"].get("labels") or {})

    async def delete(self, kind: str, namespace: str, name: str, grace_seconds: int | None = None) -> None:
        await self._write(kind, name, {})


def creates_for(replicas: int) -> tuple[Any, ...]:
    """Every action of a first pass over a fresh fleet (all creates), one replica per node."""
    s = spec(replicas=replicas, frontend={"workers": 2, "basePort": 8300})
    p, _, desired = build(s, nodes=hgx(replicas))
    return compute_actions(desired, {}, set(), [r.index for r in p.replicas]).actions


async def test_engines_of_a_replica_are_written_before_its_frontends_and_writes_overlap() -> None:
    actions = creates_for(6)
    applier = RecordingApplier()
    await _apply_all(applier, "ns", actions)  # type: ignore[arg-type]
    ends = [e for e in applier.log if e[0] == "end"]
    assert len(ends) == len(actions)
    position = {(e[0], e[1], e[2]): i for i, e in enumerate(applier.log)}
    for r in range(6):
        pods_done = max(position[("end", "Pod", e[2])] for e in ends if e[1] == "Pod" and e[3] == r)
        fronts_start = min(position[("start", "Deployment", e[2])] for e in ends if e[1] == "Deployment" and e[3] == r)
        assert pods_done < fronts_start, f"replica {r}: a frontend was written before its engines"
    configs_done = max(position[("end", e[1], e[2])] for e in ends if e[1] in ("ConfigMap", "Service"))
    first_pod = min(position[("start", "Pod", e[2])] for e in ends if e[1] == "Pod")
    assert configs_done < first_pod
    assert applier.peak > 1, "writes of one phase were sent one after another"


async def test_a_refused_engine_write_stops_the_frontends_of_the_pass() -> None:
    actions = creates_for(2)
    victim = next(a.name for a in actions if a.kind == "Pod")
    applier = RecordingApplier(fail={victim})
    with pytest.raises(ApiException):
        await _apply_all(applier, "ns", actions)  # type: ignore[arg-type]
    assert not [e for e in applier.log if e[1] == "Deployment"]
    # the other engine pods of the phase still completed (no half-sent request is abandoned)
    assert {e[2] for e in applier.log if e[0] == "end" and e[1] == "Pod"} == {
        a.name for a in actions if a.kind == "Pod" and a.name != victim
    }
