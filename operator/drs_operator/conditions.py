"""``compute_status``: the status a reconcile writes, and the Events its transitions deserve.

Pure: the previous status, what was decided (validation problems, plan, placement, roll out) and
what is live in; the new status and a list of :class:`EventNote` out. Conditions follow the
``metav1.Condition`` rules: ``lastTransitionTime`` moves only when a condition's status flips,
and an Event is emitted on a flip (or a changed reason), never as storage.

Readiness (:mod:`drs_operator.readiness`): an engine is *ready* (serving) when all its pods exist
and are Ready, and *updated* when they also carry the desired spec hash; a frontend is ready when
its Deployment (or, with a standby, either of its two) has a ready pod, updated when every one of
them runs the desired template with a ready pod; a replica is ready
/ updated when it is placed and all its engines and frontends are. ``readyReplicas`` counts serving
replicas (a replica waiting for its turn to roll still serves), ``updatedReplicas`` the updated
ones, and ``Ready`` is True only when every replica is updated: never Ready while a pod of the
spec's generation is not ready, never 0 while a replica serves.

``Degraded``, most urgent first: a replica moved off a lost node; a replica not placed; an engine
or frontend pod that cannot run (``PodsNotRunning``: unschedulable, image pull, crash loop — the
message names the pod and the cause, and a Warning Event fires when a pod's cause changes); engines on different
weights (``WeightsSplit``, from what the operator observed the engines hold,
:mod:`drs_operator.engine_observation`); replicas not ready with nothing in flight.

``WeightsPending`` (only once the fleet has desired weights, ``status.weights.desired``): True
while an engine of a placed replica does not report them (:mod:`drs_operator.weights_pending`),
with a Warning Event on the flip; separate from ``Ready``, which stays about serving capacity.

An engine wider than a node lists its ranks, each ``joined`` when its pod is Ready (a rank's
readiness is its membership of the leader's Ray cluster, the leader's is the whole gang serving);
it serves only when all are. When it stops serving a ``GangRestarting`` Warning names the ranks
missing, and ``GangReady`` follows when it is whole again.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence

from drs_protocol.cutover import MAX_STAMP, MIN_STAMP
from drs_protocol.limits import MAX_WEIGHTS_VERSION_CHARS
from drs_protocol.weights_state import DesiredWeights, HeldWeights

from drs_operator.api import names
from drs_operator.api.constants import (
    FRONTEND_PODS,
    LABEL_FRONTEND,
    LABEL_REPLICA,
    ConditionStatus,
    ConditionType,
    Phase,
    Reason,
)
from drs_operator.api.objects import Manifest
from drs_operator.api.status import (
    Condition,
    DesiredWeightsStatus,
    DisaggReplicaSetStatus,
    EngineStatus,
    RankStatus,
    ReplicaStatus,
    TokenRotationStatus,
    WeightsStatus,
)
from drs_operator.manifests.children import Children
from drs_operator.policy_peers import PeerReport, condition_message
from drs_operator.readiness import Problem as PodProblem
from drs_operator.readiness import (
    deployment_serving,
    deployment_updated,
    engine_serving,
    engine_updated,
    pod_problem,
)
from drs_operator.rollout import Rollout
from drs_operator.status_events import EventNote, gang_notes, problem_notes, transitions
from drs_operator.status_write import status_dict as status_dict  # its callers import it from here
from drs_operator.validation import Problem
from drs_operator.weights_pending import pending_engines, pending_message


@dataclasses.dataclass(frozen=True)
class Observed:
    """What the reconcile decided and saw, for the status."""

    generation: int
    problems: Sequence[Problem] = ()
    replica_statuses: Sequence[ReplicaStatus] = ()  #: from layout.replica_statuses (placement)
    urls: Sequence[str | None] = ()
    replica_width: int | None = None
    gpus: int = 0
    desired: Children | None = None
    live: Mapping[str, Mapping[str, Manifest]] = dataclasses.field(default_factory=dict)
    rollout: Rollout | None = None
    moved: Sequence[int] = ()  #: replicas moved off lost nodes in this pass
    #: the ``disagg.dev/weights-version`` annotation (the trainer sidecar's last completed refit)
    weights_version: str | None = None
    #: engine name -> what it answered the operator it holds (``engine_observation.held_weights``;
    #: an engine missing here is unknown)
    engine_weights: Mapping[str, HeldWeights] = dataclasses.field(default_factory=dict)
    #: the ``disagg.dev/desired-weights`` annotation, parsed: the weights the fleet must hold
    desired_weights: DesiredWeights | None = None
    #: engine name -> why it is not at the desired weights it started under yet, as it said
    #: (``engine_observation.catch_up_reasons``; named in ``WeightsPending``)
    engine_catch_up: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: whether each ``spec.networkPolicy.engineClients`` peer selects a pod (None: not checked,
    #: no ``PolicyPeersMatch`` condition)
    policy_peers: PeerReport | None = None
    #: the token Secrets whose rotation is under way (``manifests.rotation.rotation_status``)
    token_rotations: Sequence[TokenRotationStatus] = ()
    #: ``spec.frontend_standby`` and ``spec.network.hostNetwork`` (None: no ``FrontendStandby`` condition)
    frontend_standby: bool | None = None
    host_network: bool = False


def _cond(
    previous: Sequence[Condition],
    type_: ConditionType,
    status: bool,
    reason: Reason,
    message: str,
    generation: int,
    now: datetime.datetime,
) -> Condition:
    st = ConditionStatus.TRUE if status else ConditionStatus.FALSE
    old = next((c for c in previous if c.type == type_), None)
    when = old.last_transition_time if old is not None and old.status == st else now
    return Condition(
        type=str(type_),
        status=st,
        reason=str(reason),
        message=message,
        last_transition_time=when,
        observed_generation=generation,
    )


def _replica_readiness(drs: str, observed: Observed) -> list[ReplicaStatus]:
    """Each replica's engines and frontends with ``ready`` (serving), ``updated`` (serving the
    current spec), the engine's weights version and why a pod of it cannot run."""
    pods = observed.live.get("Pod", {})
    deps = observed.live.get("Deployment", {})
    frontend_pods = observed.live.get(FRONTEND_PODS, {})
    desired_pods = observed.desired.all_of("Pod") if observed.desired else {}
    desired_deps = observed.desired.all_of("Deployment") if observed.desired else {}
    # an engine's pods: its name (rank 0) and "<name>-w<rank>"; grouped once, not per engine
    engine_names = {e.name for rs in observed.replica_statuses for e in rs.engines}
    pods_of: dict[str, dict[str, Manifest]] = {}
    for pod_name, manifest in desired_pods.items():
        engine = pod_name if pod_name in engine_names else pod_name.rsplit("-w", 1)[0]
        if engine in engine_names:
            pods_of.setdefault(engine, {})[pod_name] = manifest
    replicas: list[ReplicaStatus] = []
    for rs in observed.replica_statuses:
        engines = []
        for e in rs.engines:
            want = pods_of.get(e.name, {})
            problem = next((p for n in sorted(want) if n in pods and (p := pod_problem(pods[n]))), None)
            engines.append(
                e.model_copy(
                    update={
                        "ready": rs.placed and engine_serving(list(want), pods),
                        "updated": rs.placed and engine_updated(want, pods),
                        "weights_version": held.version if (held := observed.engine_weights.get(e.name)) else None,
                        "weights_digest": held.digest if held else None,
                        "problem": problem.reason if problem else None,
                        "message": problem.text()[:1024] if problem else None,
                        "ranks": _ranks(e, rs.placed, pods),
                    }
                )
            )
        frontends = []
        for f in rs.frontends:
            dep_names = [names.frontend_deployment_name(drs, rs.index, f.index, p) for p in (0, 1)]
            wanted = [n for n in dep_names if n in desired_deps]
            serving = {n: n in desired_deps and deployment_serving(deps.get(n)) for n in dep_names}
            problem = _frontend_problem(frontend_pods, rs.index, f.index) if rs.placed else None
            frontends.append(
                f.model_copy(
                    update={
                        "ready": rs.placed and any(serving.values()),
                        "updated": rs.placed
                        and bool(wanted)
                        and all(deployment_updated(deps.get(n), desired_deps.get(n)) for n in wanted),
                        "standby_ready": (rs.placed and serving[dep_names[1]]) if dep_names[1] in wanted else None,
                        "problem": problem.reason if problem else None,
                        "message": problem.text()[:1024] if problem else None,
                    }
                )
            )
        ready = all(e.ready for e in engines) and all(f.ready for f in frontends)
        updated = all(e.updated for e in engines) and all(f.updated for f in frontends)
        replicas.append(
            rs.model_copy(
                update={
                    "engines": engines,
                    "frontends": frontends,
                    "ready": rs.placed and ready,
                    "updated": rs.placed and updated,
                }
            )
        )
    return replicas


def _frontend_problem(pods: Mapping[str, Manifest], replica: int, index: int) -> PodProblem | None:
    """Why a pod of frontend ``index`` of ``replica`` (either process) does not run, the first by
    pod name; else None."""
    for name in sorted(pods):
        labels = (pods[name].get("metadata") or {}).get("labels") or {}
        if labels.get(LABEL_REPLICA) == str(replica) and labels.get(LABEL_FRONTEND) == str(index):
            problem = pod_problem(pods[name])
            if problem is not None:
                return problem
    return None


def _ranks(e: EngineStatus, placed: bool, pods: Mapping[str, Manifest]) -> list[RankStatus] | None:
    """An engine wider than a node: each rank ``joined`` when its pod is Ready."""
    if not e.ranks:
        return e.ranks
    return [r.model_copy(update={"joined": placed and engine_serving([r.pod], pods)}) for r in e.ranks]


def _weights_split(replicas: Sequence[ReplicaStatus]) -> str | None:
    """A message when the ready engines hold more than one set of weights: by digest where the
    engines measured one (the same version with other bytes is a split), else by version."""
    by_weights: dict[tuple[str, str | None], list[str]] = {}
    for r in replicas:
        for e in r.engines:
            if e.ready and e.weights_version is not None:
                by_weights.setdefault((e.weights_version, e.weights_digest), []).append(e.name)
    digests = {d for _, d in by_weights if d is not None}
    groups: dict[str, list[str]] = {}
    for (version, digest), engines in by_weights.items():
        key = f"{version} ({digest[:16]}…)" if digest is not None and len(digests) > 1 else version
        groups.setdefault(key, []).extend(engines)
    if len(groups) < 2:
        return None
    parts = [
        f"{v} on {len(engines)} engine(s) ({', '.join(engines[:3])}{', …' if len(engines) > 3 else ''})"
        for v, engines in sorted(groups.items(), key=lambda kv: -len(kv[1]))
    ]
    return f"engines hold {len(groups)} different weights: " + "; ".join(parts)


def compute_status(
    drs: str, previous: DisaggReplicaSetStatus, observed: Observed, now: datetime.datetime
) -> tuple[DisaggReplicaSetStatus, list[EventNote]]:
    """The status of ``drs`` after a reconcile pass, and the Events of its flips and stuck pods."""
    prev = previous.conditions
    make = _Conditions(prev, observed.generation, now)
    if observed.problems:
        return _invalid_status(drs, previous, observed, make)
    replicas = _replica_readiness(drs, observed)
    counts = _Counts.of(replicas)
    rollout = observed.rollout
    in_flight = bool(rollout and (rollout.actions or rollout.waiting)) or counts.updated < counts.n - counts.unplaced
    stuck = [e.message or e.problem or "" for r in replicas for e in r.engines if e.problem]
    stuck += [f.message or f.problem or "" for r in replicas for f in r.frontends if f.problem]
    all_updated = counts.n > 0 and counts.updated == counts.n
    ready = make(
        ConditionType.READY,
        all_updated,
        Reason.ALL_REPLICAS_READY if all_updated else Reason.REPLICAS_NOT_READY,
        f"{counts.updated}/{counts.n} replicas ready at the current spec ({counts.ready} serving)",
    )
    progressing = _progressing_condition(make, prev, rollout, replicas, stuck, in_flight)
    degraded = _degraded_condition(make, observed.moved, replicas, stuck, ready, in_flight)
    weights = weights_status(previous.weights, observed.weights_version, observed.desired_weights, now)
    conditions = [
        make(ConditionType.VALID, True, Reason.SPEC_VALID, "spec is valid"),
        _placed_condition(make, replicas),
        ready,
        progressing,
        degraded,
    ]
    if weights is not None and weights.desired is not None:
        conditions.append(_weights_pending_condition(make, replicas, weights.desired, observed.engine_catch_up))
    if observed.policy_peers is not None:
        empty = bool(observed.policy_peers.empty)
        reason = Reason.POLICY_PEER_SELECTS_NOTHING if empty else Reason.POLICY_PEERS_MATCH
        message = condition_message(observed.policy_peers)
        conditions.append(make(ConditionType.POLICY_PEERS_MATCH, not empty, reason, message))
    if observed.frontend_standby is not None and observed.urls:
        conditions.append(
            _standby_condition(make, observed.frontend_standby, observed.host_network, len(observed.urls))
        )
    status = DisaggReplicaSetStatus(
        observed_generation=observed.generation,
        replicas=counts.n,
        ready_replicas=counts.ready,
        updated_replicas=counts.updated,
        selector=names.selector(drs),
        phase=_phase(ready, progressing, degraded, counts.unplaced > 0 and counts.ready == 0, in_flight, bool(stuck)),
        gpus=observed.gpus,
        replica_width=observed.replica_width,
        conditions=conditions,
        urls=[u or "" for u in observed.urls],
        replica_statuses=replicas,
        weights=weights,
        token_rotations=list(observed.token_rotations) or None,
    )
    return status, (
        transitions(prev, conditions)
        + problem_notes(previous, replicas)
        + gang_notes(previous.replica_statuses, replicas)
    )


@dataclasses.dataclass(frozen=True)
class _Conditions:
    """Makes the conditions of one pass (a condition keeps its transition time unless it flips)."""

    previous: Sequence[Condition]
    generation: int
    now: datetime.datetime

    def __call__(self, type_: ConditionType, status: bool, reason: Reason, message: str) -> Condition:
        return _cond(self.previous, type_, status, reason, message, self.generation, self.now)


@dataclasses.dataclass(frozen=True)
class _Counts:
    n: int  #: replicas of the plan
    ready: int  #: serving
    updated: int  #: serving the current spec
    unplaced: int

    @classmethod
    def of(cls, replicas: Sequence[ReplicaStatus]) -> _Counts:
        return cls(
            n=len(replicas),
            ready=sum(r.ready for r in replicas),
            updated=sum(r.ready and r.updated for r in replicas),
            unplaced=sum(not r.placed for r in replicas),
        )


def _invalid_status(
    drs: str, previous: DisaggReplicaSetStatus, observed: Observed, make: _Conditions
) -> tuple[DisaggReplicaSetStatus, list[EventNote]]:
    """An invalid spec: ``Valid`` turns False naming every problem; the rest of status is kept."""
    message = "; ".join(f"{p.path}: {p.message}" for p in observed.problems)
    valid = make(ConditionType.VALID, False, Reason.SPEC_INVALID, message)
    conditions = [valid, *(c for c in previous.conditions if c.type != ConditionType.VALID)]
    status = previous.model_copy(
        update={
            "observed_generation": observed.generation,
            "phase": Phase.INVALID,
            "conditions": conditions,
            "selector": names.selector(drs),
            "weights": weights_status(previous.weights, observed.weights_version, observed.desired_weights, make.now),
        }
    )
    return status, transitions(previous.conditions, conditions)


def _placed_condition(make: _Conditions, replicas: Sequence[ReplicaStatus]) -> Condition:
    unplaced = [r for r in replicas if not r.placed]
    split = [r for r in replicas if r.split]
    if unplaced:
        message = "; ".join(r.reason or "" for r in unplaced)
        return make(ConditionType.PLACED, False, Reason.REPLICAS_UNPLACED, message)
    if split:
        message = "; ".join(r.reason or f"replica {r.index} split" for r in split)
        return make(ConditionType.PLACED, True, Reason.REPLICAS_SPLIT, message)
    return make(ConditionType.PLACED, True, Reason.ALL_REPLICAS_PLACED, f"{len(replicas)} replica(s) placed")


def _progressing_condition(
    make: _Conditions,
    previous: Sequence[Condition],
    rollout: Rollout | None,
    replicas: Sequence[ReplicaStatus],
    stuck: Sequence[str],
    in_flight: bool,
) -> Condition:
    if not in_flight:
        return make(ConditionType.PROGRESSING, False, Reason.RECONCILED, "all children match the spec")
    not_ready = [str(r.index) for r in replicas if r.placed and not (r.ready and r.updated)]
    message = (rollout.message if rollout else "") or (
        f"starting replica {', '.join(not_ready)}" if not_ready else "applying changes"
    )
    if stuck:
        message = f"{message}; " + "; ".join(stuck)
    was_ready = any(c.type == ConditionType.READY and c.status == ConditionStatus.TRUE for c in previous)
    return make(ConditionType.PROGRESSING, True, Reason.UPDATING if was_ready else Reason.CREATING, message)


def _standby_condition(make: _Conditions, standby: bool, host_network: bool, urls: int) -> Condition:
    """``FrontendStandby``: whether a killed frontend pod or process leaves its URL served."""
    if standby:
        message = f"each of the {urls} frontend URL(s) runs two processes (frontend.standby): a killed frontend pod or process leaves its URL served"
        return make(ConditionType.FRONTEND_STANDBY, True, Reason.STANDBY_PER_URL, message)
    dark = "a killed frontend pod or process leaves its URL dark until it is back (clients retrying twice lose turns)"
    if host_network:
        message = f"network.hostNetwork: each frontend URL is one process on its node's port, so {dark}; pod networking runs a standby per URL"
        return make(ConditionType.FRONTEND_STANDBY, False, Reason.HOST_NETWORK_ONE_PROCESS, message)
    message = f"frontend.standby is false: each frontend URL is one process, so {dark}"
    return make(ConditionType.FRONTEND_STANDBY, False, Reason.STANDBY_OFF, message)


def _weights_pending_condition(
    make: _Conditions,
    replicas: Sequence[ReplicaStatus],
    desired: DesiredWeightsStatus,
    catch_up: Mapping[str, str] | None = None,
) -> Condition:
    """``WeightsPending``: True while an engine of a placed replica does not hold ``desired``
    (:mod:`drs_operator.weights_pending`); False once every one does."""
    total = sum(len(r.engines) for r in replicas if r.placed)
    pending = pending_engines(replicas, desired)
    if pending:
        message = pending_message(pending, total, desired, catch_up)
        return make(ConditionType.WEIGHTS_PENDING, True, Reason.WEIGHTS_PENDING, message)
    message = f"{total} engine(s) hold the desired weights {desired.version}"
    return make(ConditionType.WEIGHTS_PENDING, False, Reason.WEIGHTS_CURRENT, message)


def _degraded_condition(
    make: _Conditions,
    moved: Sequence[int],
    replicas: Sequence[ReplicaStatus],
    stuck: Sequence[str],
    ready: Condition,
    in_flight: bool,
) -> Condition:
    """Most urgent first: moved, unplaced, pods that cannot run, split weights, not ready."""
    n = len(replicas)
    unplaced = [r for r in replicas if not r.placed]
    split_weights = _weights_split(replicas)
    if moved:
        message = f"replica {', '.join(map(str, moved))} moved off lost or unschedulable nodes"
        return make(ConditionType.DEGRADED, True, Reason.NODE_LOST, message)
    if unplaced:
        return make(ConditionType.DEGRADED, True, Reason.REPLICAS_UNPLACED, f"{len(unplaced)} replica(s) not placed")
    if stuck:
        return make(ConditionType.DEGRADED, True, Reason.PODS_NOT_RUNNING, "; ".join(stuck)[:32768])
    if split_weights:
        return make(ConditionType.DEGRADED, True, Reason.WEIGHTS_SPLIT, split_weights)
    if n and ready.status != ConditionStatus.TRUE and not in_flight:
        not_ready = n - sum(r.ready for r in replicas)
        return make(ConditionType.DEGRADED, True, Reason.ENGINE_FAILED, f"{not_ready} replica(s) not ready")
    return make(ConditionType.DEGRADED, False, Reason.NOT_DEGRADED, "")


def _phase(
    ready: Condition,
    progressing: Condition,
    degraded: Condition,
    nothing_placed_serves: bool,
    in_flight: bool,
    stuck: bool,
) -> Phase:
    if ready.status == ConditionStatus.TRUE and progressing.status == ConditionStatus.FALSE:
        return Phase.READY
    if nothing_placed_serves:
        return Phase.PENDING
    if degraded.status == ConditionStatus.TRUE and (not in_flight or stuck):
        return Phase.DEGRADED
    return Phase.PROGRESSING


def weights_status(
    previous: WeightsStatus | None,
    annotated: str | None,
    desired: DesiredWeights | None,
    now: datetime.datetime,
) -> WeightsStatus | None:
    """``status.weights`` from the sidecar's annotations: ``version`` (the last refit that reached
    every engine; a new version is stamped with ``now``, the same version keeps its time, and no
    annotation keeps what status had) and ``desired`` (the weights the fleet must hold, as the
    sidecar stored them when a refit started; kept when the annotation is gone)."""
    current = previous
    if (
        annotated
        and len(annotated) <= MAX_WEIGHTS_VERSION_CHARS
        and (previous is None or previous.version != annotated)
    ):
        current = WeightsStatus(version=annotated, last_update_time=now, desired=previous.desired if previous else None)
    if desired is not None:
        shown = desired_weights_status(desired)
        if current is None or current.desired != shown:
            current = (current or WeightsStatus()).model_copy(update={"desired": shown})
    return current


def desired_weights_status(desired: DesiredWeights) -> DesiredWeightsStatus:
    """``status.weights.desired`` as the annotation holds it, its cut-over (epoch seconds) as a UTC
    time; a cut-over outside the turn stamps' range (:mod:`drs_protocol.cutover`: a hand-edited
    annotation) is left out rather than failing the status."""
    at = desired.effective_at
    effective_at = (
        datetime.datetime.fromtimestamp(at, tz=datetime.UTC)
        if at is not None and MIN_STAMP <= at <= MAX_STAMP
        else None
    )
    return DesiredWeightsStatus(
        version=desired.version, path=desired.path, digest=desired.digest, effective_at=effective_at
    )
