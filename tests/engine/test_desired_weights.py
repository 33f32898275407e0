"""An engine that starts while the fleet desires other weights loads them before it ever serves
(real sim engines: its first answer is at the desired weights, by version and digest), and a
desired load that cannot be done keeps it up and not ready, naming why (peer catch-up and the
recovery: ``test_peer_catchup.py``)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from drs_engine.server.runner import start_engine
from drs_engine.weights.desired import DesiredWeightsError, desired_from_env, peers_from_env
from drs_protocol import env
from drs_protocol.lifecycle import WEIGHTS_PENDING_ERROR_TYPE
from drs_protocol.weights_digest import digest_bytes, digest_files
from drs_protocol.weights_state import DesiredWeights

from .conftest import CONTROL_TOKEN, auth, sim_config
from .test_peer_catchup import caught_up, failed_once

CHAT = "/v1/chat/completions"
DRS = Path(sys.executable).parent / "drs"


def checkpoint(root: Path, name: str, content: bytes) -> Path:
    path = root / name
    path.mkdir()
    (path / "model.safetensors").write_bytes(content)
    return path


async def first_answer(url: str) -> tuple[dict[str, str], list[int]]:
    async with httpx.AsyncClient(timeout=30) as client:
        held = (await client.get(url + "/control/weights", headers=auth())).json()
        body = {"model": "m", "messages": [{"role": "user", "content": "same prompt"}], "max_tokens": 6}
        response = await client.post(url + CHAT, json=body)
        response.raise_for_status()
        return held, list(response.json()["choices"][0]["token_ids"])


async def test_an_engine_starts_at_the_desired_weights_before_it_serves(tmp_path: Path) -> None:
    path = checkpoint(tmp_path, "step-7", b"the weights of step 7")
    desired = DesiredWeights(version="step-7", path=str(path), digest=digest_files(path))
    async with start_engine(sim_config(), control_token=CONTROL_TOKEN, desired_weights=desired) as late:
        await caught_up(late)
        held, tokens = await first_answer(late.url)
    assert held["weights_version"] == "step-7" and held["weights_digest"] == desired.digest
    async with start_engine(sim_config(), control_token=CONTROL_TOKEN) as refitted:
        async with httpx.AsyncClient() as client:
            load = await client.post(
                refitted.url + "/control/weights/load", json={"path": str(path), "version": "step-7"}, headers=auth()
            )
            assert load.status_code == 200
        _, refit_tokens = await first_answer(refitted.url)
    assert tokens == refit_tokens, "the same weights as an engine the sidecar refitted"


async def test_a_fleet_without_desired_weights_or_at_them_starts_as_always() -> None:
    async with start_engine(sim_config(), control_token=CONTROL_TOKEN) as engine:
        held, _ = await first_answer(engine.url)
    at_start = DesiredWeights(version=held["weights_version"], digest=held["weights_digest"], path="/nowhere")
    async with start_engine(sim_config(), control_token=CONTROL_TOKEN, desired_weights=at_start) as engine:
        again, _ = await first_answer(engine.url)  # nothing loaded: /nowhere was never read
    assert again == held


@pytest.mark.parametrize(
    ("content", "digest", "says"),
    [
        (None, None, "does not exist"),
        (b"step 8", digest_bytes(b"what the trainer meant"), "gave digest"),
    ],
    ids=["missing-path", "other-digest"],
)
async def test_a_desired_load_that_fails_or_gives_other_bytes_keeps_the_engine_up_and_not_ready(
    tmp_path: Path, content: bytes | None, digest: str | None, says: str
) -> None:
    path = checkpoint(tmp_path, "step-8", content) if content is not None else tmp_path / "missing"
    desired = DesiredWeights(version="step-8", path=str(path), digest=digest)
    async with (
        start_engine(sim_config(), control_token=CONTROL_TOKEN, desired_weights=desired) as engine,
        httpx.AsyncClient(timeout=30) as client,
    ):
        await failed_once(engine)
        health = await client.get(engine.url + "/health")
        assert health.status_code == 503
        assert health.json()["error"]["type"] == WEIGHTS_PENDING_ERROR_TYPE
        assert says in health.json()["error"]["message"] and str(path) in health.json()["error"]["message"]


def test_the_engine_command_reads_the_desired_weights_from_its_environment(tmp_path: Path) -> None:
    """As in a pod: ``DRS_DESIRED_WEIGHTS_JSON`` from the weights ConfigMap; a path that is not
    there keeps the engine up and not ready with the path named (no crash loop); a variable that
    does not parse stops it at once."""
    desired = DesiredWeights(version="step-9", path=str(tmp_path / "missing"))
    proc = subprocess.Popen(
        [str(DRS), "engine", "--backend", "sim", "--role", "prefill", "--host", "127.0.0.1", "--port", "0"],
        env={**os.environ, env.DESIRED_WEIGHTS_JSON: desired.dump(), env.WEIGHTS_PEERS_JSON: ""},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        url = None
        for line in proc.stderr:  # the engine says where it listens before it loads
            if match := re.search(r"listening on (127\.0\.0\.1:\d+)", line):
                url = f"http://{match.group(1)}"
                break
        assert url is not None, "the engine never said where it listens"
        deadline = time.monotonic() + 60
        message = ""
        while "does not exist" not in message:  # the first attempt's outcome, then the retries
            assert time.monotonic() < deadline and proc.poll() is None, message
            with contextlib.suppress(httpx.TransportError):
                answer = httpx.get(url + "/health", timeout=5)
                assert answer.status_code == 503
                message = answer.json()["error"]["message"]
            time.sleep(0.1)  # between two probes of a process this test does not drive
        assert "missing" in message and proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    bad = subprocess.run(
        [str(DRS), "engine", "--backend", "sim", "--role", "prefill", "--host", "127.0.0.1", "--port", "0"],
        env={**os.environ, env.DESIRED_WEIGHTS_JSON: "{not json"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and env.DESIRED_WEIGHTS_JSON in bad.stderr
    peers = subprocess.run(
        [str(DRS), "engine", "--backend", "sim", "--role", "prefill", "--host", "127.0.0.1", "--port", "0"],
        env={**os.environ, env.WEIGHTS_PEERS_JSON: '["ftp://x"]'},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert peers.returncode != 0 and env.WEIGHTS_PEERS_JSON in peers.stderr and "ftp://x" in peers.stderr


def test_desired_weights_in_the_environment_are_read_strictly() -> None:
    assert desired_from_env({}) is None
    assert desired_from_env({env.DESIRED_WEIGHTS_JSON: ""}) is None
    assert desired_from_env({env.DESIRED_WEIGHTS_JSON: '{"version": "v1"}'}) == DesiredWeights(version="v1")
    with pytest.raises(DesiredWeightsError, match=env.DESIRED_WEIGHTS_JSON):
        desired_from_env({env.DESIRED_WEIGHTS_JSON: '{"version": "v1", "extra": 1}'})
    assert peers_from_env({}) == () and peers_from_env({env.WEIGHTS_PEERS_JSON: ""}) == ()
    assert peers_from_env({env.WEIGHTS_PEERS_JSON: '["http://10.0.0.1:8000"]'}) == ("http://10.0.0.1:8000",)
    with pytest.raises(DesiredWeightsError, match=env.WEIGHTS_PEERS_JSON):
        peers_from_env({env.WEIGHTS_PEERS_JSON: '"http://10.0.0.1:8000"'})
