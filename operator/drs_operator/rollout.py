"""``compute_actions``: what to create, replace and delete to move the live children to the desired ones.

Pure: desired children (with spec hashes), live children and the set of lost nodes in; a list of
:class:`Action` and a description of the roll out. Rules:

* Shared objects (role ConfigMaps, the headless Service, the control Secret) are created when
  missing and replaced when their hash differs (the Secret never: its token is not ours to rotate).
* A missing engine pod is created at once: that restores availability, it is not a roll. A pod
  that failed for good (phase Failed or Succeeded) is deleted with grace 0 first. This is how a
  deleted or failed engine pod comes back, with the same name, on the same placed node.
* Engine pods whose hash differs are *outdated*. Pods are immutable, so rolling one means deleting
  it (the next pass creates the new one). Replicas roll one at a time, lowest index first: a
  replica may roll when it is already unavailable, or when every other replica is available. So
  at most one replica is ever unavailable because of a roll.
* An outdated pod on a lost node (NotReady or gone) is deleted at once with grace 0: nothing will
  ever confirm a graceful stop there, and its replica is already unavailable.
* A replica's frontends (ConfigMap, Deployment) follow its engines: they are updated only once
  every engine pod of the replica is current and ready ("engines before their frontends").
  Missing frontends and Services are created at once. With a standby (``spec.frontend.standby``)
  the two Deployments of one URL are replaced one after the other, so the URL keeps a process:
  process 0 once its standby serves (or the standby is itself outdated and down, so there is
  nothing to wait for), the standby once process 0 is updated (or the standby is down anyway).
* A replica's NetworkPolicy (``spec.networkPolicy.enabled``) is created and replaced at once.
* Children nobody desires any more (replicas scaled away, pods of a replica that can no longer
  be placed) are deleted.
* Nothing else is written: equal hashes mean no action, so a converged fleet yields none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from enum import StrEnum
from typing import Any, Literal

from drs_operator.api.constants import HASHED_CHILD_KINDS, LABEL_FRONTEND, LABEL_FRONTEND_PROCESS, LABEL_REPLICA
from drs_operator.api.objects import Manifest
from drs_operator.manifests.children import Children, ReplicaChildren, hash_of
from drs_operator.readiness import deployment_rolled_out, deployment_serving, deployment_updated, pod_ready

Verb = Literal["create", "replace", "delete"]


class ActionReason(StrEnum):
    """Why an action is taken (the reconcile turns some into Events)."""

    MISSING = "missing"
    OUTDATED = "outdated"
    FAILED = "failed"  #: a pod that will never run again
    NODE_LOST = "node lost"
    NOT_DESIRED = "not desired"


@dataclasses.dataclass(frozen=True)
class Action:
    verb: Verb
    kind: str
    name: str
    manifest: Manifest | None = None  #: the desired object (create, replace)
    live: Manifest | None = None  #: the live object (replace, delete)
    grace_seconds: int | None = None  #: delete only
    replica: int | None = None
    reason: ActionReason | None = None


@dataclasses.dataclass(frozen=True)
class Rollout:
    actions: tuple[Action, ...]
    rolling: tuple[int, ...]  #: replicas whose engine pods are being replaced in this pass
    waiting: tuple[int, ...]  #: replicas with outdated engines waiting for their turn
    message: str  #: for the Progressing condition ("" when nothing is in flight)


def _current(live: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    return live is not None and hash_of(live) == hash_of(desired)


def _finished(pod: Mapping[str, Any]) -> bool:
    """A pod that will never run again (Failed, e.g. evicted, or Succeeded): replace it."""
    return (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded")


def _node_of(pod: Mapping[str, Any]) -> str | None:
    spec = pod.get("spec") or {}
    node: str | None = spec.get("nodeName")
    return node


def replica_engines_ready(rc: ReplicaChildren, pods: Mapping[str, Manifest]) -> bool:
    """Every engine pod of the replica exists, is current and is ready."""
    return all(
        _current(pods.get(p["metadata"]["name"]), p) and pod_ready(pods[p["metadata"]["name"]]) for p in rc.engine_pods
    )


def replica_available(rc: ReplicaChildren, live: Mapping[str, Mapping[str, Manifest]]) -> bool:
    """Engines ready (current or not) and every frontend Deployment ready."""
    pods, deps = live.get("Pod", {}), live.get("Deployment", {})
    engines_up = all(p["metadata"]["name"] in pods and pod_ready(pods[p["metadata"]["name"]]) for p in rc.engine_pods)
    fronts_up = all(
        d["metadata"]["name"] in deps and deployment_rolled_out(deps[d["metadata"]["name"]])
        for d in rc.frontend_deployments
    )
    return engines_up and fronts_up


def compute_actions(
    desired: Children,
    live: Mapping[str, Mapping[str, Manifest]],
    lost_nodes: Collection[str],
    placed_replicas: Collection[int],
) -> Rollout:
    """See the module docstring. ``placed_replicas`` are the replica indices the plan wants running
    (placed or not): an index in it without desired children is unplaced, and counts as unavailable."""
    actions: list[Action] = []
    for obj in (*desired.configmaps, *desired.services):
        actions += _sync(live, obj["kind"], obj)
    available = {rc.index: replica_available(rc, live) for rc in desired.replicas}
    down = {r for r in placed_replicas if not available.get(r, False)}
    rolling: list[int] = []
    waiting: list[int] = []
    for rc in desired.replicas:
        actions += _policy_actions(rc, live)
        engine_actions, outdated = _engine_pod_actions(rc, live.get("Pod", {}), lost_nodes)
        actions += engine_actions
        if outdated:
            if rc.index in down or not (down - {rc.index}):  # at most one replica unavailable at a time
                down.add(rc.index)
                rolling.append(rc.index)
                actions += [
                    Action(
                        "delete", "Pod", p["metadata"]["name"], live=p, replica=rc.index, reason=ActionReason.OUTDATED
                    )
                    for p in outdated
                    if not (p.get("metadata") or {}).get("deletionTimestamp")
                ]
            else:
                waiting.append(rc.index)
        actions += _frontend_actions(
            rc, live, engines_done=not outdated and replica_engines_ready(rc, live.get("Pod", {}))
        )
    actions += _undesired(desired, live, lost_nodes)
    return Rollout(tuple(actions), tuple(rolling), tuple(waiting), _message(rolling, waiting, down))


def _sync(
    live: Mapping[str, Mapping[str, Manifest]],
    kind: str,
    obj: Manifest,
    replica: int | None = None,
    replace_ok: bool = True,
) -> list[Action]:
    """Create ``obj`` when missing; replace it when its spec hash differs (and ``replace_ok``)."""
    name = obj["metadata"]["name"]
    current = live.get(kind, {}).get(name)
    if current is None:
        return [Action("create", kind, name, manifest=obj, replica=replica, reason=ActionReason.MISSING)]
    if replace_ok and hash_of(current) != hash_of(obj):
        return [
            Action("replace", kind, name, manifest=obj, live=current, replica=replica, reason=ActionReason.OUTDATED)
        ]
    return []


def _engine_pod_actions(
    rc: ReplicaChildren, pods: Mapping[str, Manifest], lost_nodes: Collection[str]
) -> tuple[list[Action], list[Manifest]]:
    """A replica's engine pods: creates of missing ones, deletes of failed ones and of outdated ones
    on lost nodes; and the outdated pods that need a roll-out slot."""
    actions: list[Action] = []
    outdated: list[Manifest] = []
    for want in rc.engine_pods:
        name = want["metadata"]["name"]
        have = pods.get(name)
        if have is None:
            actions.append(Action("create", "Pod", name, manifest=want, replica=rc.index, reason=ActionReason.MISSING))
        elif _finished(have):
            if not (have.get("metadata") or {}).get("deletionTimestamp"):
                actions.append(
                    Action(
                        "delete", "Pod", name, live=have, grace_seconds=0, replica=rc.index, reason=ActionReason.FAILED
                    )
                )
        elif not _current(have, want):
            if _node_of(have) in lost_nodes:
                actions.append(
                    Action(
                        "delete",
                        "Pod",
                        name,
                        live=have,
                        grace_seconds=0,
                        replica=rc.index,
                        reason=ActionReason.NODE_LOST,
                    )
                )
            else:
                outdated.append(have)
    return actions, outdated


def _frontend_actions(
    rc: ReplicaChildren, live: Mapping[str, Mapping[str, Manifest]], *, engines_done: bool
) -> list[Action]:
    """A replica's frontend config and Deployments change only once its engines are current and
    ready (a frontend never points at engines still rolling); its Services at any time."""
    actions = _sync(live, "ConfigMap", rc.frontend_config, rc.index, replace_ok=engines_done)
    deps = live.get("Deployment", {})
    by_url: dict[str, dict[str, Manifest]] = {}
    for dep in rc.frontend_deployments:
        labels = dep["metadata"].get("labels") or {}
        by_url.setdefault(labels.get(LABEL_FRONTEND, ""), {})[labels.get(LABEL_FRONTEND_PROCESS, "0")] = dep
    for processes in by_url.values():
        primary, standby = processes.get("0"), processes.get("1")
        for dep in processes.values():
            turn = True
            if primary is not None and standby is not None:
                p_live, s_live = deps.get(primary["metadata"]["name"]), deps.get(standby["metadata"]["name"])
                if dep is primary:
                    turn = deployment_serving(s_live) or not _current(s_live, standby) or not deployment_serving(p_live)
                else:
                    turn = deployment_updated(p_live, primary) or not deployment_serving(s_live)
            actions += _sync(live, "Deployment", dep, rc.index, replace_ok=engines_done and turn)
    for svc in rc.frontend_services:
        actions += _sync(live, "Service", svc, rc.index)
    return actions


def _policy_actions(rc: ReplicaChildren, live: Mapping[str, Mapping[str, Manifest]]) -> list[Action]:
    """A replica's NetworkPolicy: created and replaced at any time (it only names the replica's pods)."""
    return _sync(live, "NetworkPolicy", rc.network_policy, rc.index) if rc.network_policy is not None else []


def _undesired(
    desired: Children, live: Mapping[str, Mapping[str, Manifest]], lost_nodes: Collection[str]
) -> list[Action]:
    """Deletes of live children no longer desired (pods on lost nodes without grace)."""
    actions: list[Action] = []
    for kind in HASHED_CHILD_KINDS:
        names = desired.all_of(kind)
        for name, obj in sorted(live.get(kind, {}).items()):
            if name in names or (obj.get("metadata") or {}).get("deletionTimestamp"):
                continue
            replica = (obj.get("metadata") or {}).get("labels", {}).get(LABEL_REPLICA)
            grace = 0 if kind == "Pod" and _node_of(obj) in lost_nodes else None
            actions.append(
                Action(
                    "delete",
                    kind,
                    name,
                    live=obj,
                    grace_seconds=grace,
                    replica=int(replica) if replica else None,
                    reason=ActionReason.NOT_DESIRED,
                )
            )
    return actions


def _message(rolling: list[int], waiting: list[int], down: set[int]) -> str:
    parts = []
    if rolling:
        parts.append(f"rolling replica {', '.join(map(str, rolling))}: replacing outdated engine pods")
    if waiting:
        blockers = sorted(down - set(waiting))
        parts.append(
            f"replica {', '.join(map(str, waiting))} waiting to roll until replica "
            f"{', '.join(map(str, blockers))} is available"
        )
    return "; ".join(parts)
