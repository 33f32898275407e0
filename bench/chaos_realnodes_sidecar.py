"""The trainer pod killed mid-refit, for ``bench/chaos_realnodes.py`` and ``tests/realnodes``.

The trainer's refit step as a pod (``examples/trainer/refit_in_pod.py`` beside ``drs sidecar``,
whose ``--concurrency 1`` loads one engine at a time, so the refit has engines still to load when
it dies) is applied; as soon as its sidecar has stored the new desired weights on the resource
(the refit has begun), the sidecar's process is killed (SIGKILL from the host, found by its
container id) and the pod deleted with grace 0. Which engines the dead sidecar had loaded is
asked of each engine (``held_after_kill``). Then a new trainer pod
(``examples/trainer/resume_in_pod.py``) runs a new sidecar, which reads the desired weights back
from the resource and loads them on the engines behind; its trainer only waits for the status to
show the version on every engine.

The control models desired weights that were never durable, as a sidecar that kept them only in
memory would leave them: the operator is stopped (:func:`operator_stopped`: its Deployment scaled
to 0) before the refit, so the store reaches neither the weights ConfigMap nor, through it, any
engine's mounted file; after the kill the stored annotation is removed (:func:`unstore`) and the
operator started again (:func:`await_forgotten`: it empties the ConfigMap's ``desired``). Removing
the annotation with the operator running (the control before) came too late: the operator touches
the engine pods when the desired weights change, so every engine's file named them within seconds
of the store, and the engines followed them once the dead sidecar's lease lapsed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from drs_devcluster import inpod
from drs_devcluster.testing import RunningCluster
from drs_operator.api.constants import ANNOTATION_DESIRED_WEIGHTS, DEFAULT_MODEL_MOUNT_PATH
from drs_protocol.weights_state import DesiredWeights

ROOT = Path(__file__).resolve().parents[1]
TRAINER = (ROOT / "examples" / "trainer" / "refit_in_pod.py").read_text()
RESUME = (ROOT / "examples" / "trainer" / "resume_in_pod.py").read_text()
CLAIM = "checkpoints"
#: how long the refit may take to store its desired weights, and the new trainer pod to end
STORE_S = 240.0
RESUME_S = 90.0
SIDECAR = "refit-sidecar"
#: the operator's namespace (the chart's), and how long its pods may take to go, or to come back and act
OPERATOR_NS = "drs-system"
OPERATOR_S = 180.0


def container_init(container_id: str) -> int:
    """The host pid of a container's first process: the process in the container's cgroup whose
    pid in its own namespace is 1 (``NSpid`` of ``/proc/<pid>/status``)."""
    cid = container_id.split("://", 1)[-1]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if cid not in (proc / "cgroup").read_text():
                continue
            nspid = next(line for line in (proc / "status").read_text().splitlines() if line.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        if nspid.split()[-1] == "1":
            return int(proc.name)
    raise SystemExit(f"no process of container {cid} found in /proc")


def _get(cluster: RunningCluster, *args: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
    return body


def stored(cluster: RunningCluster, ns: str, drs: str) -> DesiredWeights | None:
    """The desired weights on the resource (its annotation), None when there are none."""
    annotations = _get(cluster, "drs", drs, "-n", ns)["metadata"].get("annotations") or {}
    text = annotations.get(ANNOTATION_DESIRED_WEIGHTS)
    return DesiredWeights.model_validate_json(text) if text else None


def trainer_pod(
    name: str, ns: str, drs: str, script: str, sidecar_args: tuple[str, ...] = (), trainer_args: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """``inpod.trainer_objects`` with arguments added to the sidecar's and the trainer's commands."""
    objs = inpod.trainer_objects(name, ns, drs, script, CLAIM, DEFAULT_MODEL_MOUNT_PATH)
    pod = next(o for o in objs if o["kind"] == "Pod")
    pod["spec"]["initContainers"][0]["command"] += list(sidecar_args)
    pod["spec"]["containers"][0]["command"] += list(trainer_args)
    return objs


def sidecar_container(cluster: RunningCluster, ns: str, pod: str) -> str | None:
    """The container id of the pod's running sidecar (None: not running yet)."""
    statuses = _get(cluster, "pod", pod, "-n", ns)["status"].get("initContainerStatuses") or []
    return next((s.get("containerID") for s in statuses if s["name"] == SIDECAR and "running" in s["state"]), None)


@dataclass
class CutShort:
    """A refit whose trainer pod was killed: the desired weights it had stored, and when."""

    desired: DesiredWeights
    #: seconds from the SIGKILL to the refit's cut-over (``effective_at``; negative: after it)
    kill_to_cutover_s: float | None
    #: engine -> the version it answered right after the kill (GET /control/weights)
    held_after_kill: dict[str, str | None] = field(default_factory=dict)


def held_versions(cluster: RunningCluster, ns: str, drs: str) -> dict[str, str | None]:
    """Each engine's own ``GET /control/weights`` version, asked from inside its pod."""
    st = _get(cluster, "drs", drs, "-n", ns).get("status") or {}
    out: dict[str, str | None] = {}
    for engine in [e for r in st.get("replicaStatuses") or [] for e in r.get("engines") or []]:
        got = cluster.kubectl(
            "exec", engine["name"], "-n", ns, "--", *inpod.held_weights_command(engine["url"]), check=False
        )
        out[engine["name"]] = json.loads(got.stdout).get("weights_version") if got.returncode == 0 else None
    return out


def kill_trainer_mid_refit(cluster: RunningCluster, ns: str, drs: str, name: str) -> CutShort:
    """Trainer pod ``name`` refits by path, one engine at a time; once its sidecar has stored the
    new desired weights, the sidecar is SIGKILLed and the pod deleted (grace 0)."""
    before = stored(cluster, ns, drs)
    objs = trainer_pod(name, ns, drs, TRAINER, sidecar_args=("--concurrency", "1"))
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))
    deadline = time.monotonic() + STORE_S
    container = None
    while (container := container or sidecar_container(cluster, ns, name)) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: its sidecar not running after {STORE_S:.0f}s")
        time.sleep(0.2)
    pid = container_init(container)
    while (now := stored(cluster, ns, drs)) == before or now is None:  # back to back: ~0.1-0.3 s apart
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: no new desired weights stored after {STORE_S:.0f}s")
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    cluster.kubectl("delete", "pod", name, "-n", ns, "--grace-period=0", "--force")
    lead = None if now.effective_at is None else round(now.effective_at - killed_at, 3)
    return CutShort(now, lead, held_versions(cluster, ns, drs))


def _until(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not reached after {timeout:.0f}s")
        time.sleep(1.0)


@contextlib.contextmanager
def operator_stopped(cluster: RunningCluster) -> Iterator[None]:
    """The control: the operator's Deployment scaled to 0 for the block (its pod gone; it gives its
    Lease up on the way out), then back to its replicas. Meanwhile nothing copies stored desired
    weights into the weights ConfigMap or touches the engine pods."""
    [deployment] = cluster.kubectl("get", "deployment", "-n", OPERATOR_NS, "-o", "name").stdout.split()
    replicas = int(_get(cluster, deployment, "-n", OPERATOR_NS)["spec"]["replicas"])
    cluster.kubectl("scale", deployment, "-n", OPERATOR_NS, "--replicas=0")
    _until("the operator's pods gone", lambda: not _get(cluster, "pods", "-n", OPERATOR_NS)["items"], OPERATOR_S)
    try:
        yield
    finally:
        cluster.kubectl("scale", deployment, "-n", OPERATOR_NS, f"--replicas={replicas}")


def configmap_desired(cluster: RunningCluster, ns: str, drs: str) -> str | None:
    """The version of the desired weights the weights ConfigMap holds (what the engines' files will
    name; None: none)."""
    text = (_get(cluster, "configmap", f"{drs}-weights", "-n", ns).get("data") or {}).get("desired")
    return str(json.loads(text).get("version")) if text else None


def unstore(cluster: RunningCluster, ns: str, drs: str) -> str | None:
    """The control, the operator stopped: the stored desired weights removed from the resource.
    Returns the version the weights ConfigMap named then (the store never reached it: the one before)."""
    cluster.kubectl("annotate", "drs", drs, "-n", ns, f"{ANNOTATION_DESIRED_WEIGHTS}-", check=False)
    return configmap_desired(cluster, ns, drs)


def await_forgotten(cluster: RunningCluster, ns: str, drs: str) -> None:
    """The control, the operator started again: wait until it has emptied the ConfigMap's ``desired``."""
    _until("the weights ConfigMap without desired weights", lambda: not configmap_desired(cluster, ns, drs), OPERATOR_S)


def resume(cluster: RunningCluster, ns: str, drs: str, name: str, version: str) -> tuple[str, str]:
    """A new trainer pod whose sidecar restores the desired weights; (its phase, its trainer's log)."""
    objs = trainer_pod(name, ns, drs, RESUME, trainer_args=("--version", version, "--timeout", str(RESUME_S)))
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))
    deadline = time.monotonic() + RESUME_S + 120
    while (phase := _get(cluster, "pod", name, "-n", ns)["status"].get("phase")) not in ("Succeeded", "Failed"):
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: not ended after {RESUME_S + 120:.0f}s")
        time.sleep(1.0)
    return phase, cluster.kubectl("logs", name, "-n", ns, "-c", "trainer", check=False).stdout


def engines_at(cluster: RunningCluster, ns: str, drs: str, digest: str | None) -> str:
    """``n/m``: the engines whose status digest is ``digest``."""
    st = _get(cluster, "drs", drs, "-n", ns).get("status") or {}
    engines = [e for r in st.get("replicaStatuses") or [] for e in r.get("engines") or []]
    return f"{sum(1 for e in engines if digest and e.get('weightsDigest') == digest)}/{len(engines)}"
