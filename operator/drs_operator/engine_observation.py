"""What each engine holds, as the operator observed it (pure: the targets to ask, and the merge).

The operator asks every serving engine ``GET /control/weights`` itself (``kube/engines.py`` makes
the calls) and status shows what the engines answered: ``weightsVersion`` / ``weightsDigest`` per
engine, and from them ``WeightsSplit`` and ``WeightsPending``. The sidecar's
``disagg.dev/engine-weights`` annotation is not read: it is what engines answered the sidecar
when it last ran, and status must stay true when no sidecar runs.

* **targets** (:func:`observation_targets`): the engines of placed replicas whose rank-0 pod is
  Ready (for an engine wider than a node, the leader is Ready only while the whole gang serves)
  and has a pod IP, at ``http://<podIP>:<engine port>``. On the host network the pod IP is the
  node's address, so this is the address in ``status`` either way, and it needs no cluster DNS
  (an operator run outside the cluster reaches host-network engines, as in the dev cluster).
* **catching up** (``catching_up=True``, while the fleet has desired weights): engines whose pod
  has an IP but is not Ready are asked too, only to read why (an engine that does not hold the
  desired weights it started under is up and not ready; its answer's ``catch_up`` says what it
  tries and what failed, :func:`catch_up_reasons`). What such an engine holds is never merged
  into status: it serves nothing.
* **merge** (:func:`held_weights`): an engine that answered holds what it answered; one that was
  not asked (not serving) or did not answer (refused, timed out, outside the pass's budget, an
  answer that breaks the contract) is *unknown*: it holds nothing as far as status says, so
  ``WeightsPending`` counts it and ``WeightsSplit`` leaves it out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from drs_protocol.weights_state import HeldWeights

from drs_operator.api import names
from drs_operator.api.objects import Manifest
from drs_operator.api.status import ReplicaStatus
from drs_operator.plan import Plan
from drs_operator.readiness import pod_ready


@dataclasses.dataclass(frozen=True)
class Target:
    """One engine to ask, at its control API's base URL."""

    engine: str
    url: str
    #: its pod is Ready (False: asked only for its catch-up's reason)
    serving: bool = True


@dataclasses.dataclass(frozen=True)
class Observation:
    """What one engine answered: ``held`` (None: no usable answer) and, then, why not;
    ``catch_up``: why it is not at the desired weights it started under yet (None: it is, or it
    did not say)."""

    engine: str
    held: HeldWeights | None
    detail: str = ""
    serving: bool = True
    catch_up: str | None = None


def observation_targets(
    plan: Plan, replicas: Sequence[ReplicaStatus], pods: Mapping[str, Manifest], *, catching_up: bool = False
) -> list[Target]:
    """The serving engines of placed replicas (rank-0 pod Ready, with a pod IP), in status order;
    with ``catching_up`` also those not Ready (``serving`` False)."""
    ports = {e.name: e.port for e in plan.engines}
    targets: list[Target] = []
    for r in replicas:
        if not r.placed:
            continue
        for e in r.engines:
            pod = pods.get(e.name)
            ip = str(((pod or {}).get("status") or {}).get("podIP") or "")
            if pod is None or not ip or e.name not in ports:
                continue
            ready = pod_ready(pod)
            if ready or catching_up:
                targets.append(Target(e.name, names.url(ip, ports[e.name]), serving=ready))
    return targets


def held_weights(observations: Iterable[Observation]) -> dict[str, HeldWeights]:
    """Engine name -> what a serving engine answered it holds; engines without an answer, or not
    serving, are left out (unknown)."""
    return {o.engine: o.held for o in observations if o.held is not None and o.serving}


def catch_up_reasons(observations: Iterable[Observation]) -> dict[str, str]:
    """Engine name -> why it is not at its desired weights yet, for the engines that said so."""
    return {o.engine: o.catch_up for o in observations if o.catch_up}
