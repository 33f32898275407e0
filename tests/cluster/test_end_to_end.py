"""End to end on the real control plane: the operator places a sim fleet, the pod runner runs its pods
as processes on their nodes' addresses, and a request to a URL read from the status travels
frontend → prefill engine → decode engine."""

from __future__ import annotations

import hashlib
import signal
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from drs_devcluster import runner
from drs_devcluster.testing import RunningCluster
from operator_harness import ROOT, OperatorProcess, apply, wait_for, wait_ready

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def stack(devcluster: RunningCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    devcluster.kubectl("apply", "-f", str(ROOT / "crds"))
    devcluster.kubectl("wait", "--for=condition=Established", "crd/disaggreplicasets.disagg.dev", "--timeout=60s")
    if runner.running_runner(devcluster.cluster) is None:
        runner.start_runner(devcluster.cluster)
    op = OperatorProcess(devcluster, tmp_path_factory.mktemp("e2e") / "operator.log").start()
    try:
        yield op
    finally:
        op.kill(signal.SIGTERM)
        runner.stop_runner(devcluster.cluster)


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
    assert len(urls) == 4 and all(u.startswith("http://127.0.") for u in urls)
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
