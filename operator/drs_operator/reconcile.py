"""Reconcile one DisaggReplicaSet: a script of named steps, from the spec plus what exists.

1. read the resource (a GET: its status is the memory; gone → stop);
2. validate the spec (invalid → ``Valid=False``, an Event, no child touched);
3. plan (pure) and read the children, the nodes and the GPUs other pods use (from the watch
   caches, ``kube/cache.py``: no request);
4. place (pure, sticky: the previous placement comes from status, the operator's memory; what
   our live pods still hold on other nodes is booked; a node that is not Ready keeps its
   replicas for ``topology.notReadyTolerationSeconds``, and the pass looks again when that ends);
5. build the desired children (pure) and decide the actions (pure: creates, roll-out deletes,
   frontend updates after their engines); ask every serving engine what weights it holds
   (``GET /control/weights``, ``kube/engines.py``: within ``OBSERVE_BUDGET_S`` in all, while step
   6 writes; an engine that does not answer is unknown); with ``spec.networkPolicy`` enabled, ask
   the API whether each ``engineClients`` peer selects a pod (``kube/policy_peers.py``, at most
   every ``policy_peers.RECHECK_S``; the ``PolicyPeersMatch`` condition);
6. apply the actions, concurrently within the throttle's limits (``kube/throttle.py``), in
   phases: configs, Services, the Secret and NetworkPolicies, then engine pods, then frontends;
   then annotate the engine pods whose annotation does not name the desired weights just written
   into the weights ConfigMap (``weights_touch.py``: their kubelets refresh the mounted file at once);
7. compute the status (pure) and write it only if it changed, also when a write of step 6
   failed (the placement those writes acted on must be in the memory); post Events for
   transitions.

Returns the delay before the next look (sooner while something is in flight; every
``OBSERVE_INTERVAL_S`` while the fleet has desired weights, so what status says the engines hold
follows them with no event), or None when the periodic resync is enough. A converged fleet makes no write at all: every step compares before
it writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import time
from typing import Any, Final

from drs_protocol.auth import Realm
from drs_protocol.weights_state import parse_desired_weights
from kubernetes_asyncio import client

from drs_operator.api import names
from drs_operator.api.constants import (
    ANNOTATION_DESIRED_WEIGHTS,
    ANNOTATION_ROTATION_PHASE,
    ANNOTATION_WEIGHTS_VERSION,
    CHILD_KINDS,
    FRONTEND_PODS,
    EventReason,
    EventType,
    Reason,
)
from drs_operator.api.objects import Manifest
from drs_operator.api.spec import NetworkPolicySpec
from drs_operator.api.status import DisaggReplicaSetStatus, TokenRotationStatus
from drs_operator.conditions import Observed, compute_status
from drs_operator.decide import Decision, decide
from drs_operator.engine_observation import catch_up_reasons, held_weights, observation_targets
from drs_operator.kube.apply import Applier
from drs_operator.kube.cache import ClusterCache
from drs_operator.kube.engines import EngineClient, control_token
from drs_operator.kube.observe import read_drs
from drs_operator.kube.policy_peers import PeerChecker
from drs_operator.manifests import Owner
from drs_operator.manifests.policies import OperatorPods
from drs_operator.manifests.rotation import generation as secret_generation
from drs_operator.manifests.rotation import rotation_request, rotation_status, rotation_step, rotation_window
from drs_operator.manifests.secrets import missing_secrets, reader_urls, secret_notes
from drs_operator.metrics import OperatorMetrics
from drs_operator.nodepool import nodes_from_manifests
from drs_operator.placement import Placement
from drs_operator.policy_peers import RECHECK_S, PeerReport
from drs_operator.rollout import Action, ActionReason
from drs_operator.status_events import EventNote
from drs_operator.status_write import status_dict, status_patch
from drs_operator.validation import Problem, validate_name, validate_spec_data
from drs_operator.weights_touch import touch_pods, touches

log = logging.getLogger(__name__)

#: Next look while children are being created or rolled (pods becoming ready are not events we
#: always see in time through the watches).
IN_FLIGHT_REQUEUE_S: Final = 2.0
#: Next look when replicas cannot be placed (node events also trigger a reconcile).
UNPLACED_REQUEUE_S: Final = 15.0
#: Next look while the fleet has desired weights: how stale what status says the engines hold
#: may get (an engine restarted at other weights, loaded by hand) with no event at all.
OBSERVE_INTERVAL_S: Final = 5.0
#: The soonest look again when a not-Ready node's toleration ends (never a busy loop).
MIN_REQUEUE_S: Final = 0.5
#: The order children are applied in: what others read first, frontends last. Within a phase
#: every action is sent at once; the throttle bounds how many are in flight.
APPLY_PHASES: Final = (("ConfigMap", "Service", "Secret", "NetworkPolicy"), ("Pod",), ("Deployment",))


@dataclasses.dataclass(frozen=True)
class Context:
    api: client.ApiClient
    applier: Applier
    metrics: OperatorMetrics
    cache: ClusterCache
    engines: EngineClient = dataclasses.field(default_factory=EngineClient)
    peers: PeerChecker = dataclasses.field(default_factory=PeerChecker)
    #: The operator's own pods, which every per-replica NetworkPolicy admits (None outside a pod).
    operator: OperatorPods | None = None


async def reconcile(ctx: Context, namespace: str, name: str) -> float | None:
    started = time.monotonic()
    try:
        delay = await _reconcile(ctx, namespace, name)
    except Exception:
        ctx.metrics.reconciles.labels(result="error").inc()
        ctx.metrics.reconcile_errors.labels(kind="exception").inc()
        raise
    finally:
        ctx.metrics.reconcile_seconds.observe(time.monotonic() - started)
    ctx.metrics.reconciles.labels(result="requeue" if delay else "done").inc()
    return delay


async def _reconcile(ctx: Context, namespace: str, name: str) -> float | None:
    # 1. read
    body = await read_drs(ctx.api, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        _forget(ctx, namespace, name)  # children go with it, by garbage collection
        return None
    meta = body["metadata"]
    generation = int(meta.get("generation", 0))
    previous = _parse_status(body.get("status"))
    weights_version = (meta.get("annotations") or {}).get(ANNOTATION_WEIGHTS_VERSION)
    desired_weights = parse_desired_weights((meta.get("annotations") or {}).get(ANNOTATION_DESIRED_WEIGHTS))
    now = datetime.datetime.now(datetime.UTC)

    # 2. validate
    spec, problems = validate_spec_data(body.get("spec") or {})
    problems = [*validate_name(name), *problems]
    if spec is None or problems:
        status, notes = compute_status(
            name,
            previous,
            Observed(
                generation=generation,
                problems=problems or _unknown(),
                weights_version=weights_version,
                desired_weights=desired_weights,
            ),
            now,
        )
        await _write_status(ctx, body, status, notes)
        return None

    # 3. read what exists
    owner = Owner(name=name, namespace=namespace, uid=meta["uid"])
    live = ctx.cache.live_children(namespace, name, owner.uid)
    nodes = nodes_from_manifests(
        ctx.cache.node_manifests(),
        used=ctx.cache.usage.used_by_others(namespace, name),
        topology=spec.topology,
        now=now,
    )
    live_by_kind = {kind: live.of(kind) for kind in CHILD_KINDS}

    # 4-5. plan, place (sticky on the placement recorded in status), desired children, actions
    decision = decide(
        spec,
        owner,
        previous,
        nodes,
        live_by_kind,
        generation=generation,
        weights_version=weights_version,
        desired_weights=desired_weights,
        operator=ctx.operator,
    )
    placement, rollout, moved = decision.placement, decision.rollout, decision.moved
    # 5b. ask the serving engines what they hold, while step 6 writes (bounded by the budget)
    observing = asyncio.create_task(_observe_engines(ctx, decision, live_by_kind, name))
    checking = asyncio.create_task(_check_peers(ctx, spec.network_policy, namespace, name))

    # 6. apply; 7. status and events, even when a write of step 6 failed (status: the placement they acted on)
    action_notes: list[EventNote] = []
    rotation_due: float | None = None
    rotations: list[TokenRotationStatus] = []
    try:
        if any(r.placed for r in placement.replicas):  # the token Secrets: created, then rotated
            action_notes, rotation_due, rotations = await _sync_secrets(ctx, owner, meta, live, now)
        await _apply_all(ctx.applier, namespace, rollout.actions)
        # 6b. new desired weights in the ConfigMap: touch the engine pods so their kubelets
        # refresh the mounted file now, not at their periodic sync (never fails the pass)
        await touch_pods(ctx.applier, namespace, touches(live_by_kind["Pod"], desired_weights))
        action_notes += _action_notes(rollout.actions, moved, placement)
    finally:
        peers = await checking
        observed = dataclasses.replace(await observing, policy_peers=peers, token_rotations=rotations)
        status, notes = compute_status(name, previous, observed, now)
        await _write_status(ctx, body, status, notes + action_notes)
    _export(ctx, namespace, name, status, placement)
    peers_due = RECHECK_S if peers is not None and peers.empty else None  # look again until they select
    delays = (_next_look(decision, status, now), rotation_due, peers_due)
    return min((d for d in delays if d is not None), default=None)


async def _check_peers(ctx: Context, policy: NetworkPolicySpec, namespace: str, name: str) -> PeerReport | None:
    """Whether each ``engineClients`` peer selects a pod; None when the policies are off or have no peers."""
    if not policy.enabled or not policy.engine_clients:
        ctx.peers.forget(namespace, name)
        return None
    return await ctx.peers.report(ctx.api, namespace, name, policy.engine_clients)


async def _sync_secrets(
    ctx: Context, owner: Owner, meta: Manifest, live: Any, now: datetime.datetime
) -> tuple[list[EventNote], float | None, list[TokenRotationStatus]]:
    """Create the token Secrets that are missing, then take each one's rotation a step further
    (``manifests.rotation``); the Events, the seconds until a rotation's next phase is due, and
    the rotations under way for the status (with the pods each phase waits on)."""
    annotations = meta.get("annotations") or {}
    request = rotation_request(annotations)
    created = missing_secrets(owner, live.of("Secret"), live.of("Pod"), request, now)
    for secret in created:
        await ctx.applier.create(secret)
    notes = secret_notes(created, live.of("Pod"))
    window, problem = rotation_window(annotations)
    due: list[float] = []
    rotations: list[TokenRotationStatus] = []
    pods = {**live.of("Pod"), **live.of(FRONTEND_PODS)}
    realms = (
        (names.control_secret_name(owner.name), Realm.CONTROL),
        (names.serving_secret_name(owner.name), Realm.SERVING),
    )
    for secret_name, realm in realms:
        current = live.of("Secret").get(secret_name)
        if current is None:
            continue
        under_way = ANNOTATION_ROTATION_PHASE in ((current.get("metadata") or {}).get("annotations") or {})
        lagging = await _lagging(ctx, current, pods, realm) if under_way else None
        step = rotation_step(current, request, window, now, lagging)
        if step.secret is not None:
            await ctx.applier.replace(step.secret, current)
        # a phase just entered has not been asked about yet
        shown = rotation_status(step.secret or current, lagging if step.secret is None else None)
        rotations += [shown] if shown is not None else []
        notes += [step.note] if step.note is not None else []
        due += [max(MIN_REQUEUE_S, step.due_in_s)] if step.due_in_s is not None else []
    if problem is not None and any(n.reason == EventReason.TOKEN_ROTATION_STARTED for n in notes):
        notes.append(EventNote(EventType.WARNING, EventReason.TOKEN_ROTATION_INVALID, problem))
    return notes, min(due, default=None), rotations


async def _lagging(ctx: Context, secret: Manifest, pods: dict[str, Manifest], realm: Realm) -> list[str]:
    """The pods that mount ``secret`` and did not report reading its current generation in their
    ``/health`` answer (no answer, no address yet, another generation)."""
    urls = reader_urls(pods, secret["metadata"]["name"])
    reports = await ctx.engines.token_generations({n: u for n, u in urls.items() if u})
    want = secret_generation(secret)
    return sorted(n for n in urls if want is None or reports.get(n, {}).get(str(realm)) != want)


async def _observe_engines(
    ctx: Context, decision: Decision, live: dict[str, dict[str, Manifest]], name: str
) -> Observed:
    """``decision.observed`` with what every serving engine answered it holds (no answer: unknown)."""
    catching_up = decision.observed.desired_weights is not None  # not-Ready engines say why
    observations = await ctx.engines.observe(
        observation_targets(decision.plan, decision.observed.replica_statuses, live["Pod"], catching_up=catching_up),
        control_token(live["Secret"], name),
    )
    ctx.metrics.engine_observations.labels(result="answered").inc(sum(o.held is not None for o in observations))
    ctx.metrics.engine_observations.labels(result="unknown").inc(sum(o.held is None for o in observations))
    return dataclasses.replace(
        decision.observed, engine_weights=held_weights(observations), engine_catch_up=catch_up_reasons(observations)
    )


def _next_look(decision: Decision, status: DisaggReplicaSetStatus, now: datetime.datetime) -> float | None:
    """Seconds until the next pass: soon while children are in flight; when a not-Ready node's
    toleration ends (time passing is no watch event); later while replicas are unplaced."""
    placement, rollout = decision.placement, decision.rollout
    delays: list[float] = []
    if rollout.actions or rollout.waiting or status.ready_replicas < sum(r.placed for r in placement.replicas):
        delays.append(IN_FLIGHT_REQUEUE_S)
    if decision.tolerated_until is not None:
        delays.append(max(MIN_REQUEUE_S, (decision.tolerated_until - now).total_seconds()))
    if not placement.complete:
        delays.append(UNPLACED_REQUEUE_S)
    if status.weights is not None and status.weights.desired is not None:
        delays.append(OBSERVE_INTERVAL_S)
    return min(delays, default=None)


def _forget(ctx: Context, namespace: str, name: str) -> None:
    ctx.peers.forget(namespace, name)
    for gauge in (ctx.metrics.replicas_desired, ctx.metrics.replicas_ready):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)


def _unknown() -> list[Problem]:
    return [Problem("spec", "the spec could not be read")]


def _parse_status(raw: Any) -> DisaggReplicaSetStatus:
    try:
        return DisaggReplicaSetStatus.model_validate(raw or {})
    except ValueError:
        log.warning("ignoring an unreadable status; placement starts afresh")
        return DisaggReplicaSetStatus()


async def _apply_all(applier: Applier, namespace: str, actions: tuple[Action, ...]) -> None:
    """Apply in phases by kind (configs and Services, then engine pods, then frontends): a phase
    starts when every action of the one before has succeeded, so a replica's frontends are never
    written before its engine pods. Within a phase all actions go at once (the applier's throttle
    bounds them); the first failure is raised once the phase has finished."""
    for kinds in APPLY_PHASES:
        results = await asyncio.gather(
            *(_apply(applier, namespace, a) for a in actions if a.kind in kinds), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]


async def _apply(applier: Applier, namespace: str, action: Action) -> None:
    log.info("%s %s/%s (%s)", action.verb, action.kind, action.name, action.reason)
    if action.verb == "create":
        assert action.manifest is not None
        await applier.create(action.manifest)
    elif action.verb == "replace":
        assert action.manifest is not None and action.live is not None
        await applier.replace(action.manifest, action.live)
    else:
        await applier.delete(action.kind, namespace, action.name, action.grace_seconds)


#: The Events of a pass's engine pod actions: (verb, action reason or None for any, type, reason, wording).
_POD_ACTION_EVENTS: Final = (
    ("create", None, EventType.NORMAL, EventReason.ENGINES_CREATED, "created engine pods"),
    ("delete", ActionReason.FAILED, EventType.WARNING, Reason.ENGINE_FAILED, "replacing failed engine pods"),
    (
        "delete",
        ActionReason.OUTDATED,
        EventType.NORMAL,
        EventReason.ENGINES_RECREATED,
        "replacing outdated engine pods",
    ),
)


def _action_notes(actions: tuple[Action, ...], moved: list[int], placement: Placement) -> list[EventNote]:
    notes: list[EventNote] = []
    for verb, why, type_, reason, words in _POD_ACTION_EVENTS:
        pods = [a.name for a in actions if a.verb == verb and a.kind == "Pod" and why in (None, a.reason)]
        if pods:
            notes.append(EventNote(type_, reason, f"{words} {', '.join(pods)}"))
    for r in moved:
        nodes = ", ".join(placement.replica(r).nodes)
        notes.append(EventNote(EventType.WARNING, Reason.REPLICA_MOVED, f"replica {r} moved to {nodes}"))
    fronts = [f"{a.verb}d {a.name}" for a in actions if a.kind == "Deployment" and a.verb in ("create", "replace")]
    if fronts:
        notes.append(EventNote(EventType.NORMAL, EventReason.FRONTENDS_APPLIED, ", ".join(fronts)))
    return notes


async def _write_status(ctx: Context, body: Manifest, status: DisaggReplicaSetStatus, notes: list[EventNote]) -> None:
    patch = status_patch(status_dict(status), status_dict(_parse_status(body.get("status"))))
    if patch is not None:
        await ctx.applier.patch_status(body["metadata"]["namespace"], body["metadata"]["name"], patch)
    await asyncio.gather(*(ctx.applier.event(body, note.type, note.reason, note.message) for note in notes))


def _export(ctx: Context, namespace: str, name: str, status: DisaggReplicaSetStatus, placement: Placement) -> None:
    ctx.metrics.replicas_desired.labels(namespace, name).set(status.replicas)
    ctx.metrics.replicas_ready.labels(namespace, name).set(status.ready_replicas)
    if not placement.complete:
        ctx.metrics.placement_failures.labels(namespace, name).inc()
