"""Token rotation on the kwok dev cluster, end to end, under continuous turns.

The operator mounts the fleet's two token Secrets into its pods (the pod runner projects Secret
volumes into each pod's directory and re-reads them every second, as a kubelet does on its sync).
With ``disagg.dev/token-rotation-window-seconds: "90"`` (:data:`WINDOW_S`), the test, while two
client threads send turns through the fleet's status URL without pause:

1. rotates twice (``kubectl annotate drs … disagg.dev/rotate-tokens=…``): each Secret goes through
   ``next`` and ``previous`` and ends with a new token alone;
2. deletes the serving Secret under the running fleet: the operator re-creates it as the first
   phase of a rotation (a Warning Event naming the pods) and finishes that rotation;
3. with the load stopped, stops the frontend's process (SIGSTOP: it cannot report what it read)
   and rotates again: ``status.tokenRotations`` names the serving Secret's phase ``next`` and the
   frontend pod, alone, as the pod it waits on; once the process runs again the rotation ends and
   ``tokenRotations`` is gone from the status.

Each rotation must end within :data:`ROTATION_S` (less than its two windows): the operator ends a
phase once every pod reported reading it in its ``/health`` answer, and says so in the Events.
Then: no turn failed; no pod was replaced or restarted; the engines refuse the serving and
control tokens of two rotations ago (401) and take the current ones; the Events name each
phase; and no token ever written appears in an Event, a ConfigMap, the status, the operator's
log or any pod's log.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from drs_devcluster.testing import RunningCluster
from drs_operator.manifests.rotation import secret_keys
from operator_harness import CHAT_BODY, OperatorProcess, auth_fleet, get_json, http_call, serving_fleet, wait_for

pytestmark = pytest.mark.cluster

NAME = "rotor"
PHASE = "disagg.dev/token-rotation-phase"
#: Each phase's window: a rotation that waited for it would take 2 windows; the pods report what
#: they read, so each rotation must end well before (:data:`ROTATION_S`).
WINDOW_S = 90
ROTATION_S = 60


def call(url: str, body: dict[str, Any] | None = None, token: str | None = None) -> int:
    return http_call(url, body, token)[0]


@dataclass
class Load:
    url: str
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                code = call(f"{self.url}/v1/chat/completions", CHAT_BODY)
            except OSError as exc:
                self.failed.append(repr(exc))
                continue
            if code == 200:
                self.ok += 1
            else:
                self.failed.append(str(code))


def secrets_of(devcluster: RunningCluster, namespace: str) -> dict[str, dict[str, Any]]:
    items = get_json(devcluster, "secrets", "-n", namespace)["items"]
    return {s["metadata"]["name"]: s for s in items if s["metadata"]["name"] in (f"{NAME}-serving", f"{NAME}-control")}


def rotated(devcluster: RunningCluster, namespace: str, before: dict[str, str]) -> dict[str, str] | None:
    """The two tokens once both Secrets hold a token other than ``before``'s and no phase."""
    found = secrets_of(devcluster, namespace)
    tokens = {}
    for name, secret in found.items():
        keys = secret_keys(secret)
        if PHASE in (secret["metadata"].get("annotations") or {}) or set(keys) - {"generation"} != {"token"}:
            return None
        tokens[name] = keys["token"]
    changed = len(tokens) == 2 and all(tokens[n] != before.get(n) for n in tokens if n in before)
    return tokens if changed else None


def pod_identity(devcluster: RunningCluster, namespace: str) -> dict[str, tuple[str, int]]:
    items = get_json(devcluster, "pods", "-n", namespace)["items"]
    return {
        p["metadata"]["name"]: (
            p["metadata"]["uid"],
            sum(c.get("restartCount", 0) for c in (p.get("status") or {}).get("containerStatuses") or []),
        )
        for p in items
    }


def rotations_shown(devcluster: RunningCluster, namespace: str) -> list[dict[str, Any]]:
    rotations: list[dict[str, Any]] = (
        get_json(devcluster, "drs", "-n", namespace, NAME)["status"].get("tokenRotations") or []
    )
    return rotations


def lagging_in_status(devcluster: RunningCluster, namespace: str, history: list[dict[str, str]]) -> None:
    """Step 3 of the module docstring: a frontend that cannot report is named in the status."""
    (frontend,) = [p for p in pod_identity(devcluster, namespace) if p.startswith(f"{NAME}-r0-f0-")]
    tracked = json.loads((devcluster.cluster.layout.state_dir / "runner-pids.json").read_text())
    (pid,) = [t["pid"] for t in tracked if t["name"] == f"pod {namespace}/{frontend}"]
    serving = f"{NAME}-serving"

    def waits_on_frontend() -> dict[str, Any] | None:
        shown = [r for r in rotations_shown(devcluster, namespace) if r["secret"] == serving]
        return shown[0] if shown and shown[0].get("laggingPods") == [frontend] else None

    os.killpg(pid, signal.SIGSTOP)
    try:
        devcluster.kubectl("annotate", "drs", "-n", namespace, NAME, "disagg.dev/rotate-tokens=r3", "--overwrite")
        shown = wait_for("the status to name the stopped frontend as lagging", waits_on_frontend, timeout=45)
    finally:
        os.killpg(pid, signal.SIGCONT)
    assert shown["phase"] == "next" and shown["laggingCount"] == 1 and shown["since"], shown
    history.append(wait_for("rotation r3 to finish", lambda: rotated(devcluster, namespace, history[-1]), ROTATION_S))
    wait_for("tokenRotations gone from the status", lambda: rotations_shown(devcluster, namespace) == [], timeout=30)


def test_rotations_and_a_deleted_secret_under_continuous_turns_lose_none(
    devcluster: RunningCluster, namespace: str, stack: OperatorProcess
) -> None:
    window = {"disagg.dev/token-rotation-window-seconds": str(WINDOW_S)}
    _, url = serving_fleet(
        devcluster, namespace, auth_fleet(NAME, base_port=18600, engine_port=18200, annotations=window)
    )
    first = {n: secret_keys(s)["token"] for n, s in secrets_of(devcluster, namespace).items()}
    pods_before = pod_identity(devcluster, namespace)

    load = Load(url)
    threads = [threading.Thread(target=load.run, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        history = [first]
        for request in ("r1", "r2"):
            devcluster.kubectl(
                "annotate", "drs", "-n", namespace, NAME, f"disagg.dev/rotate-tokens={request}", "--overwrite"
            )
            history.append(
                wait_for(
                    f"rotation {request} to finish",
                    lambda: rotated(devcluster, namespace, history[-1]),
                    timeout=ROTATION_S,
                )
            )
        turns_after_rotations = load.ok
        devcluster.kubectl("delete", "secret", "-n", namespace, f"{NAME}-serving")
        recreated = wait_for(
            "the serving Secret re-created and switched",
            lambda: rotated(devcluster, namespace, {f"{NAME}-serving": history[-1][f"{NAME}-serving"]}),
            timeout=ROTATION_S,
        )
        history.append(recreated)
        wait_for("turns after the re-creation", lambda: load.ok > turns_after_rotations + 20, timeout=60)
    finally:
        load.stop.set()
        for thread in threads:
            thread.join(timeout=60)
    print(f"rotation on the cluster: {load.ok} turns, {len(load.failed)} failed")
    assert load.failed == [], load.failed[:5]
    assert load.ok > 0

    assert pod_identity(devcluster, namespace) == pods_before  # nothing restarted or replaced
    lagging_in_status(devcluster, namespace, history)

    status = get_json(devcluster, "drs", "-n", namespace, NAME)["status"]
    engines = {e["role"]: e["url"] for e in status["replicaStatuses"][0]["engines"]}
    serving, control = f"{NAME}-serving", f"{NAME}-control"
    now, old = history[-1], history[0]
    assert call(f"{engines['prefill']}/v1/models", token=old[serving]) == 401
    assert call(f"{engines['prefill']}/v1/models", token=now[serving]) == 200
    assert call(f"{engines['decode']}/control/weights", token=old[control]) == 401
    assert call(f"{engines['decode']}/control/weights", token=now[control]) == 200

    events = get_json(devcluster, "events", "-n", namespace)["items"]
    reasons = {e["reason"] for e in events}
    assert {"TokenRotationStarted", "TokenRotationSwitched", "TokenRotationDone", "TokenSecretRecreated"} <= reasons
    early = [e for e in events if e["reason"] in ("TokenRotationSwitched", "TokenRotationDone")]
    assert early and all("every pod that mounts it read the phase" in e["message"] for e in early), early

    every_token = {t for tokens in history for t in tokens.values()}
    public = json.dumps([events, get_json(devcluster, "configmaps", "-n", namespace), status])
    logs = [stack.log, *Path(devcluster.cluster.layout.state_dir, "pods").glob(f"{namespace}_*/log")]
    text = public + "".join(Path(p).read_text(errors="replace") for p in logs)
    assert len(logs) >= 4 and not [t for t in every_token if t in text]
