"""Benchmark: turns lost and turn latency while the fleet is rolled, refitted and broken.

Not a test (``tests/cluster/test_chaos.py`` runs a short version). On the local control plane with
the pod runner (every pod a real process on its node's loopback address), a sim fleet like
``make demo``'s (2 replicas x 1 prefill + 1 decode, 2 frontends each, host networking) serves
Gym-shaped clients: each session picks ``status.urls[sha256(session) % len(urls)]`` and runs 6
turns, re-sending the growing conversation; a turn that gets a 5xx or no connection is retried (up
to 5 attempts, back-off 0.5 s doubling), as NeMo-Gym's client does. Scenarios, one after the other,
each with the load running before, during and after the event:

* ``baseline`` — nothing happens (the latency reference of the same run);
* ``roll`` — a spec change that replaces every engine pod (one replica at a time);
* ``refit`` — new weights through the trainer's sidecar (``drs sidecar``, ``POST /v1/refit``), which
  announces the target weights to every engine before it loads any (engines not loaded yet refuse
  new legs, the frontends hold them for an engine that holds the target: ``docs/weights.md``);
* ``refit_unannounced`` — the same with the sidecar's announcing off (``--target-lease 0``): the
  refit as it was before the announce, the reference for ``off_policy`` in the same run;
* ``refit_pathless`` — a path-less refit, as a broadcast leaves it: the example trainer
  (``examples/trainer/trainer.py --backend gloo``, a random ``tiny`` model on the CPU) broadcasts
  its packed weights over a real gloo group through the sidecar's collective steps, and every sim
  engine receives them (``drs_engine/backends/sim/collective.py``); the desired weights then have a
  digest and no checkpoint path;
* ``decode_killed_pathless`` — after it, the decode engine pod of replica 0 deleted with grace 0:
  its replacement has no path to load and must catch up from a serving peer (the weights
  ConfigMap's peers); the scenario records where it got them (``catch_up.reached_from``);
* ``prefill_killed`` / ``decode_killed`` — an engine pod of replica 0 deleted with grace 0 (a crash);
* ``frontend_killed`` — frontend 0 of replica 0 deleted with grace 0 (its Deployment brings it back);
  this and the engine kills add ``replacement``: when the replacement pod was created, its
  container started and it was Ready, in seconds after the kill (the API's whole-second stamps),
  and when this bench saw it Ready;
* ``operator_killed`` — a roll, with the operator SIGKILLed once the roll has begun and restarted.

Prints one JSON line: per scenario the turns attempted and failed, turns that needed a retry,
``off_policy`` (answered turns whose weights version — ``x-drs-weights-version`` — differs from the
fleet's desired version when the fleet received the turn: its stamp, ``x-drs-turn-started``, as
the answer returns it, against the last refit whose cut-over — the sidecar's ``effective_at``, or
the trainer's call when the refit announced none — is not after it; turns marked
``weights_boundary`` are excepted, and before the first refit nothing is desired), ``unstamped``
(answered turns with no stamp, judged by the client's clock instead), ``boundary`` (turns marked
``weights_boundary``) and p50/p99 turn latency (first attempt to answer), plus each scenario's p50
over the baseline's; a refit scenario adds the sidecar's report's ``target_announced_s`` (from its
refit's start until every engine had been told the target; None when announcing is off),
``cutover_margin_s``, ``announce_exceeded_margin`` and ``late_legs`` (``drs_protocol.cutover``),
and ``off_policy_started_ms_after_cutover`` (each off-policy turn: how long after the cut-over
its stamp is).

The path-less scenarios model the transfer with a real gloo broadcast of the trainer's bytes into
the sim engines' host memory and a real HTTP weights stream between engines; not modelled: NCCL,
GPU memory, CUDA IPC, and a real engine's time to apply the bytes (the sim's latency model only).

``bench/chaos_realnodes.py`` is the same experiment on the real-node cluster (pod networking, a
client pod retrying as the OpenAI SDK does, ``frontend.standby`` on).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "cluster"))
sys.path.insert(0, str(ROOT))

from drs_devcluster import build  # noqa: E402
from drs_devcluster.cluster import DevCluster  # noqa: E402
from drs_devcluster.testing import RunningCluster, pod_runner  # noqa: E402
from drs_operator.api.constants import ANNOTATION_DESIRED_WEIGHTS  # noqa: E402
from drs_protocol import routes  # noqa: E402
from drs_protocol.weights_digest import digest_files  # noqa: E402
from drs_protocol.weights_state import parse_desired_weights  # noqa: E402
from drs_sidecar.targets import DEFAULT_LEASE_S as DEFAULT_TARGET_LEASE_S  # noqa: E402
from operator_harness import OperatorProcess, apply, free_port, get_json, wait_for  # noqa: E402

from bench.chaos_load import ATTEMPTS, TURNS_PER_SESSION, Load, off_policy_delays, summarize  # noqa: E402

NAME = "chaos"
SCENARIOS = (
    "baseline",
    "roll",
    "refit_unannounced",
    "refit",
    "prefill_killed",
    "decode_killed",
    "refit_pathless",
    "decode_killed_pathless",
    "frontend_killed",
    "operator_killed",
)
DRS = str(Path(sys.executable).parent / "drs")
#: The refit scenarios and their sidecar's ``--target-lease`` (0: no announce, the reference).
REFIT_LEASES = {"refit_unannounced": 0.0, "refit": DEFAULT_TARGET_LEASE_S}


def fleet(speed: float) -> dict[str, Any]:
    """``make demo``'s fleet (examples/local-sim.yaml) under another name; ``speed`` rolls it."""
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggReplicaSet",
        "metadata": {"name": NAME},
        "spec": {
            "replicas": 2,
            "model": {"path": "sim-qwen3", "maxModelLen": 32768},
            "engine": {"backend": "sim", "simOptions": {"speed": speed}, "drainSeconds": 8},
            "prefill": {"engines": 1, "tensorParallelSize": 1},
            "decode": {"engines": 1, "tensorParallelSize": 1},
            "frontend": {"workers": 2, "basePort": 8300},
            "router": {"ctx": "conversation", "gen": "load_balancing"},
            "trtllm": {"enginePort": 8000},
            "network": {"hostNetwork": True},
            "images": {"engine": "drs:dev", "frontend": "drs:dev", "pullPolicy": "Never"},
        },
    }


# -- the fleet and its events -------------------------------------------------------------------


@dataclass
class Fleet:
    rc: RunningCluster
    namespace: str
    operator: OperatorProcess
    workdir: Path
    speed: float = 0.1
    sidecar: subprocess.Popen[bytes] | None = None
    sidecar_url: str = ""
    #: the running sidecar's ``--target-lease`` (0: it announces no target)
    sidecar_lease: float | None = None
    #: the last refit's report (the sidecar's answer)
    last_report: dict[str, Any] = field(default_factory=dict)
    #: (wall-clock instant a refit's weights became desired, its version), in order: its cut-over
    #: (``effective_at`` in the sidecar's report), or the trainer's call where it has none (no announce)
    refits: list[tuple[float, str]] = field(default_factory=list)

    def desired_at(self, when: float) -> str | None:
        """The desired weights version at ``when`` (wall clock; None before the first refit)."""
        return next((v for t, v in reversed(self.refits) if t <= when), None)

    def kubectl(self, *args: str, input: str | None = None) -> str:
        return self.rc.kubectl(*args, "-n", self.namespace, input=input).stdout

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = get_json(self.rc, "drs", "-n", self.namespace, NAME)
        return body

    def ready_at_generation(self) -> dict[str, Any] | None:
        body = self.body()
        st = body.get("status") or {}
        ok = st.get("observedGeneration") == body["metadata"]["generation"] and st.get("phase") == "Ready"
        return st if ok else None

    def wait_ready(self, timeout: float = 180.0) -> dict[str, Any]:
        st: dict[str, Any] = wait_for(f"{NAME} Ready at its generation", self.ready_at_generation, timeout)
        return st

    def wait_serving(self, urls: list[str], timeout: float = 120.0) -> None:
        def all_ready() -> bool:
            for url in urls:
                try:
                    with urllib.request.urlopen(f"{url}{routes.READY}", timeout=2) as resp:
                        if resp.status != 200:
                            return False
                except OSError:
                    return False
            return True

        wait_for("every frontend to answer /ready", all_ready, timeout)

    def roll(self) -> None:
        self.speed = round(self.speed + 0.01, 3)
        apply(self.rc, self.namespace, fleet(self.speed))

    def roll_started(self) -> bool:
        """An engine pod of the old spec is being replaced (deleted or already recreated)."""
        st = self.body().get("status") or {}
        progressing: dict[str, Any] = next((c for c in st.get("conditions", []) if c["type"] == "Progressing"), {})
        return "rolling replica" in str(progressing.get("message", ""))

    def pods(self, selector: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = get_json(self.rc, "pods", "-n", self.namespace, "-l", selector)["items"]
        return items

    def kill_pod(self, selector: str) -> str:
        """Delete the first pod matching ``selector`` with grace 0 (a crash); its uid."""
        pod = self.pods(selector)[0]
        self.kubectl("delete", "pod", pod["metadata"]["name"], "--grace-period=0", "--force", "--wait=false")
        return str(pod["metadata"]["uid"])

    def wait_replaced(self, selector: str, old_uid: str, timeout: float = 120.0) -> None:
        """Until a pod matching ``selector`` other than ``old_uid`` is Ready (the runner's real probe)."""

        def replaced() -> bool:
            return any(
                p["metadata"]["uid"] != old_uid
                and not p["metadata"].get("deletionTimestamp")
                and any(
                    c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (p.get("status") or {}).get("conditions") or []
                )
                for p in self.pods(selector)
            )

        wait_for(f"a replacement for pod {old_uid}", replaced, timeout)

    def start_sidecar(self, target_lease: float = DEFAULT_TARGET_LEASE_S) -> None:
        """A sidecar announcing targets with ``target_lease`` (0: none); one running with another
        lease is stopped first (its desired weights are on the resource: the new one restores them)."""
        if self.sidecar is not None and self.sidecar.poll() is None:
            if self.sidecar_lease == target_lease:
                return
            self.sidecar.terminate()
            self.sidecar.wait(30)
        port = free_port()
        log = (self.workdir / "sidecar.log").open("ab")
        argv = [DRS, "sidecar", "--name", NAME, "--namespace", self.namespace, "--port", str(port)]
        argv += ["--target-lease", str(target_lease)]
        self.sidecar_lease = target_lease
        self.sidecar = subprocess.Popen(argv, env=self.rc.env, stdout=log, stderr=subprocess.STDOUT)
        self.sidecar_url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{self.sidecar_url}{routes.HEALTHZ}", timeout=2):
                    return True
            except OSError:
                return False

        wait_for("the sidecar", healthy, 60)

    def refit(self, version: str) -> dict[str, Any]:
        checkpoint = self.workdir / "checkpoints" / version
        checkpoint.mkdir(parents=True, exist_ok=True)
        (checkpoint / "model.safetensors").write_bytes(os.urandom(64))
        body = {"path": str(checkpoint), "version": version, "digest": digest_files(checkpoint)}
        request = urllib.request.Request(
            f"{self.sidecar_url}{routes.TrainerRoute.REFIT}",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        called = time.time()
        with urllib.request.urlopen(request, timeout=120) as resp:
            report: dict[str, Any] = json.loads(resp.read())
        self.last_report = report
        self.refits.append((report.get("effective_at") or called, version))
        return report

    def refit_pathless(self, seed: int) -> dict[str, Any]:
        """The example trainer's gloo broadcast through the sidecar (no checkpoint path); the
        trainer's report, with the cut-over the sidecar stored in the desired weights."""
        version = f"bcast-{seed}"
        argv = [sys.executable, str(ROOT / "examples" / "trainer" / "trainer.py"), "--sidecar", self.sidecar_url]
        argv += ["--backend", "gloo", "--model", "random:tiny", "--seed", str(seed), "--version", version]
        argv += ["--device", "cpu", "--precision", "float32", "--ip", "127.0.0.1", "--collective-timeout", "60"]
        called = time.time()
        done = subprocess.run(argv, env=self.rc.env, capture_output=True, text=True, timeout=180, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the trainer failed ({done.returncode}): {done.stderr[-2000:]}")
        report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        annotation = (self.body()["metadata"].get("annotations") or {}).get(ANNOTATION_DESIRED_WEIGHTS)
        desired = parse_desired_weights(annotation)
        if desired is None or desired.version != version or desired.path is not None:
            raise RuntimeError(f"the desired weights after a path-less refit are {annotation!r}")
        report["effective_at"] = desired.effective_at
        self.last_report = report
        self.refits.append((desired.effective_at or called, version))
        return report

    def engine_weights(self, pod: dict[str, Any]) -> dict[str, Any]:
        """What an engine pod answers ``GET /control/weights`` (the fleet's control token)."""
        secret = get_json(self.rc, "secret", "-n", self.namespace, f"{NAME}-control")
        token = base64.b64decode(secret["data"]["token"]).decode()
        name = pod["metadata"]["name"]
        replicas = (self.body().get("status") or {}).get("replicaStatuses") or []
        url = next(e["url"] for r in replicas for e in r["engines"] if e["name"] == name)
        request = urllib.request.Request(f"{url}{routes.CONTROL_WEIGHTS}", headers={"authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
        return answer

    def restart_operator(self) -> None:
        self.operator.kill(signal.SIGKILL)
        time.sleep(2.0)  # the operator stays down for a while, as a crashed pod would before its restart
        self.operator = OperatorProcess(self.rc, self.operator.log).start()

    def close(self) -> None:
        if self.sidecar is not None and self.sidecar.poll() is None:
            self.sidecar.terminate()
            self.sidecar.wait(30)
        log = self.workdir / "sidecar.log"
        if log.exists():  # the work dir goes with the cluster: keep the sidecar's log beside it
            shutil.copy(log, log.parent.with_name(f"{log.parent.name}-sidecar.log"))


def scenario_event(fleet_: Fleet, name: str) -> Callable[[], None]:
    """What happens in scenario ``name`` (returns once the fleet has recovered)."""
    sel = f"disagg.dev/replicaset={NAME},disagg.dev/replica=0"

    def roll() -> None:
        fleet_.roll()
        fleet_.wait_ready()

    def refit(target_lease: float) -> Callable[[], None]:
        def run() -> None:
            fleet_.start_sidecar(target_lease)
            report = fleet_.refit(time.strftime("step-%H%M%S"))
            if not report.get("complete"):
                raise RuntimeError(f"refit incomplete: {report}")

        return run

    def killed(role: str, extra: str = "") -> Callable[[], None]:
        def kill() -> None:
            selector = f"{sel},disagg.dev/role={role}{extra}"
            killed_at, began = time.time(), time.monotonic()
            old_uid = fleet_.kill_pod(selector)
            fleet_.wait_replaced(selector, old_uid)
            replaced_s = time.monotonic() - began
            pod = next(p for p in fleet_.pods(selector) if p["metadata"]["uid"] != old_uid)
            fleet_.last_report = {"replacement": replacement_timeline(pod, killed_at, replaced_s)}
            fleet_.wait_ready()

        return kill

    def refit_pathless() -> None:
        fleet_.start_sidecar(DEFAULT_TARGET_LEASE_S)
        report = fleet_.refit_pathless(int(time.time()) % 100_000)
        if report.get("engines_ok") != 4:
            raise RuntimeError(f"path-less refit reached {report.get('engines_ok')} of 4 engines: {report}")

    def decode_killed_pathless() -> None:
        selector = f"{sel},disagg.dev/role=decode"
        old_uid = fleet_.kill_pod(selector)
        fleet_.wait_replaced(selector, old_uid)
        fleet_.wait_ready()
        pod = next(p for p in fleet_.pods(selector) if p["metadata"]["uid"] != old_uid)
        held = fleet_.engine_weights(pod)
        fleet_.last_report = {"replacement_weights": held}

    def operator_killed() -> None:
        fleet_.roll()
        wait_for("the roll to begin", fleet_.roll_started, 60)
        fleet_.restart_operator()
        fleet_.wait_ready()

    events: dict[str, Callable[[], None]] = {
        "baseline": lambda: None,
        "roll": roll,
        "refit_unannounced": refit(REFIT_LEASES["refit_unannounced"]),
        "refit": refit(REFIT_LEASES["refit"]),
        "prefill_killed": killed("prefill"),
        "decode_killed": killed("decode"),
        "frontend_killed": killed("frontend", ",disagg.dev/frontend=0"),
        "operator_killed": operator_killed,
        "refit_pathless": refit_pathless,
        "decode_killed_pathless": decode_killed_pathless,
    }
    return events[name]


def replacement_timeline(pod: dict[str, Any], killed_at: float, replaced_s: float) -> dict[str, Any]:
    """When a killed pod's replacement was created, started and Ready, in seconds after the kill
    (the API's timestamps: whole seconds), and when this bench saw it Ready (``replaced_s``)."""

    def after(stamp: str | None) -> float | None:
        if not stamp:
            return None
        return round(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() - killed_at, 1)

    status = pod.get("status") or {}
    ready: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    running = ((status.get("containerStatuses") or [{}])[0].get("state") or {}).get("running") or {}
    return {
        "created_s": after(pod["metadata"].get("creationTimestamp")),
        "started_s": after(running.get("startedAt")),
        "ready_s": after(ready.get("lastTransitionTime")),
        "seen_ready_s": round(replaced_s, 1),
    }


def run_scenarios(
    fleet_: Fleet, names: tuple[str, ...], clients: int, settle_s: float, say: Callable[[str], None] = print
) -> dict[str, dict[str, Any]]:
    """Each scenario under load: ``settle_s`` of load, the event until recovery, ``settle_s`` more."""
    results: dict[str, dict[str, Any]] = {}
    urls: list[str] = fleet_.wait_ready()["urls"]
    fleet_.wait_serving(urls)
    for name in names:
        if name in REFIT_LEASES:  # the sidecar of the scenario runs before its load does (not restarted mid-way)
            fleet_.start_sidecar(REFIT_LEASES[name])
        load = Load(urls, clients).start()
        started = time.monotonic()
        time.sleep(settle_s)
        fleet_.last_report = {}  # what this scenario's event reports, nothing of the one before
        scenario_event(fleet_, name)()
        fleet_.wait_serving(urls)
        time.sleep(settle_s)
        turns = load.stop()
        results[name] = {**summarize(turns, fleet_.desired_at), "seconds": round(time.monotonic() - started, 1)}
        if name == "refit_pathless":
            for key in ("version", "digest", "effective_at", "backend", "bytes", "engines_ok"):
                results[name][key] = fleet_.last_report.get(key)
            results[name]["trainer_retried"] = fleet_.last_report.get("retried")  # its group re-formed once
            results[name]["off_policy_started_ms_after_cutover"] = off_policy_delays(turns, fleet_.refits)
        elif name.startswith("refit"):
            for key in ("target_announced_s", "cutover_margin_s", "announce_exceeded_margin", "late_legs"):
                results[name][key] = fleet_.last_report.get(key)
            results[name]["off_policy_started_ms_after_cutover"] = off_policy_delays(turns, fleet_.refits)
        elif name.endswith("_killed") and "replacement" in fleet_.last_report:
            results[name]["replacement"] = fleet_.last_report["replacement"]
        elif name == "decode_killed_pathless":
            held = fleet_.last_report.get("replacement_weights") or {}
            catch_up = held.get("catch_up") or {}
            results[name]["replacement"] = {
                "weights_version": held.get("weights_version"),
                "weights_digest": held.get("weights_digest"),
                "catch_up_source": catch_up.get("source"),
                "reached_from": catch_up.get("reached_from"),
            }
        say(f"[chaos] {name}: {json.dumps(results[name])}")
    return results


@contextlib.contextmanager
def deployed(rc: RunningCluster, namespace: str, workdir: Path) -> Iterator[Fleet]:
    """The CRD, the pod runner, an operator and the fleet, Ready; everything stopped afterwards."""
    rc.install_crd()
    with pod_runner(rc.cluster):  # stopped afterwards only if started here
        operator = OperatorProcess(rc, workdir / "operator.log").start()
        f = Fleet(rc, namespace, operator, workdir)
        try:
            apply(rc, namespace, fleet(f.speed))
            f.wait_ready()
            yield f
        finally:
            f.close()
            rc.kubectl("delete", "drs", NAME, "-n", namespace, "--ignore-not-found", "--wait=false", check=False)
            f.operator.kill(signal.SIGTERM)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds of load before and after each event")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--port-base", type=int, default=int(os.environ.get("DRS_CHAOS_PORT_BASE", "25600")))
    args = parser.parse_args()
    names = tuple(s for s in args.scenarios.split(",") if s)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {unknown}; choose from {', '.join(SCENARIOS)}")

    state = Path(tempfile.gettempdir()) / f"drs-chaos-{args.port_base}"
    cluster = DevCluster.at(state, args.port_base, bin_dir=build.bin_dir())
    cluster.down()
    cluster = DevCluster.at(state, args.port_base, bin_dir=build.bin_dir())
    cluster.up("hgx", 4)
    rc = RunningCluster(cluster)
    try:
        with deployed(rc, "default", state) as f:
            results = run_scenarios(f, names, args.clients, args.settle, say=lambda m: print(m, file=sys.stderr))
    finally:
        cluster.down()  # stops the pod runner too
    base = (results.get("baseline") or {}).get("p50_ms")
    for r in results.values():
        r["p50_over_baseline"] = round(r["p50_ms"] / base, 2) if base and r.get("p50_ms") else None
    line = {
        "bench": "chaos",
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "fleet": "2 replicas x (1 prefill + 1 decode), 2 frontends each, sim speed 0.1, host networking",
        "clients": args.clients,
        "turns_per_session": TURNS_PER_SESSION,
        "client_attempts": ATTEMPTS,
        "scenarios": results,
        "failed_total": sum(r["failed"] for r in results.values()),
        "off_policy_total": sum(r["off_policy"] for r in results.values()),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
