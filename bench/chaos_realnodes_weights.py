"""The weights scenarios of ``bench/chaos_realnodes.py`` and the cluster primitives they share
with it (``say``, ``get_json``, ``pods``, ``wait``, ``kill``): off-policy turns judged against the
refits so far (:data:`REFITS`), the status sampled while a scenario runs (:class:`StatusWatch`),
the path-less events (the desired weights stored without their checkpoint path, then replica 0's
engines deleted, or one replica added; the control with the replicas' NetworkPolicies narrowed to
their own pods), the operator deleted mid-refit, and the trainer pod killed mid-refit then started
again (its parts: ``bench/chaos_realnodes_sidecar.py``). What each measures: the module doc of
``bench/chaos_realnodes.py``."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from drs_devcluster import inpod
from drs_devcluster.testing import RunningCluster
from drs_operator.api.constants import ANNOTATION_DESIRED_WEIGHTS
from drs_protocol import env
from drs_protocol.weights_state import DesiredWeights
from drs_protocol.weights_stream import WEIGHTS_MOUNT_PATH

from bench import chaos_realnodes_sidecar as cut_short

NAME = "pod-sim"
NS = "chaos"
READY_S = 300.0
TRAINER_S = 240.0
STATUS_POLL_S = 1.0
#: (cut-over as wall-clock seconds, version) of every refit so far, in order
REFITS: list[tuple[float, str]] = []
#: the scenarios under path-less desired weights: the whole run then has the per-replica
#: NetworkPolicies on, so they run only when named (after ``refit``), not by default
UNADMITTED = "replica_killed_pathless_unadmitted"
PATHLESS = ("replica_killed_pathless", "scaled_up_pathless", UNADMITTED)
#: the trainer pod killed mid-refit, then a new one; its control (the stored desired weights removed)
SIDECAR_KILLED = "sidecar_killed_mid_refit"
SIDECAR_FORGOTTEN = "sidecar_killed_forgotten"
#: what a scenario's event observed beyond the load (merged into its result)
NOTES: dict[str, Any] = {}
#: the desired weights' file every engine pod mounts (the weights ConfigMap)
DESIRED_FILE = f"{WEIGHTS_MOUNT_PATH}/{env.DESIRED_WEIGHTS_KEY}"
#: seconds between the trainer pod's kill and the new trainer pod (``--resume-after``: later than the
#: engines' target lease, 30 s, they are on their own meanwhile)
RESUME_AFTER_S = [0.0]


def say(msg: str) -> None:
    print(f"[chaos-real] {msg}", file=sys.stderr, flush=True)


def desired_at(when: float) -> str | None:
    """The version desired at ``when`` (wall clock): the last refit whose cut-over is not after it."""
    return next((version for at, version in reversed(REFITS) if at <= when), None)


def desired_in(st: dict[str, Any], at: float) -> str | None:
    """The version desired at ``at`` as the engines judge it: the status's desired weights
    (``status.weights.desired``, the operator's copy of the stored ones) once their cut-over
    ``effectiveAt`` is not after ``at``; before it (or with none shown) the refits so far
    (:func:`desired_at`). So a refit's version counts from its cut-over, not from its trainer's end."""
    desired = (st.get("weights") or {}).get("desired") or {}
    version, effective = desired.get("version"), desired.get("effectiveAt")
    if version and (effective is None or datetime.fromisoformat(effective.replace("Z", "+00:00")).timestamp() <= at):
        return str(version)
    return desired_at(at)


def weights_figures(answers: list[list[Any]]) -> dict[str, Any]:
    """Off-policy turns among the load client's answers (``[stamp, version, boundary]``), and the
    first and last one's stamp after the cut-over of the refit desired at it (``off_policy_s``)."""
    off = unstamped = 0
    after: list[float] = []
    for stamp, version, boundary in answers:
        if stamp is None:
            unstamped += 1
            continue
        want = desired_at(stamp)
        if not boundary and want is not None and version != want:
            off += 1
            after.append(stamp - next(at for at, v in reversed(REFITS) if at <= stamp))
    window = [round(min(after), 1), round(max(after), 1)] if after else None
    return {"off_policy": off, "unstamped": unstamped, "off_policy_s": window}


class StatusWatch:
    """Samples the DisaggReplicaSet's status every second while a scenario runs (see the module doc)."""

    def __init__(self, cluster: RunningCluster) -> None:
        self.cluster = cluster
        self.samples = self.stale = self.untrue = self.pending = 0
        self.first_untrue: dict[str, Any] | None = None
        self.first_stale: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StatusWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(STATUS_POLL_S):
            at = time.time()  # the sample's time: before the read (a cut-over after it is not yet due)
            got = self.cluster.kubectl("get", "drs", NAME, "-n", NS, "-o", "json", check=False)
            if got.returncode != 0:
                continue
            st = json.loads(got.stdout).get("status") or {}
            self.look(st, desired_in(st, at))

    def look(self, st: dict[str, Any], want: str | None) -> None:
        self.samples += 1
        conditions = {c["type"]: c["status"] for c in st.get("conditions") or []}
        pending = conditions.get("WeightsPending") == "True"
        self.pending += pending
        engines = [e for r in st.get("replicaStatuses") or [] for e in r.get("engines") or []]
        stale = [
            (e["name"], e.get("weightsVersion"))
            for e in engines
            if want is not None and e.get("ready") and e.get("weightsVersion") not in (None, want)
        ]
        if stale:
            self.stale += 1
            self.first_stale = self.first_stale or {
                "desired": want,
                "ready_at_other_weights": stale,
                "pending": pending,
            }
            if not pending:
                self.untrue += 1
                self.first_untrue = self.first_untrue or {"desired": want, "ready_at_other_weights": stale}

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "status_samples": self.samples,
            "stale_ready_samples": self.stale,
            "untrue_samples": self.untrue,
            "weights_pending_samples": self.pending,
        }
        if self.first_untrue:
            out["first_untrue"] = self.first_untrue
        if self.first_stale:
            out["first_stale"] = self.first_stale
        return out


def get_json(cluster: RunningCluster, *args: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
    return body


def pods(cluster: RunningCluster, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get_json(cluster, "pods", "-n", NS, "-l", selector)["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def wait(what: str, check: Callable[[], bool], timeout: float = READY_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not reached after {timeout:.0f}s")
        time.sleep(1.0)


def kill(cluster: RunningCluster, namespace: str, victims: list[dict[str, Any]]) -> None:
    names = [p["metadata"]["name"] for p in victims]
    say(f"deleting {names} with grace 0")
    cluster.kubectl("delete", "pod", *names, "-n", namespace, "--grace-period=0", "--force")


def stored_desired(cluster: RunningCluster) -> str | None:
    annotations = get_json(cluster, "drs", NAME, "-n", NS)["metadata"].get("annotations") or {}
    return annotations.get(ANNOTATION_DESIRED_WEIGHTS)


def kill_operator_mid_refit(cluster: RunningCluster, trainer: str) -> None:
    """Once the trainer pod's sidecar has stored the new desired weights (its refit has begun),
    the operator pod deleted with grace 0; whether the trainer was still running then is kept."""
    before = stored_desired(cluster)
    deadline = time.monotonic() + TRAINER_S
    while stored_desired(cluster) == before:  # asked back to back: one kubectl call apart (~0.1-0.3 s)
        if time.monotonic() > deadline:
            raise SystemExit(f"{trainer}: no new desired weights stored after {TRAINER_S:.0f}s")
    began = time.monotonic()
    kill(cluster, "drs-system", get_json(cluster, "pods", "-n", "drs-system")["items"])
    NOTES["operator_killed_after_store_s"] = round(time.monotonic() - began, 1)
    NOTES["trainer_phase_at_kill"] = get_json(cluster, "pod", trainer, "-n", NS)["status"].get("phase")


def drop_path(cluster: RunningCluster) -> None:
    """The desired weights as a broadcast leaves them: the stored annotation rewritten without its
    checkpoint path (version, digest and cut-over kept); once the operator has copied them, the
    weights ConfigMap lists the fleet's engines as ``peers``, the only way to the bytes."""
    annotations = get_json(cluster, "drs", NAME, "-n", NS)["metadata"].get("annotations") or {}
    desired = json.loads(annotations[ANNOTATION_DESIRED_WEIGHTS])
    desired.pop("path", None)
    value = json.dumps(desired, separators=(",", ":"))
    cluster.kubectl("annotate", "drs", NAME, "-n", NS, "--overwrite", f"{ANNOTATION_DESIRED_WEIGHTS}={value}")

    def pathless() -> bool:
        data = get_json(cluster, "configmap", f"{NAME}-weights", "-n", NS).get("data") or {}
        return bool(data.get("peers")) and "path" not in json.loads(data.get("desired") or "{}")

    wait("the weights ConfigMap with path-less desired weights and peers", pathless, timeout=60)
    say(f"desired weights without a path: {value}")


def held_weights(cluster: RunningCluster, pod: str) -> dict[str, Any]:
    """What an engine answers ``GET /control/weights`` (asked from inside its own pod with its
    control token): the version and digest it holds, and its catch-up (source, reached from)."""
    st = get_json(cluster, "drs", NAME, "-n", NS).get("status") or {}
    url = next(e["url"] for r in st.get("replicaStatuses") or [] for e in r.get("engines") or [] if e["name"] == pod)
    got = cluster.kubectl("exec", pod, "-n", NS, "--", *inpod.held_weights_command(url), check=False)
    if got.returncode != 0:
        return {"error": (got.stderr or got.stdout).strip()[-500:]}
    answer = json.loads(got.stdout)
    catch_up = answer.get("catch_up") or {}
    return {
        "weights_version": answer.get("weights_version"),
        "weights_digest": (answer.get("weights_digest") or "")[:20] or None,
        "catch_up": {k: catch_up.get(k) for k in ("phase", "source", "attempts", "reached_from")},
        # the tail: the last peers' reasons (a pending peer's 503 quotes its own catch-up's error)
        "last_error_tail": (catch_up.get("last_error") or "")[-600:] or None,
    }


def ready_pods(cluster: RunningCluster, selector: str, not_uids: set[str]) -> list[dict[str, Any]]:
    return [
        p
        for p in pods(cluster, selector)
        if p["metadata"]["uid"] not in not_uids
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
    ]


#: How long the new engine pods of a path-less scenario may take to be Ready (their catch-up included).
CATCH_UP_S = 150.0


def await_caught_up(cluster: RunningCluster, selector: str, old: set[str], count: int) -> None:
    """Wait (bounded) for ``count`` new Ready engine pods under ``selector``; record each one's
    catch-up in :data:`NOTES` either way (``recovered`` False: they never came Ready)."""
    deadline = time.monotonic() + CATCH_UP_S
    while len(ready_pods(cluster, selector, old)) < count and time.monotonic() < deadline:
        time.sleep(1.0)
    fresh = [p for p in pods(cluster, selector) if p["metadata"]["uid"] not in old]
    NOTES["recovered"] = len(ready_pods(cluster, selector, old)) >= count
    NOTES["new_engines"] = {p["metadata"]["name"]: held_weights(cluster, p["metadata"]["name"]) for p in fresh}
    say(f"new engines {'Ready' if NOTES['recovered'] else 'NOT Ready'}: {json.dumps(NOTES['new_engines'])}")


ENGINES = "disagg.dev/role in (prefill,decode)"


def kill_replica_pathless(cluster: RunningCluster) -> None:
    """(Path-less desired weights) replica 0's prefill and decode pods deleted at once: neither
    replacement has a path, nor a peer in its own replica that holds the weights; both must
    stream them from replica 1's engines, through the per-replica NetworkPolicies."""
    drop_path(cluster)
    selector = f"disagg.dev/replicaset={NAME},disagg.dev/replica=0,{ENGINES}"
    victims = pods(cluster, selector)
    kill(cluster, NS, victims)
    await_caught_up(cluster, selector, {p["metadata"]["uid"] for p in victims}, len(victims))


def fleet_engines_peer(peer: dict[str, Any]) -> bool:
    """A policy's ``from`` entry admitting the fleet's engines of every replica (no replica label)."""
    labels = (peer.get("podSelector") or {}).get("matchLabels") or {}
    return "disagg.dev/replicaset" in labels and "disagg.dev/replica" not in labels


def kill_replica_pathless_unadmitted(cluster: RunningCluster) -> None:
    """The control of ``replica_killed_pathless``: each replica's NetworkPolicy edited first to
    admit only its own replica's pods (and ``engineClients``), as the renderer did before the
    fleet's engines were admitted (the operator compares spec hashes, so it keeps the edit)."""
    for policy in get_json(cluster, "networkpolicy", "-n", NS)["items"]:
        rules = policy["spec"].get("ingress") or []
        if not rules:
            continue
        kept = [peer for peer in rules[0].get("from") or [] if not fleet_engines_peer(peer)]
        patch = [{"op": "replace", "path": "/spec/ingress/0/from", "value": kept}]
        name = policy["metadata"]["name"]
        cluster.kubectl("patch", "networkpolicy", name, "-n", NS, "--type=json", "-p", json.dumps(patch))
        say(f"{name}: the fleet's engines no longer admitted")
    kill_replica_pathless(cluster)
    edited = get_json(cluster, "networkpolicy", "-n", NS)["items"]
    NOTES["policies_still_edited"] = not any(
        fleet_engines_peer(peer) for p in edited for rule in p["spec"].get("ingress") or [] for peer in rule["from"]
    )


def scale_up_pathless(cluster: RunningCluster) -> None:
    """(Path-less desired weights) one more replica: its new engines must come up at the desired
    weights, streamed from the engines of the other replicas (through their policies)."""
    drop_path(cluster)
    replicas = int(get_json(cluster, "drs", NAME, "-n", NS)["spec"]["replicas"])
    patch = {"spec": {"replicas": replicas + 1}}
    cluster.kubectl("patch", "drs", NAME, "-n", NS, "--type=merge", "-p", json.dumps(patch))
    say(f"scaling up to {replicas + 1} replicas")
    await_caught_up(cluster, f"disagg.dev/replicaset={NAME},disagg.dev/replica={replicas},{ENGINES}", set(), 2)


def watch_engines(cluster: RunningCluster, until: float, desired: DesiredWeights) -> dict[str, dict[str, float]]:
    """Until ``until`` (wall clock), each engine looked at in turn: the first time (seconds after
    ``desired``'s cut-over) its mounted desired file named ``desired`` (``file``), it was catching up
    (``pending``), and it held them (``held``)."""
    seen: dict[str, dict[str, float]] = {}
    cut = desired.effective_at or time.time()
    engines = list(cut_short.held_versions(cluster, NS, NAME))
    while time.time() < until:
        for pod in engines:
            marks = seen.setdefault(pod, {})
            got = cluster.kubectl("exec", pod, "-n", NS, "--", "cat", DESIRED_FILE, check=False).stdout
            if "file" not in marks and desired.version in got:
                marks["file"] = round(time.time() - cut, 1)
            held = held_weights(cluster, pod)
            if "pending" not in marks and (held.get("catch_up") or {}).get("phase") == "pending":
                marks["pending"] = round(time.time() - cut, 1)
            if "held" not in marks and held.get("weights_version") == desired.version:
                marks["held"] = round(time.time() - cut, 1)
    return seen


def kill_sidecar_mid_refit(cluster: RunningCluster, forget: bool = False) -> None:
    """The trainer pod killed mid-refit (:func:`bench.chaos_realnodes_sidecar.kill_trainer_mid_refit`),
    then a new trainer pod whose sidecar restores the stored desired weights; ``forget`` (the
    control: desired weights that were never durable): the operator stopped before the refit, the
    stored desired weights removed after the kill, then the operator started again, so neither the
    weights ConfigMap nor any engine's file ever names them and the new sidecar finds none."""
    name = f"trainer-{len(REFITS) + 1}"
    say(f"{name}: refitting one engine at a time; its sidecar killed once the desired weights are stored")
    with cut_short.operator_stopped(cluster) if forget else contextlib.nullcontext():
        if forget:
            say("operator stopped: the store reaches no ConfigMap and no engine's file")
        cut = cut_short.kill_trainer_mid_refit(cluster, NS, NAME, name)
        killed_at = time.time()
        if forget:  # what the engines' files could name: the ConfigMap as the stopped operator left it
            NOTES["configmap_at_removal"] = cut_short.unstore(cluster, NS, NAME)
    desired = cut.desired
    REFITS.append((desired.effective_at or time.time(), desired.version))
    NOTES["sidecar_killed_before_cutover_s"] = cut.kill_to_cutover_s
    NOTES["held_after_kill"] = cut.held_after_kill
    say(f"{name}: killed {cut.kill_to_cutover_s}s before {desired.version}'s cut-over; engines: {cut.held_after_kill}")
    if forget:
        cut_short.await_forgotten(cluster, NS, NAME)
        NOTES["operator_back_after_kill_s"] = round(time.time() - killed_at, 1)
        say(f"desired weights removed (the ConfigMap named {NOTES['configmap_at_removal']}), operator back: none known")
    if RESUME_AFTER_S[0] > 0:  # the scenario's parameter: the new trainer pod comes this much later
        NOTES["resume_after_s"] = RESUME_AFTER_S[0]
        say(f"{name}: no trainer pod for {RESUME_AFTER_S[0]:.0f}s (the target lease is 30 s)")
        NOTES["seen_after_cutover_s"] = watch_engines(cluster, killed_at + RESUME_AFTER_S[0], desired)
        NOTES["held_before_resume"] = cut_short.held_versions(cluster, NS, NAME)
        say(f"{name}: engines before the new trainer pod: {NOTES['held_before_resume']}")
    phase, log = cut_short.resume(cluster, NS, NAME, f"{name}-resumed", desired.version)
    NOTES["resumed_trainer"] = phase
    NOTES["resumed_log_tail"] = log.strip().splitlines()[-2:]
    NOTES["engines_at_refit_digest"] = cut_short.engines_at(cluster, NS, NAME, desired.digest)
    say(f"{name}-resumed: {phase}; engines at the refit's digest {NOTES['engines_at_refit_digest']}")
