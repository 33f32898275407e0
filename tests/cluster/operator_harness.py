"""Running the real operator (``drs operator`` as a subprocess) against the session control plane,
and the reading helpers the operator tests share."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from drs_devcluster import testing
from drs_devcluster.testing import WAIT_S, RunningCluster

ROOT = Path(__file__).resolve().parents[2]
#: The cluster tests and benchmarks take it from here.
wait_for = testing.wait_for
DRS = str(Path(sys.executable).parent / "drs")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class OperatorProcess:
    """One ``drs operator`` process; its metrics are read from its /metrics endpoint."""

    def __init__(
        self,
        cluster: RunningCluster,
        log: Path,
        resync_s: float = 3.0,
        leader_election: bool = True,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.cluster = cluster
        self.log = log
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.args = [
            DRS,
            "operator",
            "--metrics-port",
            str(self.metrics_port),
            "--health-port",
            str(self.health_port),
            "--resync-seconds",
            str(resync_s),
            "--watch-timeout",
            "30",
            "--lease-namespace",
            "default",
            "--leader-election" if leader_election else "--no-leader-election",
            *extra_args,
        ]
        self.env = {**cluster.env, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            self.args, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        wait_for("the operator's metrics endpoint", lambda: self.metrics() is not None, timeout=60)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def metrics(self) -> dict[str, float] | None:
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return None
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def writes(self) -> float:
        m = self.metrics() or {}
        return sum(v for k, v in m.items() if k.startswith("drs_operator_api_writes_total"))

    def reconciles(self) -> float:
        m = self.metrics() or {}
        return sum(v for k, v in m.items() if k.startswith("drs_operator_reconciles_total"))

    def total(self, prefix: str) -> float:
        """The sum of every sample whose name and labels start with ``prefix``."""
        m = self.metrics() or {}
        return sum(v for k, v in m.items() if k.startswith(prefix))

    def leading(self) -> bool:
        """Holds the Lease and its caches have listed once (reconciles may run)."""
        return (self.metrics() or {}).get("drs_operator_leader") == 1.0


@contextlib.contextmanager
def running_operator(cluster: RunningCluster, log: Path, **kw: Any) -> Iterator[OperatorProcess]:
    op = OperatorProcess(cluster, log, **kw).start()
    try:
        yield op
    finally:
        op.kill(signal.SIGTERM)


def get_json(cluster: RunningCluster, *args: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
    return out


def load_example(name: str, **overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / name).read_text())
    return copy.deepcopy(doc)


def apply(cluster: RunningCluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))


def drs_status(cluster: RunningCluster, namespace: str, name: str) -> dict[str, Any]:
    status: dict[str, Any] = get_json(cluster, "drs", "-n", namespace, name).get("status") or {}
    return status


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


def wait_ready(
    cluster: RunningCluster, namespace: str, name: str, replicas: int, timeout: float = WAIT_S
) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        st = drs_status(cluster, namespace, name)
        gen = get_json(cluster, "drs", "-n", namespace, name)["metadata"]["generation"]
        ok = (
            st.get("observedGeneration") == gen
            and st.get("readyReplicas") == replicas
            and st.get("replicas") == replicas
            and condition(st, "Progressing").get("status") == "False"
        )
        return st if ok else None

    result: dict[str, Any] = wait_for(f"{name} to be Ready with {replicas} replicas", ready, timeout)
    return result


def serving_auth(cluster: RunningCluster, namespace: str, name: str) -> dict[str, str]:
    """The header an engine's serving routes need: the fleet's serving token from its Secret
    (``drs_protocol.auth``; read through the API, as a client in the cluster would)."""
    from drs_operator.api import names
    from drs_operator.kube.engines import secret_token
    from drs_protocol import auth

    secret_name = names.serving_secret_name(name)
    token = secret_token({secret_name: get_json(cluster, "secret", "-n", namespace, secret_name)}, secret_name)
    if token is None:
        raise AssertionError(f"no serving token in Secret {namespace}/{secret_name}")
    return auth.bearer(token)


def pods(cluster: RunningCluster, namespace: str, selector: str = "disagg.dev/replicaset") -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get_json(cluster, "pods", "-n", namespace, "-l", selector)["items"]
    return items


def engine_pods(cluster: RunningCluster, namespace: str) -> dict[str, dict[str, Any]]:
    return {
        p["metadata"]["name"]: p
        for p in pods(cluster, namespace, "disagg.dev/role in (prefill,decode)")
        if not p["metadata"].get("deletionTimestamp")
    }


def models_volume(cluster: RunningCluster, namespace: str) -> None:
    """A bound PVC named ``models`` (the examples mount one), backed by a static hostPath PV."""
    pv = re.sub(r"[^a-z0-9-]", "-", f"models-{namespace}")[:63]
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": pv},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadOnlyMany"],
                    "hostPath": {"path": "/tmp/drs-models"},
                    "claimRef": {"namespace": namespace, "name": "models"},
                    "persistentVolumeReclaimPolicy": "Delete",
                },
            }
        ),
    )
    apply(
        cluster,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "models"},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )


#: A turn the sim engines answer quickly.
CHAT_BODY = {"model": "sim-qwen3", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def auth_fleet(
    name: str, base_port: int, engine_port: int, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    """One replica of 1 prefill + 1 decode sim engine (TP1) and one frontend on the host network
    of a kwok node, for the engine-auth and token-rotation tests."""
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggReplicaSet",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "replicas": 1,
            "model": {"path": "sim-qwen3"},
            "engine": {"backend": "sim", "sim": {"speed": 0}},
            "prefill": {"engines": 1, "tensorParallelSize": 1},
            "decode": {"engines": 1, "tensorParallelSize": 1},
            "frontend": {"workers": 1, "basePort": base_port},
            "trtllm": {"enginePort": engine_port},
            "network": {"hostNetwork": True},
            "topology": {"gpusPerNode": 8},
            "images": {"engine": "drs:dev", "frontend": "drs:dev", "pullPolicy": "Never"},
        },
    }


def http_call(
    url: str, body: dict[str, Any] | None = None, token: str | None = None
) -> tuple[int, dict[str, str], str]:
    """``(status, headers, body)`` of a GET (no body) or POST, never raising for an HTTP status."""
    from drs_protocol import auth

    headers = {"content-type": "application/json", **(auth.bearer(token) if token else {})}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def serving_fleet(cluster: RunningCluster, namespace: str, fleet: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Apply a one-replica, one-URL ``fleet``, wait until it is Ready and its frontend serves;
    its status and its URL."""
    apply(cluster, namespace, fleet)
    status = wait_ready(cluster, namespace, fleet["metadata"]["name"], 1, timeout=180)
    (url,) = status["urls"]
    wait_for("the frontend to serve", lambda: http_call(f"{url}/ready")[0] == 200, timeout=60)
    return status, url
