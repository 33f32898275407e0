"""End to end on the real control plane: the operator places a sim fleet, the pod runner runs its pods
as processes on their nodes' addresses, and a request to a URL read from the status travels
frontend → prefill engine → decode engine."""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from drs_devcluster import profiles
from drs_devcluster.testing import TEST_GB200_NODES, TEST_HGX_NODES, RunningCluster
from drs_protocol.weights_digest import digest_files
from operator_harness import (
    ROOT,
    OperatorProcess,
    apply,
    condition,
    drs_status,
    engine_pods,
    free_port,
    wait_for,
    wait_ready,
)

DRS = str(Path(sys.executable).parent / "drs")

pytestmark = pytest.mark.cluster


def sim_fleet(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggReplicaSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": 2,
            "model": {"path": "sim-qwen3"},
            "engine": {"backend": "sim", "simOptions": {"speed": 0}},
            "prefill": {"engines": 2, "tensorParallelSize": 1},
            "decode": {"engines": 1, "tensorParallelSize": 1},
            "frontend": {"workers": 2, "basePort": 18300},
            "trtllm": {"enginePort": 18000},
            "network": {"hostNetwork": True},
            "topology": {"gpusPerNode": 8},
            "images": {"engine": "drs:dev", "frontend": "drs:dev", "pullPolicy": "Never"},
        },
    }


def cache_hits(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("drs_engine_prefix_cache_hit_tokens_total"):
                    total += float(line.split()[-1])
    return total


def test_a_chat_turn_sent_to_a_status_url_is_served_by_that_replicas_engines(
    devcluster: RunningCluster, namespace: str, stack: OperatorProcess
) -> None:
    apply(devcluster, namespace, sim_fleet("e2e"))
    status = wait_ready(devcluster, namespace, "e2e", 2, timeout=180)
    urls = status["urls"]
    node_ips = {profiles.node_ip(i) for i in range(TEST_HGX_NODES + TEST_GB200_NODES)}
    assert len(urls) == 4 and all(urllib.parse.urlsplit(u).hostname in node_ips for u in urls)
    assert [u.rsplit(":", 1)[1] for u in urls] == ["18300", "18301", "18302", "18303"]

    def serving() -> bool:  # the frontends' own /ready: both of their engines answer
        try:
            return all(urllib.request.urlopen(f"{u}/ready", timeout=2).status == 200 for u in urls)
        except OSError:
            return False

    wait_for("every frontend to serve", serving, timeout=60)
    session = "trajectory-42"
    index = int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big") % len(urls)
    replica = status["replicaStatuses"][index // 2]
    prefills = [e["url"] for e in replica["engines"] if e["role"] == "prefill"]
    decodes = [e["url"] for e in replica["engines"] if e["role"] == "decode"]
    client = openai.OpenAI(base_url=f"{urls[index]}/v1", api_key="unused", max_retries=0, timeout=30)
    system = "You are a rollout policy. " * 30  # several cache blocks
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
    served = []
    for turn in range(2):
        hits_before = cache_hits(prefills)
        raw = client.chat.completions.with_raw_response.create(
            model="sim-qwen3",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            extra_body={"conversation_params": {"conversation_id": session}},
        )
        reply = raw.parse()
        served.append((raw.headers["x-drs-prefill"], raw.headers["x-drs-decode"]))
        assert raw.headers["x-drs-prefill"] in prefills
        assert raw.headers["x-drs-decode"] in decodes
        message: Any = reply.choices[0].message
        assert message.prompt_token_ids and message.generation_token_ids  # where NeMo-Gym reads them
        if turn == 1:
            assert cache_hits(prefills) > hits_before, "the second turn reused the first turn's prefix"
        messages += [{"role": "assistant", "content": message.content}, {"role": "user", "content": "and then?"}]
    assert served[0][0] == served[1][0], "conversation affinity: both turns on one prefill engine"
    pods_dir = devcluster.cluster.layout.state_dir / "pods"
    assert list(pods_dir.glob(f"{namespace}_e2e-r0-prefill-0_*/log")), "the prefill engine ran as a local process"


def start_sidecar(devcluster: RunningCluster, namespace: str, name: str, port: int) -> subprocess.Popen[bytes]:
    # the control token comes from the resource's Secret (read through the API, as in a trainer pod)
    return subprocess.Popen(
        [DRS, "sidecar", "--name", name, "--namespace", namespace, "--port", str(port), "--reconcile-interval", "0.5"],
        env={k: v for k, v in devcluster.env.items() if k != "DRS_CONTROL_TOKEN"},
        stderr=subprocess.PIPE,
    )


def stop_sidecar(sidecar: subprocess.Popen[bytes]) -> None:
    sidecar.terminate()
    try:
        _, err = sidecar.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        sidecar.kill()
        _, err = sidecar.communicate()
    print(err.decode(errors="replace")[-4000:])  # pytest shows it when the test fails
    # uvicorn shuts down gracefully, then re-raises the signal it caught: -SIGTERM, not SIGKILL
    assert sidecar.returncode in (0, -signal.SIGTERM), "the sidecar stops on SIGTERM"


def engine_control(
    devcluster: RunningCluster, namespace: str, name: str, engine: str, route: str, body: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """One engine's control API called directly, with the fleet's control token (``GET`` without a
    body, else ``POST``); None when it does not answer."""
    status = drs_status(devcluster, namespace, name)
    url = next(
        (e.get("url") for r in status.get("replicaStatuses", []) for e in r["engines"] if e["name"] == engine), None
    )
    secret = json.loads(devcluster.kubectl("get", "secret", "-n", namespace, f"{name}-control", "-o", "json").stdout)
    token = base64.b64decode(secret["data"]["token"]).decode()
    if url is None:
        return None
    headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + route, data=data, headers=headers, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
            return answer
    except OSError:
        return None


def engine_weights(devcluster: RunningCluster, namespace: str, name: str, engine: str) -> dict[str, Any] | None:
    """What one engine answers it holds (``GET /control/weights``, with the fleet's control token)."""
    return engine_control(devcluster, namespace, name, engine, "/control/weights")


def status_shows(
    devcluster: RunningCluster, namespace: str, name: str, engine: str, digest: str, pending: str
) -> dict[str, Any] | None:
    """The status once it says ``engine`` holds ``digest`` and ``WeightsPending`` is ``pending``."""
    status = drs_status(devcluster, namespace, name)
    shown = [
        e.get("weightsDigest") for r in status.get("replicaStatuses", []) for e in r["engines"] if e["name"] == engine
    ]
    return status if shown == [digest] and condition(status, "WeightsPending").get("status") == pending else None


def test_the_trainer_sidecar_refits_every_engine_and_a_replaced_engine_catches_up(
    devcluster: RunningCluster, namespace: str, stack: OperatorProcess, tmp_path: Path
) -> None:
    """Refit; then, with no sidecar running, status follows the engines as the operator observes
    them (an engine loaded other weights directly shows them and ``WeightsPending`` names it; loaded
    back, it clears), and an engine pod is deleted: its replacement reads the desired weights from
    the weights ConfigMap and loads them before it is Ready; a new sidecar
    knows the desired weights from the resource; a replica added afterwards starts at them too."""
    fleet = sim_fleet("refit")
    fleet["spec"]["frontend"]["basePort"] = 18400
    fleet["spec"]["trtllm"]["enginePort"] = 18100
    apply(devcluster, namespace, fleet)
    wait_ready(devcluster, namespace, "refit", 2, timeout=180)
    checkpoint = tmp_path / "step-1"
    checkpoint.write_bytes(b"policy weights after step 1")
    digest = digest_files(checkpoint)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sidecar = start_sidecar(devcluster, namespace, "refit", port)
    try:
        wait_for("the sidecar to serve", lambda: _get(url + "/healthz") is not None, timeout=30)
        report = _post(url + "/v1/refit", {"path": str(checkpoint), "version": "step-1", "digest": digest})
        assert report["complete"] is True and report["ok"] == 6, report  # 2 replicas × (2 prefill + 1 decode)
        status = wait_for(
            "status.weights.version to be step-1",
            lambda: (
                (s := drs_status(devcluster, namespace, "refit")).get("weights", {}).get("version") == "step-1" and s
            ),
        )
        assert status["weights"]["lastUpdateTime"]
        desired = dict(status["weights"]["desired"])
        effective_at = datetime.datetime.fromisoformat(desired.pop("effectiveAt"))  # the refit's cut-over
        assert desired == {"version": "step-1", "path": str(checkpoint), "digest": digest}
        assert effective_at.tzinfo is not None and effective_at.timestamp() == pytest.approx(
            report["effective_at"], abs=1e-6
        ), (effective_at, report["effective_at"])
        shown = wait_for(
            "every engine's digest in status",
            lambda: (
                (s := drs_status(devcluster, namespace, "refit"))
                and [e.get("weightsDigest") for r in s["replicaStatuses"] for e in r["engines"]] == [digest] * 6
                and s
            ),
        )
        assert shown["phase"] == "Ready"
        table = devcluster.kubectl("get", "drs", "-n", namespace, "refit").stdout
        assert "WEIGHTS" in table.splitlines()[0] and "step-1" in table.splitlines()[1]
    finally:
        stop_sidecar(sidecar)

    # no sidecar now: status follows what the engines hold, as the operator asks them. An engine
    # loaded other weights behind the fleet's back shows them, and WeightsPending names it
    by_hand = tmp_path / "by-hand"
    by_hand.write_bytes(b"weights no trainer sent")
    other = digest_files(by_hand)
    loaded = "refit-r0-prefill-0"
    answer = engine_control(
        devcluster, namespace, "refit", loaded, "/control/weights/load", {"path": str(by_hand), "version": "by-hand"}
    )
    assert answer is not None and answer["weights_digest"] == other, answer
    status = wait_for(
        "status to show the engine's new weights with no sidecar running",
        lambda: status_shows(devcluster, namespace, "refit", loaded, other, "True"),
        timeout=60,
    )
    pending = condition(status, "WeightsPending")["message"]
    assert pending.startswith("1/6 engine(s)") and f"{loaded} holds by-hand ({other[:16]}" in pending, pending
    assert condition(status, "Degraded")["reason"] == "WeightsSplit"
    answer = engine_control(
        devcluster, namespace, "refit", loaded, "/control/weights/load", {"path": str(checkpoint), "version": "step-1"}
    )
    assert answer is not None and answer["weights_digest"] == digest, answer
    wait_for(
        "WeightsPending to clear once the engine holds the desired weights again",
        lambda: status_shows(devcluster, namespace, "refit", loaded, digest, "False"),
        timeout=60,
    )

    # the replacement of a deleted engine pod catches up by itself, before it is Ready
    victim = "refit-r1-decode-0"
    old_uid = engine_pods(devcluster, namespace)[victim]["metadata"]["uid"]
    devcluster.kubectl("delete", "pod", "-n", namespace, victim, "--wait=false")

    def replaced_and_ready() -> bool:
        pod = engine_pods(devcluster, namespace).get(victim)
        if pod is None or pod["metadata"]["uid"] == old_uid:
            return False
        return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))

    wait_for("the replaced engine pod to be Ready", replaced_and_ready, timeout=120)
    held = engine_weights(devcluster, namespace, "refit", victim)
    assert held is not None and (held["weights_version"], held["weights_digest"]) == ("step-1", digest)
    wait_for(
        "status to show the replacement's observed digest",
        lambda: status_shows(devcluster, namespace, "refit", victim, digest, "False"),
        timeout=60,
    )

    sidecar = start_sidecar(devcluster, namespace, "refit", port)
    try:
        wait_for("the new sidecar to serve", lambda: _get(url + "/healthz") is not None, timeout=30)
        desired = wait_for(
            "the new sidecar to restore the desired weights", lambda: (_get(url + "/v1/fleet") or {}).get("desired")
        )
        assert desired == {"path": str(checkpoint), "version": "step-1", "digest": digest}
        fleet_now = _get(url + "/v1/fleet") or {}
        assert [e["weights_digest"] for e in fleet_now.get("engines", [])] == [digest] * 6
    finally:
        stop_sidecar(sidecar)

    # scale up by one replica, no sidecar running: the new engines come up at the desired weights
    fleet["spec"]["replicas"] = 3
    apply(devcluster, namespace, fleet)
    wait_ready(devcluster, namespace, "refit", 3, timeout=180)
    added = [
        e["name"]
        for r in drs_status(devcluster, namespace, "refit")["replicaStatuses"]
        if r["index"] == 2
        for e in r["engines"]
    ]
    assert len(added) == 3
    for engine in added:
        held = engine_weights(devcluster, namespace, "refit", engine)
        assert held is not None and (held["weights_version"], held["weights_digest"]) == ("step-1", digest), engine


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def test_the_trainer_example_grants_the_sidecar_what_it_needs_and_nothing_more(
    devcluster: RunningCluster, namespace: str, stack: OperatorProcess
) -> None:
    devcluster.kubectl("apply", "-n", namespace, "-f", str(ROOT / "examples" / "trainer" / "sidecar-rbac.yaml"))
    devcluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", str(ROOT / "examples" / "trainer" / "trainer-pod.yaml")
    )
    who = f"--as=system:serviceaccount:{namespace}:trainer"

    def can(*args: str) -> bool:
        result = devcluster.kubectl("auth", "can-i", *args, "-n", namespace, who, check=False)
        return result.stdout.strip() == "yes"

    assert can("get", "disaggreplicasets.disagg.dev/rollouts")
    assert can("watch", "disaggreplicasets.disagg.dev")
    assert can("patch", "disaggreplicasets.disagg.dev/rollouts")
    assert can("get", "secrets/rollouts-control")
    assert not can("patch", "disaggreplicasets.disagg.dev/someone-else")
    assert not can("patch", "disaggreplicasets.disagg.dev/rollouts", "--subresource=status"), "status is the operator's"
    assert not can("delete", "disaggreplicasets.disagg.dev/rollouts")
    assert not can("get", "secrets/another-secret")
    assert not can("create", "pods")
