"""The trainer's library (``drs_client``) and ``drs gym-config`` against the real control plane: the
operator places a sim fleet, the pod runner runs it, and the library finds it, waits for it, watches
it change, refits it through a real ``drs sidecar`` and reads the weights every engine serves."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_client import AsyncFleet, Fleet, FleetNotFound, FleetUnreadable, Progress
from drs_client.gym import SERVER_PATH
from drs_client.kube import KubeReader, api_client
from drs_devcluster.testing import RunningCluster
from operator_harness import ROOT, OperatorProcess, apply, drs_status, free_port, wait_for

DRS = str(Path(sys.executable).parent / "drs")

pytestmark = pytest.mark.cluster


def sim_fleet(name: str, replicas: int, base_port: int, engine_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggReplicaSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "model": {"path": "sim-qwen3"},
            "engine": {"backend": "sim", "simOptions": {"speed": 0}},
            "prefill": {"engines": 1, "tensorParallelSize": 1},
            "decode": {"engines": 1, "tensorParallelSize": 1},
            "frontend": {"workers": 1, "basePort": base_port},
            "trtllm": {"enginePort": engine_port},
            "network": {"hostNetwork": True},
            "topology": {"gpusPerNode": 8},
            "images": {"engine": "drs:dev", "frontend": "drs:dev", "pullPolicy": "Never"},
        },
    }


@pytest.fixture
def sidecar_process(devcluster: RunningCluster, namespace: str) -> Iterator[tuple[str, list[Any]]]:
    """``drs sidecar --name trainer`` (its token from the fleet's Secret), and where it runs."""
    port = free_port()
    procs: list[Any] = []

    def start() -> None:
        procs.append(
            subprocess.Popen(
                [DRS, "sidecar", "--name", "trainer", "--namespace", namespace, "--port", str(port)],
                env={k: v for k, v in devcluster.env.items() if k != "DRS_CONTROL_TOKEN"},
                stderr=subprocess.PIPE,
            )
        )

    yield f"http://127.0.0.1:{port}", [start]
    for proc in procs:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        print(err.decode(errors="replace")[-3000:])


def test_the_library_finds_waits_for_watches_and_refits_a_fleet(
    devcluster: RunningCluster,
    namespace: str,
    stack: OperatorProcess,
    tmp_path: Path,
    sidecar_process: tuple[str, list[Any]],
) -> None:
    apply(devcluster, namespace, sim_fleet("trainer", 2, 18500, 18200))
    seen: list[Progress] = []

    async def wait() -> Any:
        async with await AsyncFleet.connect("trainer", namespace, kubeconfig=devcluster.kubeconfig) as fleet:
            return await fleet.wait_ready(timeout_s=180, progress=seen.append)

    view = asyncio.run(wait())
    status = drs_status(devcluster, namespace, "trainer")
    assert view.phase == "Ready" and list(view.urls) == status["urls"] and len(view.urls) == 2
    assert seen[-1].phase == "Ready" and seen[-1].ready_replicas == seen[-1].replicas == 2
    assert any(p.phase != "Ready" for p in seen), "the callback saw the way there, not only the end"
    assert sorted(e.name for e in view.engines) == [
        "trainer-r0-decode-0",
        "trainer-r0-prefill-0",
        "trainer-r1-decode-0",
        "trainer-r1-prefill-0",
    ]

    # drs gym-config --watch keeps Gym's config current while the fleet scales down to one replica
    config = tmp_path / "gym.yaml"
    watcher = subprocess.Popen(
        [DRS, "gym-config", "trainer", "-n", namespace, "-o", str(config), "--watch"],
        env=devcluster.env,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for("gym-config to write the config", config.exists, timeout=30)
        assert _base_urls(config) == [u + "/v1" for u in status["urls"]]
        url, [start_sidecar] = sidecar_process
        with Fleet.connect("trainer", namespace, kubeconfig=devcluster.kubeconfig, sidecar_url=url) as fleet:
            changes = fleet.watch()
            assert next(changes).urls == view.urls
            devcluster.kubectl(
                "patch", "drs", "trainer", "-n", namespace, "--type=merge", "-p", json.dumps({"spec": {"replicas": 1}})
            )
            smaller = next(v for v in changes if len(v.urls) == 1 and v.serves())
            changes.close()
            assert smaller.urls == view.urls[:1]
            wait_for("gym-config to follow the scale-down", lambda: _base_urls(config) == [smaller.urls[0] + "/v1"], 30)

            start_sidecar()
            wait_for("the sidecar to serve", lambda: _healthy(url), timeout=30)
            checkpoint = tmp_path / "step-5"
            checkpoint.write_bytes(b"policy weights after step 5")
            report = fleet.refit(str(checkpoint), "step-5")
            assert report.complete and report.ok == 2
            shown = fleet.wait_weights("step-5", timeout_s=60)
            assert shown.engine_weights() == {"trainer-r0-prefill-0": "step-5", "trainer-r0-decode-0": "step-5"}
            assert [e.weights_version for e in fleet.served_weights().engines] == ["step-5", "step-5"]
            assert fleet.reset_prefix_cache().complete
    finally:
        watcher.terminate()
        watcher.communicate(timeout=15)
    # the one-URL fleet now has Gym's endpoint-file form too
    endpoint = tmp_path / "endpoint"
    once = subprocess.run(
        [DRS, "gym-config", "trainer", "-n", namespace, "--endpoint-file", str(endpoint)],
        env=devcluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert once.returncode == 0, once.stderr
    assert endpoint.read_text() == smaller.urls[0] + "/v1\n"
    assert _server(yaml.safe_load(once.stdout))["endpoint_file"] == str(endpoint)


def test_the_watch_outlives_the_apiservers_watch_timeout(
    devcluster: RunningCluster, namespace: str, stack: OperatorProcess, tmp_path: Path
) -> None:
    """The apiserver ends each watch after ``watch_timeout_s`` (1 s here); the watch opens the next one
    from the last version it saw, so a change made after several such ends still arrives, once. And
    ``drs gym-config --endpoint-file --watch`` publishes the one URL of a one-frontend fleet, then
    removes the file while the fleet has none (Gym's "unpublished")."""
    apply(devcluster, namespace, sim_fleet("watched", 1, 18700, 18300))
    endpoint = tmp_path / "endpoint"
    publisher = subprocess.Popen(
        [DRS, "gym-config", "watched", "-n", namespace, "--endpoint-file", str(endpoint), "--watch", "--wait", "180"],
        env=devcluster.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    async def follow() -> list[Any]:
        reader = KubeReader(await api_client(devcluster.kubeconfig), namespace, "watched", watch_timeout_s=1)
        fleet = AsyncFleet(reader)
        try:
            await fleet.wait_ready(timeout_s=180)
            seen = []
            async with asyncio.timeout(60):
                watch = fleet.watch()
                first = await anext(watch)
                await asyncio.sleep(3.5)  # three server-side timeouts, each followed by a new watch
                patch = {"metadata": {"annotations": {"example": "x"}}, "spec": {"replicas": 0}}
                devcluster.kubectl("patch", "drs", "watched", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
                async for view in watch:
                    seen.append(view)
                    if not view.urls and view.current:
                        break
                await watch.aclose()
            return [first, *seen]
        finally:
            await fleet.close()

    try:
        views = asyncio.run(follow())
        assert len(views[0].urls) == 1 and not views[-1].urls
        assert len(views) == len({(v.generation, v.phase, v.urls, v.ready_replicas, v.engines) for v in views})
        wait_for("gym-config to remove the endpoint file", lambda: not endpoint.exists(), timeout=30)
        assert publisher.poll() is None, "it keeps watching"
    finally:
        publisher.terminate()
        _, err = publisher.communicate(timeout=15)
    log = err.decode()
    assert f"wrote {endpoint}: {views[0].urls[0]}/v1" in log, log
    assert f"removing {endpoint}" in log, log


def test_a_fleet_that_is_not_there_is_named(devcluster: RunningCluster, namespace: str, stack: OperatorProcess) -> None:
    with (
        pytest.raises(FleetNotFound, match=f"{namespace}/nothing-here: not found"),
        Fleet.connect("nothing-here", namespace, kubeconfig=devcluster.kubeconfig) as fleet,
    ):
        fleet.get()
    started = time.monotonic()
    result = subprocess.run(
        [DRS, "gym-config", "nothing-here", "-n", namespace], env=devcluster.env, capture_output=True, text=True
    )
    assert result.returncode == 1 and "nothing-here: not found" in result.stderr
    assert time.monotonic() - started < 30


def _server(config: dict[str, Any]) -> dict[str, Any]:
    for key in SERVER_PATH:
        config = config[key]
    return config


def _base_urls(path: Path) -> list[str] | None:
    try:
        urls = yaml.safe_load(path.read_text())["policy_base_url"]
    except (OSError, TypeError, KeyError):
        return None
    return list(urls)


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/healthz", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def test_in_a_pod_the_library_reads_with_the_pods_service_account(
    devcluster: RunningCluster, namespace: str, stack: OperatorProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No kubeconfig given and the in-cluster variables set: the library uses the ServiceAccount's
    token (here the example trainer's, with its Role from examples/trainer/sidecar-rbac.yaml), which
    may read the fleets of its namespace and nothing else."""
    import base64
    import urllib.parse

    from kubernetes_asyncio.config import incluster_config

    devcluster.kubectl("apply", "-n", namespace, "-f", str(ROOT / "examples" / "trainer" / "sidecar-rbac.yaml"))
    apply(devcluster, namespace, sim_fleet("rollouts", 0, 18800, 18350))
    token = devcluster.kubectl("create", "token", "trainer", "-n", namespace).stdout.strip()
    kubeconfig = yaml.safe_load(devcluster.kubeconfig.read_text())
    cluster = kubeconfig["clusters"][0]["cluster"]
    ca = tmp_path / "ca.crt"
    if "certificate-authority-data" in cluster:
        ca.write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
    else:
        ca.write_bytes(Path(cluster["certificate-authority"]).read_bytes())
    (tmp_path / "token").write_text(token)
    server = urllib.parse.urlsplit(cluster["server"])
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", str(server.hostname))
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    with Fleet.connect("rollouts", namespace) as fleet:
        assert (fleet.get().namespace, fleet.get().name) == (namespace, "rollouts")
    with pytest.raises(FleetUnreadable, match=r"default/rollouts: 403"), Fleet.connect("rollouts", "default") as fleet:
        fleet.get()  # the admin's kubeconfig would have read it (404 at most): these are the pod's credentials
