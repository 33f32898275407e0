"""``drs frontend``: flags over the config file, serving at start, and a port that cannot be bound."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from drs_cli.main import main as drs
from drs_frontend.config import FrontendConfig, load_config

DRS = str(Path(sys.executable).parent / "drs")


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "frontend.yaml"
    path.write_text(
        "prefill: [http://a:1, http://b:2]\ndecode: [http://c:3]\nnode_id: 4\nport: 8304\ntokenize: true\nctx_router: round_robin\n"
    )
    config = load_config(path, {"port": 9000, "node_id": None, "decode": ["http://d:4"], "tokenize": False})
    assert config.port == 9000
    assert config.node_id == 4
    assert config.decode == ["http://d:4"]
    assert config.prefill == ["http://a:1", "http://b:2"]
    assert config.tokenize is False
    assert config.ctx_router == "round_robin"


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        pytest.param({"prefill": [], "decode": ["http://d:1"]}, "prefill", id="an empty prefill pool"),
        pytest.param({"prefill": ["a:1"], "decode": ["http://d:1"]}, "http://", id="a URL without a scheme"),
        pytest.param(
            {"prefill": ["http://a:1"], "decode": ["http://d:1"], "node_id": 256}, "node_id", id="a node id over 8 bits"
        ),
        pytest.param(
            {"prefill": ["http://a:1"], "decode": ["http://d:1"], "process_id": 64},
            "process_id",
            id="a process id over 6 bits",
        ),
        pytest.param(
            {"prefill": ["http://a:1"], "decode": ["http://d:1"], "ctx_rooter": "x"}, "ctx_rooter", id="a misspelt key"
        ),
    ],
)
def test_invalid_configs_are_refused_naming_the_field(data: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        FrontendConfig.model_validate(data)


def test_the_drs_cli_offers_the_frontend_command_with_its_flags() -> None:
    result = CliRunner().invoke(drs, ["frontend", "--help"])
    assert result.exit_code == 0
    for flag in (
        "--config",
        "--prefill",
        "--decode",
        "--host",
        "--port",
        "--node-id",
        "--ctx-router",
        "--gen-router",
        "--tokenizer",
        "--tokenize / --no-tokenize",
    ):
        assert flag in result.output


def frontend_argv(prefill: str, decode: str, port: int, *extra: str) -> list[str]:
    """``drs frontend`` on 127.0.0.1:``port`` in front of one prefill and one decode engine."""
    return [
        DRS,
        "frontend",
        "--prefill",
        prefill,
        "--decode",
        decode,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def poll(client: httpx.AsyncClient, url: str, want: int | None = None) -> httpx.Response:
    """GET ``url`` until the process answers (with ``want``, when given): it is starting up."""
    for _ in range(300):
        with contextlib.suppress(httpx.TransportError):
            response = await client.get(url)
            if want is None or response.status_code == want:
                return response
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url} did not answer{'' if want is None else f' {want}'} within 15 s")


async def decode_in_flight(client: httpx.AsyncClient, url: str, timeout_s: float = 15.0) -> None:
    """Wait until the frontend at ``url`` has a call in flight to a decode engine (its own gauge)."""
    async with asyncio.timeout(timeout_s):
        while True:
            metrics = (await client.get(url + "/metrics")).text
            if any(
                line.startswith("drs_frontend_engine_in_flight{")
                and 'role="decode"' in line
                and not line.endswith(" 0.0")
                for line in metrics.splitlines()
            ):
                return
            await asyncio.sleep(0.01)


def test_a_port_that_cannot_be_bound_exits_non_zero_at_once_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            frontend_argv("http://127.0.0.1:1", "http://127.0.0.1:2", port),
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    assert proc.returncode == 1
    assert f"127.0.0.1:{port}" in proc.stderr


def test_a_standby_process_mints_request_ids_with_its_own_process_id() -> None:
    from drs_frontend.app import FrontendApp
    from drs_protocol.snowflake import COUNTER_BITS, MIN_ID, PROCESS_ID_BITS, node_id_of

    config = load_config(None, {"node_id": 5, "process_id": 1}, {"prefill": ["http://a:1"], "decode": ["http://d:1"]})
    minted = FrontendApp(config).relay.minter.next_id()
    assert node_id_of(minted) == 5
    assert ((minted - MIN_ID) >> COUNTER_BITS) & (2**PROCESS_ID_BITS - 1) == 1


async def test_the_command_serves_as_soon_as_it_starts() -> None:
    port = free_port()
    argv = frontend_argv("http://127.0.0.1:1", "http://127.0.0.1:2", port, "--node-id", "7")
    proc = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.PIPE)
    try:
        async with httpx.AsyncClient() as client:
            health = await poll(client, f"http://127.0.0.1:{port}/health")
            assert health.status_code == 200
            ready = await client.get(f"http://127.0.0.1:{port}/ready")
            assert ready.status_code == 503  # nothing answers on the engine ports
            turn = await client.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert turn.status_code == 503
            assert turn.json()["error"]["role"] == "prefill"
    finally:
        proc.terminate()
        await proc.wait()


async def test_sigterm_lets_a_turn_in_flight_finish_then_the_process_exits_zero() -> None:
    """A frontend pod being replaced gets SIGTERM: the turn it is serving completes, then it exits."""
    from drs_engine.server.runner import start_engine

    from .conftest import sim_config

    slow = {"sim": {"speed": 1.0, "decodeSecondsPerToken": 0.02, "prefillSecondsPerToken": 0.0}}
    async with (
        start_engine(sim_config("prefill", **slow)) as prefill,
        start_engine(sim_config("decode", **slow)) as decode,
    ):
        port = free_port()
        argv = frontend_argv(prefill.url, decode.url, port)
        proc = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                await poll(client, url + "/ready", 200)
                body = {"model": "sim-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
                turn = asyncio.create_task(client.post(url + "/v1/chat/completions", json=body))  # ~1 s of decoding
                await decode_in_flight(client, url)  # the turn is on its generation leg
                proc.terminate()
                answer = await turn
                assert answer.status_code == 200, answer.text
                assert answer.json()["usage"]["completion_tokens"] == 50
                assert await asyncio.wait_for(proc.wait(), 10) == 0
                with pytest.raises(httpx.TransportError):
                    await client.get(url + "/health")
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
