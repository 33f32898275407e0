"""An engine wider than a node as real processes: two ``drs engine`` ranks over one real Ray cluster.

No Kubernetes here: the pods' environment is given by hand, each rank binds its own loopback
address (127.<DRS_DEV_NODE_NET>.250.x, like two nodes), and the sim backend places one Ray actor
per declared GPU across both. The cluster tests (tests/cluster/test_wide_engines.py) run the same
processes through the operator and the pod runner.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from drs_devcluster.profiles import node_net
from drs_devcluster.testing import wait_for
from drs_engine.gang.spec import EXIT_GANG_LOST, head_temp_dir

DRS = str(Path(sys.executable).parent / "drs")
HOSTS = (f"127.{node_net()}.250.1", f"127.{node_net()}.250.2")
UP_TIMEOUT_S = 150.0
GONE_TIMEOUT_S = 60.0


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


#: The gang's serving token (``drs_protocol.auth``): the leader's ``/v1/gang`` is in its realm.
SERVING_TOKEN = "gang-serving-token"
AUTH = {"authorization": f"Bearer {SERVING_TOKEN}"}


def get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, headers=AUTH, timeout=2)
    except httpx.HTTPError:
        return None


@pytest.fixture
def gang(tmp_path: Path) -> Iterator[tuple[list[subprocess.Popen[bytes]], str, Path]]:
    port, ray_port = free_port(HOSTS[0]), free_port(HOSTS[0])
    env = {
        **os.environ,
        "DRS_WORLD_SIZE": "2",
        "DRS_LEADER_ADDRESS": HOSTS[0],
        "DRS_RAY_PORT": str(ray_port),
        "DRS_RANK_GPUS": "2",
        "DRS_SERVING_TOKEN": SERVING_TOKEN,  # rank 1 joins only if its polls of /v1/gang present it
    }
    procs = []
    for rank, host in enumerate(HOSTS):
        log = (tmp_path / f"rank{rank}.log").open("wb")
        argv = [DRS, "engine", "--backend", "sim", "--role", "prefill", "--host", host, "--port", str(port)]
        procs.append(
            subprocess.Popen(
                [*argv, "--sim-speed", "0"],
                env={**env, "DRS_RANK": str(rank)},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    try:
        yield procs, f"http://{HOSTS[0]}:{port}", tmp_path
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        shutil.rmtree(head_temp_dir(HOSTS[0], ray_port), ignore_errors=True)
        for rank in range(2):  # shown when the test fails
            print(f"--- rank {rank}\n" + (tmp_path / f"rank{rank}.log").read_text(errors="replace")[-3000:])


def test_the_leader_serves_once_every_rank_joined_and_a_lost_rank_ends_the_gang(
    gang: tuple[list[subprocess.Popen[bytes]], str, Path],
) -> None:
    procs, url, _ = gang
    joining = wait_for("the leader's gang report", lambda: (r := get(url + "/v1/gang")) is not None and r, 60)
    assert joining.json()["phase"] in ("starting", "joining", "loading", "serving")
    health = get(url + "/health")
    assert health is not None and (health.status_code == 503 or joining.json()["phase"] == "serving")

    wait_for(
        "the leader to be healthy",
        lambda: (r := get(url + "/health")) is not None and r.status_code == 200,
        UP_TIMEOUT_S,
    )
    report = httpx.get(url + "/v1/gang", headers=AUTH).json()
    assert report["phase"] == "serving" and report["world_size"] == 2
    assert httpx.get(url + "/v1/gang").status_code == 401  # no token: refused
    assert [(r["rank"], r["node_ip"], r["joined"], r["gpus"], r["workers_alive"]) for r in report["ranks"]] == [
        (0, HOSTS[0], True, 2, 2),
        (1, HOSTS[1], True, 2, 2),
    ]
    member = httpx.get(f"http://{HOSTS[1]}:{url.rsplit(':', 1)[1]}/health")
    assert member.status_code == 200 and member.json()["session"] == report["session"]
    reply = httpx.post(
        url + "/v1/completions",
        json={"model": "sim-qwen3", "prompt": "hello", "max_tokens": 4},
        headers=AUTH,
        timeout=30,
    )
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] is not None

    os.killpg(procs[1].pid, signal.SIGKILL)  # rank 1's "pod" dies with its Ray node and actors
    assert procs[0].wait(timeout=GONE_TIMEOUT_S) == EXIT_GANG_LOST
