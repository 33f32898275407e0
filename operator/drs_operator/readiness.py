"""What the live children say about serving: pure reads of Pod and Deployment manifests.

Two questions, kept apart because a roll makes them disagree:

* *serving* — the engine's pods (or the frontend's Deployment) answer now, at whatever spec hash:
  a replica whose pods all serve counts in ``readyReplicas`` even while a newer spec waits to roll
  onto it (it is serving traffic; reporting 0 would be a lie);
* *updated* — serving **and** carrying the desired spec hash: only when every replica is updated
  is the resource ``Ready`` (never Ready while a pod of the spec's generation is not ready).

``deployment_rolled_out`` (the Deployment controller has acted on the template it holds and a pod
of it is ready, whatever the hash) is what the roll-out (``drs_operator.rollout``) waits for.

``pod_problem`` says why a pod that should run does not, from what the scheduler and the kubelet
wrote: unschedulable (a missing PersistentVolumeClaim shows up here), an image that cannot be
pulled, a crash loop, a container that cannot be created.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final

from drs_operator.api.objects import ManifestView
from drs_operator.manifests.children import hash_of

#: Waiting reasons of a container that will not start without someone acting.
STUCK_WAITING: Final = frozenset(
    {
        "ImagePullBackOff",
        "ErrImagePull",
        "ErrImageNeverPull",
        "InvalidImageName",
        "CrashLoopBackOff",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
#: A message copied into status is cut to this length.
MESSAGE_MAX: Final = 300


@dataclasses.dataclass(frozen=True)
class Problem:
    """Why a pod does not run: a kubelet/scheduler reason and its message."""

    pod: str
    reason: str
    message: str

    def text(self) -> str:
        return f"pod {self.pod}: {self.reason}: {self.message}" if self.message else f"pod {self.pod}: {self.reason}"


def pod_ready(pod: ManifestView) -> bool:
    """The pod's Ready condition is True and it is not being deleted."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def engine_serving(pod_names: Sequence[str], pods: Mapping[str, ManifestView]) -> bool:
    """Every pod of the engine exists and is ready (at any spec hash)."""
    return bool(pod_names) and all(n in pods and pod_ready(pods[n]) for n in pod_names)


def engine_updated(want: Mapping[str, ManifestView], pods: Mapping[str, ManifestView]) -> bool:
    """Every pod of the engine exists, carries the desired hash and is ready."""
    return bool(want) and all(
        n in pods and hash_of(pods[n]) == hash_of(p) and pod_ready(pods[n]) for n, p in want.items()
    )


def deployment_serving(dep: ManifestView | None) -> bool:
    """At least one pod of the Deployment is ready (whatever its template)."""
    return dep is not None and int((dep.get("status") or {}).get("readyReplicas") or 0) >= 1


def deployment_updated(dep: ManifestView | None, want: ManifestView | None) -> bool:
    """The Deployment has the desired hash and has rolled out (:func:`deployment_rolled_out`)."""
    if dep is None or want is None or hash_of(dep) != hash_of(want):
        return False
    return deployment_rolled_out(dep)


def deployment_rolled_out(dep: ManifestView) -> bool:
    """The controller has seen the Deployment's template and a pod of it is ready (whatever the hash)."""
    status = dep.get("status") or {}
    generation = (dep.get("metadata") or {}).get("generation", 0)
    return bool(
        status.get("observedGeneration", 0) >= generation
        and status.get("readyReplicas", 0) >= 1
        and status.get("updatedReplicas", 0) >= 1
    )


def pod_problem(pod: ManifestView) -> Problem | None:
    """Why this pod does not run, when the scheduler or the kubelet said so; else None."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return None
    name = str(meta.get("name", ""))
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return Problem(name, str(cond.get("reason") or "Unschedulable"), _cut(cond.get("message")))
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason in STUCK_WAITING:
            message = _cut(waiting.get("message"))
            last = ((cs.get("lastState") or {}).get("terminated")) or {}
            if reason == "CrashLoopBackOff" and last:
                exit_note = f"last exit {last.get('exitCode')} ({last.get('reason') or 'Error'})"
                message = f"{message}; {exit_note}" if message else exit_note
            return Problem(name, str(reason), message)
    if status.get("phase") == "Failed":
        return Problem(name, str(status.get("reason") or "Failed"), _cut(status.get("message")))
    return None


def _cut(message: Any) -> str:
    text = str(message or "").strip()
    return text if len(text) <= MESSAGE_MAX else text[: MESSAGE_MAX - 1] + "…"
