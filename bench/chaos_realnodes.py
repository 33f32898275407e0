"""Benchmark: turns lost on the real-node cluster while the fleet is broken, from a client in the cluster.

``bench/chaos.py``'s experiment on real nodes (pod networking, kubelets, kube-proxy, CoreDNS): the
chart installed with the image built here (the operator a pod), ``examples/pod-network-sim.yaml``
with ``frontend.standby`` on, and ``examples/load_client.py`` in a pod: 8 Gym-shaped sessions on
``status.urls[sha256(session) % len(urls)]``, retrying as the OpenAI SDK does by default
(``max_retries=2``: two more attempts after ~0.5 s and ~1 s). Scenarios, one after the other,
each a fresh client pod running through the event:

* ``baseline`` — nothing happens;
* ``frontend_killed`` — per URL, the frontend pod the client is talking to (its affinity chose one
  of the URL's two processes; read from the pods' own request counters) deleted with grace 0;
* ``frontend_process_killed`` — per URL, the same pod's frontend *process* killed (SIGKILL from the
  host to the container's first process, found by its container id in ``/proc/*/cgroup``): the pod
  stays and the kubelet restarts the container in place;
* ``prefill_killed`` / ``decode_killed`` — replica 0's engine pod deleted with grace 0;
* ``operator_killed`` — a roll, with the operator pod deleted (grace 0) once the roll has begun;
* ``roll`` — a spec change that replaces every engine pod, replica by replica;
* ``refit`` — the trainer's refit step as a pod (``examples/trainer/refit_in_pod.py`` beside its
  ``drs sidecar`` container) writes new weights into the checkpoint volume the engines mount and
  refits every engine by path; the pod, and with it its sidecar, then ends, so nothing but the
  desired weights stored on the resource catches a later engine up. Put it before the kill
  scenarios (``--scenarios refit,decode_killed,prefill_killed``): an engine pod deleted after it
  is replaced under desired weights.
* ``replica_killed_pathless`` / ``scaled_up_pathless`` — after ``refit``, the stored desired weights
  rewritten as a broadcast leaves them (no checkpoint path: version, digest and cut-over kept), so
  the weights ConfigMap lists the fleet's engines as ``peers``; then replica 0's prefill and decode
  pods deleted at once (neither replacement has a peer in its own replica that holds the weights),
  or one replica added. The new engines must stream the weights from a serving peer of another
  replica. Naming either runs the whole fleet with ``spec.networkPolicy`` on (per-replica
  policies; ``engineClients``: the trainer pods; the operator's pods are admitted by the
  policies themselves), so the stream
  crosses them; each records the new engines' ``GET /control/weights`` (``new_engines``: version,
  digest, and the catch-up's ``source`` and ``reached_from``) and ``recovered`` (they came Ready
  within 150 s; a fleet that did not recover ends the run). Not by default.
  ``--scenarios refit,replica_killed_pathless,scaled_up_pathless``
* ``replica_killed_pathless_unadmitted`` — the control that shows the path-less bar can fail (run
  it last): ``replica_killed_pathless`` with each replica's NetworkPolicy edited first to admit
  only its own replica's pods and ``engineClients`` (the fleet's engines of other replicas
  dropped): the replacements find no peer they may reach.
* ``refit_operator_killed`` — ``refit`` with the operator pod deleted (grace 0) as soon as the
  trainer pod's sidecar has stored the new desired weights on the resource (its refit has begun);
  records ``trainer_phase_at_kill``. Not by default.
* ``sidecar_killed_mid_refit`` — the trainer's refit step as a pod whose sidecar loads one engine at
  a time (``--concurrency 1``); as soon as it has stored the new desired weights, the sidecar's
  process is SIGKILLed from the host and the pod deleted (grace 0): the refit has engines still to
  load (``held_after_kill``: each engine's own version right after;
  ``sidecar_killed_before_cutover_s``: the kill's lead on the refit's cut-over). Then a new trainer pod
  (``examples/trainer/resume_in_pod.py``): its sidecar reads the desired weights back from the
  resource and loads them where they are missing; its trainer waits up to 90 s for every engine
  at the version (``resumed_trainer``: its phase; ``engines_at_refit_digest``).
  ``sidecar_killed_forgotten`` is its control (run it last): desired weights that were never
  durable. The operator is stopped (its Deployment scaled to 0) before the refit, so the store
  reaches neither the weights ConfigMap nor any engine's mounted file; after the kill the stored
  annotation is removed and the operator started again (it empties the ConfigMap's ``desired``;
  ``configmap_at_removal``: the version the ConfigMap named then, ``operator_back_after_kill_s``),
  so the new sidecar knows nothing either. The engines the dead sidecar had not loaded refuse the
  refit's legs for its target's lease and the lapsed hold (30 + 90 s after its last announce),
  then serve their previous weights: give it ``--seconds`` well past that (200). Not by default.
  ``--resume-after S`` starts the new trainer pod S seconds after the kill (default 0): later than
  the target lease (30 s), the engines the dead sidecar had not loaded are on their own meanwhile
  (``held_before_resume``: each engine's own version right before the new pod; ``resume_after_s``).

Every scenario's turns are also judged for their weights: the load client returns, per answered
turn, the fleet's stamp and the version that answered it, and a turn is ``off_policy`` when it was
answered at another version than the one desired at its stamp (the last refit whose cut-over,
``status.weights.desired.effectiveAt``, is not after it; ``weights_boundary`` turns excepted; none
before the first refit). While the load runs the DisaggReplicaSet's status is sampled every
second: ``stale_ready_samples`` counts samples in which an engine shown ``ready`` reports another
``weightsVersion`` than the one desired at the sample's time, read as the engines do: the sample's
own ``status.weights.desired`` once its ``effectiveAt`` is not after the moment the sample was
asked for, else the refits so far (``desired_in``; before, a refit counted only from its trainer
pod's end, so samples between its cut-over and that end counted engines already at it as stale),
``untrue_samples`` those of them with no
``WeightsPending=True`` saying so, ``weights_pending_samples`` those where ``WeightsPending`` was
True. After the scenario, once the fleet is Ready again, ``engines_at_desired`` counts the engines
whose status digest is the desired one. ``forgotten_decode_killed`` is the control that shows the
bar can fail (run it last, after a refit): ``decode_killed`` with the fleet's desired-weights
annotation removed first, so the operator empties the weights ConfigMap's ``desired`` key and the
replacement starts at the base weights, as one that ignored the desired weights would.

Prints one JSON line: per scenario the load client's ``turns``, ``lost``, ``retried``, errors and
latency, ``event_s`` and ``event_after_load`` (the client had ended by the time the event was done:
the scenario tested nothing), and the weights figures above. A scenario that lost turns keeps its evidence before the
cluster goes (its path is the scenario's ``evidence``): the cluster's component logs (kubelet,
apiserver, kube-router, …), every pod's log in the fleet's namespace and the operator's (the
previous container's too), and the Events of all namespaces. Needs root and the real-node build
(``drs dev up --real-nodes``); wrap it in ``flock /tmp/drs-realnodes.lock`` where other real-node
work may run.

    python bench/chaos_realnodes.py [--seconds 40] [--scenarios frontend_killed,roll] [--no-standby]
    python bench/chaos_realnodes.py --scenarios refit,decode_killed,prefill_killed,forgotten_decode_killed
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from drs_devcluster import inpod
from drs_devcluster.testing import BENCH_REAL_PORT_BASE, REAL_STATE_DIR, RunningCluster, real_node_cluster
from drs_operator.api.constants import ANNOTATION_DESIRED_WEIGHTS, DEFAULT_MODEL_MOUNT_PATH
from drs_protocol import routes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.chaos_realnodes_sidecar import container_init
from bench.chaos_realnodes_weights import (
    NAME,
    NOTES,
    NS,
    PATHLESS,
    REFITS,
    RESUME_AFTER_S,
    SIDECAR_FORGOTTEN,
    SIDECAR_KILLED,
    TRAINER_S,
    UNADMITTED,
    StatusWatch,
    get_json,
    kill,
    kill_operator_mid_refit,
    kill_replica_pathless,
    kill_replica_pathless_unadmitted,
    kill_sidecar_mid_refit,
    pods,
    say,
    scale_up_pathless,
    wait,
    weights_figures,
)

ROOT = Path(__file__).resolve().parents[1]
LOAD = (ROOT / "examples" / "load_client.py").read_text()
TRAINER = (ROOT / "examples" / "trainer" / "refit_in_pod.py").read_text()
CLAIM = "checkpoints"
SCENARIOS = (
    "baseline",
    "prefill_killed",
    "decode_killed",
    "roll",
    "operator_killed",
    "frontend_killed",
    "frontend_process_killed",
    "refit",
    "forgotten_decode_killed",
)
STANDBY = [True]
#: the failing control: a kill with the desired weights removed from the resource first
FORGOTTEN = "forgotten_decode_killed"
#: ``spec.networkPolicy`` of the fleet (set when a path-less scenario runs)
POLICY = [False]


def fleet(checkpoints: bool) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "pod-network-sim.yaml").read_text())
    body["spec"]["frontend"]["standby"] = STANDBY[0]
    if checkpoints:  # the volume the trainer writes checkpoints into, mounted by every engine
        body["spec"]["model"]["volume"] = {"persistentVolumeClaim": {"claimName": CLAIM}}
    if POLICY[0]:  # each replica's engines: its own pods, the trainer pods' sidecars (and the operator's pods)
        trainers = [f"trainer-{n}" for n in range(1, 5)]
        body["spec"]["networkPolicy"] = {
            "enabled": True,
            "engineClients": [
                {"podSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": trainers}]}},
            ],
        }
    return body


def converged(cluster: RunningCluster) -> bool:
    body = get_json(cluster, "drs", NAME, "-n", NS)
    st = body.get("status") or {}
    fronts = [f for r in st.get("replicaStatuses") or [] for f in r["frontends"]]
    return bool(
        st.get("phase") == "Ready"
        and st.get("observedGeneration") == body["metadata"]["generation"]
        and fronts
        and all(f["ready"] and (f.get("standbyReady") or not STANDBY[0]) for f in fronts)
    )


METRICS = (
    "import sys, urllib.request; "
    "text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode(); "
    "print(sum(float(l.rsplit(' ', 1)[1]) for l in text.splitlines() if l.startswith('drs_frontend_requests_total{')))"
)


def served(cluster: RunningCluster, pod: dict[str, Any]) -> float:
    """A frontend pod's own count of answered requests (its /metrics, read from inside the pod)."""
    port = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
    url = f"http://{pod['status']['podIP']}:{port}{routes.METRICS}"
    return float(cluster.kubectl("exec", pod["metadata"]["name"], "-n", NS, "--", "python", "-c", METRICS, url).stdout)


def busy_frontends(cluster: RunningCluster) -> list[dict[str, Any]]:
    """Per URL, the pod the client's ClientIP affinity chose (the one that served its requests)."""
    by_url: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for pod in pods(cluster, f"disagg.dev/replicaset={NAME},disagg.dev/role=frontend"):
        by_url.setdefault(pod["metadata"]["labels"]["disagg.dev/replica"], []).append((served(cluster, pod), pod))
    return [max(candidates, key=lambda sp: sp[0])[1] for candidates in by_url.values()]


def kill_frontends(cluster: RunningCluster) -> None:
    kill(cluster, NS, busy_frontends(cluster))


def kill_frontend_processes(cluster: RunningCluster) -> None:
    """Per URL, the busy pod's frontend process killed (SIGKILL); the pod stays, its container restarts."""
    for pod in busy_frontends(cluster):
        [status] = pod["status"]["containerStatuses"]
        pid = container_init(status["containerID"])
        say(f"SIGKILL to {pod['metadata']['name']}'s frontend (host pid {pid}, restarts {status['restartCount']})")
        os.kill(pid, signal.SIGKILL)


def forget_desired(cluster: RunningCluster) -> None:
    """The failing control: the desired weights removed from the resource, and the weights
    ConfigMap's ``desired`` key emptied by the operator before the kill."""
    cluster.kubectl("annotate", "drs", NAME, "-n", NS, f"{ANNOTATION_DESIRED_WEIGHTS}-", check=False)

    def emptied() -> bool:
        data = get_json(cluster, "configmap", f"{NAME}-weights", "-n", NS).get("data") or {}
        return not data.get("desired")

    wait("the weights ConfigMap without desired weights", emptied, timeout=60)
    say("desired weights removed: the replacement is told none")


def kill_engine(role: str, forget: bool = False) -> Callable[[RunningCluster], None]:
    def event(cluster: RunningCluster) -> None:
        if forget:
            forget_desired(cluster)
        kill(cluster, NS, pods(cluster, f"disagg.dev/replicaset={NAME},disagg.dev/role={role},disagg.dev/replica=0"))

    return event


SPEED = [0.1]


def roll(cluster: RunningCluster) -> None:
    SPEED[0] = 0.12 if SPEED[0] == 0.1 else 0.1
    patch = {"spec": {"engine": {"simOptions": {"speed": SPEED[0]}}}}
    cluster.kubectl("patch", "drs", NAME, "-n", NS, "--type=merge", "-p", json.dumps(patch))
    say(f"rolling to sim speed {SPEED[0]}")


def roll_and_kill_operator(cluster: RunningCluster) -> None:
    roll(cluster)
    wait("the roll to begin", lambda: not converged(cluster), timeout=60)
    kill(cluster, "drs-system", get_json(cluster, "pods", "-n", "drs-system")["items"])


def refit(cluster: RunningCluster, during: Callable[[RunningCluster, str], None] | None = None) -> None:
    """The trainer's refit step as a pod, by checkpoint path; returns once the pod has ended and
    the desired weights (with their cut-over) are in the status. ``during(cluster, pod)``, when
    given, runs once the pod is applied (while it refits)."""
    name = f"trainer-{len(REFITS) + 1}"
    objs = inpod.trainer_objects(name, NS, NAME, TRAINER, CLAIM, DEFAULT_MODEL_MOUNT_PATH)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))
    say(f"{name}: refitting every engine by path")
    if during is not None:
        during(cluster, name)
    wait(
        f"{name} to end",
        lambda: get_json(cluster, "pod", name, "-n", NS)["status"].get("phase") in ("Succeeded", "Failed"),
        timeout=TRAINER_S,
    )
    out = cluster.kubectl("logs", name, "-n", NS, "-c", "trainer").stdout
    if get_json(cluster, "pod", name, "-n", NS)["status"]["phase"] != "Succeeded":
        raise SystemExit(f"{name} failed:\n{out}")
    desired = get_json(cluster, "drs", NAME, "-n", NS)["status"]["weights"]["desired"]
    at = datetime.fromisoformat(desired["effectiveAt"].replace("Z", "+00:00")).timestamp()
    REFITS.append((at, desired["version"]))
    say(f"{name}: desired {desired['version']} ({desired['digest'][:20]}…) from {desired['effectiveAt']}")


def engines_at_desired(cluster: RunningCluster) -> str | None:
    """``n/m``: the engines whose status digest is the desired one (None before any refit)."""
    st = get_json(cluster, "drs", NAME, "-n", NS)["status"]
    if not REFITS:
        return None
    digest = ((st.get("weights") or {}).get("desired") or {}).get("digest")
    engines = [e for r in st.get("replicaStatuses") or [] for e in r.get("engines") or []]
    held = sum(1 for e in engines if digest is not None and e.get("weightsDigest") == digest)
    return f"{held}/{len(engines)}"


EVENTS: dict[str, Callable[[RunningCluster], None]] = {
    "baseline": lambda cluster: None,
    "frontend_killed": kill_frontends,
    "frontend_process_killed": kill_frontend_processes,
    "prefill_killed": kill_engine("prefill"),
    "decode_killed": kill_engine("decode"),
    "operator_killed": roll_and_kill_operator,
    "roll": roll,
    "refit": refit,
    "refit_operator_killed": lambda cluster: refit(cluster, during=kill_operator_mid_refit),
    FORGOTTEN: kill_engine("decode", forget=True),
    "replica_killed_pathless": kill_replica_pathless,
    "scaled_up_pathless": scale_up_pathless,
    UNADMITTED: kill_replica_pathless_unadmitted,
    SIDECAR_KILLED: kill_sidecar_mid_refit,
    SIDECAR_FORGOTTEN: lambda cluster: kill_sidecar_mid_refit(cluster, forget=True),
}
#: the controls: scenarios whose fleet is not expected at the desired digest afterwards
CONTROLS = (FORGOTTEN, SIDECAR_FORGOTTEN)


def keep_evidence(cluster: RunningCluster, scenario: str) -> Path:
    """Copy what explains a lost turn out of the cluster before it is deleted: the component logs,
    the pods' logs (previous containers too) in the fleet's and the operator's namespaces, the Events."""
    out = Path(tempfile.mkdtemp(prefix=f"drs-chaos-real-{scenario}-"))
    shutil.copytree(cluster.cluster.layout.log_dir, out / "components", dirs_exist_ok=True)
    for ns in (NS, "drs-system"):
        for pod in get_json(cluster, "pods", "-n", ns)["items"]:
            name = pod["metadata"]["name"]
            for previous in ("", "--previous"):
                got = cluster.kubectl(
                    "logs", name, "-n", ns, "--all-containers", *filter(None, [previous]), check=False
                )
                if got.stdout:
                    (out / f"{ns}_{name}{previous.replace('--', '.')}.log").write_text(got.stdout)
    events = cluster.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", "-o", "wide", check=False).stdout
    (out / "events.txt").write_text(events)
    return out


def run_scenario(cluster: RunningCluster, scenario: str, seconds: float) -> dict[str, Any]:
    wait("the fleet Ready with a standby per URL", lambda: converged(cluster))
    pod = f"load-{scenario.replace('_', '-')}"
    args = ["--name", NAME, "--namespace", NS, "--seconds", str(seconds), "--sessions", "8", "--max-retries", "2"]
    args.append("--answers")
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(inpod.client_objects(pod, NS, LOAD, args)))
    wait(
        "the load client's first turn",
        lambda: "[load] started" in cluster.kubectl("logs", pod, "-n", NS, check=False).stdout,
    )
    time.sleep(5)
    began = time.monotonic()
    NOTES.clear()
    with StatusWatch(cluster) as watch:
        EVENTS[scenario](cluster)
        # an event that came after the client's load ended tested nothing: say so in the result
        late = get_json(cluster, "pod", pod, "-n", NS)["status"].get("phase") in ("Succeeded", "Failed")
        wait(
            "the load client to finish",
            lambda: get_json(cluster, "pod", pod, "-n", NS)["status"].get("phase") in ("Succeeded", "Failed"),
            timeout=seconds + 180,
        )
    out = cluster.kubectl("logs", pod, "-n", NS).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])["load"]
    result["event_s"] = round(time.monotonic() - began, 1)
    result["event_after_load"] = late
    result.update(weights_figures(result.pop("answers")), **watch.figures())
    result["desired"] = REFITS[-1][1] if REFITS else None
    result.update(NOTES)
    if NOTES.get("recovered") is False:  # its new engines never came Ready: the figures as they are
        result["engines_at_desired"] = engines_at_desired(cluster)
        result["evidence"] = str(keep_evidence(cluster, scenario))
        say(f"{scenario}: {json.dumps(result)}")
        return result
    wait("the fleet Ready again", lambda: converged(cluster))
    if scenario in CONTROLS or not REFITS:
        result["engines_at_desired"] = engines_at_desired(cluster)
    else:  # the replacement reaches them before it is Ready; the operator looks every 5 s
        wait("every engine's status digest the desired one", lambda: _all_at_desired(cluster), timeout=60)
        result["engines_at_desired"] = engines_at_desired(cluster)
    if result["lost"]:
        result["evidence"] = str(keep_evidence(cluster, scenario))
    say(f"{scenario}: {json.dumps(result)}")
    return result


def run_all(
    state_dir: Path, scenarios: list[str], seconds: float, results: dict[str, Any], cleanup: list[Path]
) -> None:
    """The cluster up, the chart and the fleet in it, every scenario in turn, the cluster down."""
    for cluster in real_node_cluster(state_dir, BENCH_REAL_PORT_BASE, nodes=1, net_offset=1):
        inpod.helm_install(cluster.cluster, release="drs", namespace="drs-system")
        cluster.kubectl("create", "namespace", NS)
        cluster.kubectl("wait", "--for=create", "serviceaccount/default", "-n", NS, "--timeout=60s")
        checkpoints = any(s.startswith("refit") or s in (SIDECAR_KILLED, SIDECAR_FORGOTTEN) for s in scenarios)
        if checkpoints:  # on this machine (every real node is): written by the trainer's non-root user
            host_dir = Path(tempfile.mkdtemp(prefix="drs-chaos-checkpoints-"))
            cleanup.append(host_dir)
            host_dir.chmod(0o777)
            objs = inpod.checkpoint_volume_objects(CLAIM, NS, host_dir)
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))
        cluster.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(fleet(checkpoints)))
        for scenario in scenarios:
            rolls = scenario in ("roll", "operator_killed")
            results[scenario] = run_scenario(cluster, scenario, seconds * (2 if rolls else 1))
            if results[scenario].get("recovered") is False:
                say(f"{scenario}: the fleet did not recover; the scenarios after it are not run")
                break


def _all_at_desired(cluster: RunningCluster) -> bool:
    held = engines_at_desired(cluster)
    return held is not None and held.split("/")[0] == held.split("/")[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="load per scenario (the roll scenarios double it)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--no-standby", action="store_true", help="spec.frontend.standby off (one process per URL)")
    parser.add_argument(
        "--resume-after",
        type=float,
        default=0.0,
        help="sidecar_killed_*: seconds from the kill to the new trainer pod (default 0: at once)",
    )
    args = parser.parse_args()
    STANDBY[0] = not args.no_standby
    RESUME_AFTER_S[0] = args.resume_after
    scenarios = [s for s in args.scenarios.split(",") if s]
    POLICY[0] = any(s in PATHLESS for s in scenarios)
    unknown = [s for s in scenarios if s not in EVENTS]
    if unknown:
        raise SystemExit(f"--scenarios: unknown {unknown}; known: {list(EVENTS)}")
    results: dict[str, Any] = {}
    load_start = list(os.getloadavg())
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    # the code the run starts with (HEAD may move while it runs)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    # beside the test session's real-node cluster: its own state dir, ports and pod network
    state_dir = REAL_STATE_DIR.with_name(REAL_STATE_DIR.name + "-chaos")
    cleanup: list[Path] = []
    try:
        run_all(state_dir, scenarios, args.seconds, results, cleanup)
    finally:
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)
    line = {
        "bench": "chaos_realnodes",
        "started_utc": started,
        "commit": commit.stdout.strip(),
        "load_avg": {"start": load_start, "end": list(os.getloadavg())},
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "fleet": f"examples/pod-network-sim.yaml, frontend.standby {STANDBY[0]}: 2 replicas x (1 prefill + "
        f"1 decode), 1 frontend URL each ({2 if STANDBY[0] else 1} process(es)), sim speed 0.1, pod networking, "
        "1 real node",
        "standby": STANDBY[0],
        "network_policy": POLICY[0],
        "client": "examples/load_client.py in a pod: 8 sessions, max_retries=2 (the OpenAI SDK default)",
        "scenarios": results,
        "lost_total": sum(r["lost"] for r in results.values()),
        "off_policy_total": sum(r["off_policy"] for r in results.values()),
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
