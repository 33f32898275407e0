"""``drs sidecar`` as a process over real sim engines: the trainer's HTTP API end to end."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from drs_cli.main import main as drs
from drs_protocol.weights_digest import digest_files
from drs_sidecar.app import MAX_BODY_BYTES

from .conftest import TOKEN, served_version, sim_engine

DRS = str(Path(sys.executable).parent / "drs")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def sidecar(*engine_urls: str, token_file: Path, extra: tuple[str, ...] = ()) -> AsyncIterator[str]:
    port = free_port()
    args = [DRS, "sidecar", "--port", str(port), "--control-token-file", str(token_file), "--reconcile-interval", "0.2"]
    args += extra
    for url in engine_urls:
        args += ["--engine", url]
    proc = await asyncio.create_subprocess_exec(*args, stderr=asyncio.subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(200):
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get(url + "/healthz")).status_code == 200:
                        break
                await asyncio.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        await proc.wait()


#: A sidecar whose collective steps end sooner: the engines get 80% (4.8 s: a store that refuses
#: connections fails their join by then), the sidecar waits 90% (5.4 s).
SHORT_COLLECTIVE = ("--collective-timeout", "6")


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port bound and never listening: a trainer's store nobody hosts (connections refused)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        yield closed.getsockname()[1]


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


async def test_the_trainer_refits_every_engine_through_the_sidecar(checkpoint: Path, token_file: Path) -> None:
    async with sim_engine() as a, sim_engine("decode") as b, sidecar(a.url, b.url, token_file=token_file) as url:
        async with httpx.AsyncClient(timeout=30) as client:
            refit = await client.post(url + "/v1/refit", json={"path": str(checkpoint), "version": "step-7"})
            assert refit.status_code == 200, refit.text
            assert refit.json()["complete"] is True and refit.json()["ok"] == 2
            fleet = (await client.get(url + "/v1/fleet")).json()
            assert [e["weights_version"] for e in fleet["engines"]] == ["step-7", "step-7"]
            digest = digest_files(checkpoint)  # the engines measured their bytes: the function over the files
            assert fleet["desired"] == {"path": str(checkpoint), "version": "step-7", "digest": digest}
            assert [e["weights_digest"] for e in fleet["engines"]] == [digest, digest]
            assert (await client.post(url + "/v1/prefix_cache/reset")).json()["ok"] == 2
            asleep = await client.post(url + "/v1/sleep", json={"tags": []})
            assert asleep.status_code == 200, asleep.text
            assert (await client.post(a.url + "/v1/completions", json={"model": "m", "prompt": "x"})).status_code == 503
            assert (await client.post(url + "/v1/wake", json={})).status_code == 200
            started = await client.post(url + "/v1/profile/start")
            assert started.status_code == 200 and started.json()["ok"] == 2, started.text
            stopped = await client.post(url + "/v1/profile/stop")
            assert stopped.status_code == 200 and stopped.json()["ok"] == 2, stopped.text
            assert (await client.post(url + "/v1/profile/stop")).status_code == 502  # none running any more
            metrics = (await client.get(url + "/metrics")).text
            assert 'drs_sidecar_refits_total{result="complete"} 1.0' in metrics
        assert await served_version(b.url) == "step-7"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"version": "v1"}', "path: Field required"),
        (b'{"path": "/x", "version": "v1", "force": true}', "force: Extra inputs"),
        (b'{"path": "/x", "version": ""}', "version:"),
    ],
)
async def test_bad_refit_bodies_get_400_naming_the_field(body: bytes, fragment: str, token_file: Path) -> None:
    async with sim_engine() as a, sidecar(a.url, token_file=token_file) as url, httpx.AsyncClient() as client:
        response = await client.post(url + "/v1/refit", content=body)
        assert response.status_code == 400
        assert fragment in response.json()["error"]["message"]
        assert (await client.get(url + "/healthz")).status_code == 200


async def test_every_refusal_has_the_one_error_body_and_a_big_body_is_413_like_the_engines(token_file: Path) -> None:
    async with sim_engine() as a, sidecar(a.url, token_file=token_file) as url, httpx.AsyncClient() as client:
        big = await client.post(url + "/v1/refit", content=b'{"path": "' + b"x" * MAX_BODY_BYTES + b'"}')
        bad = await client.post(url + "/v1/refit", content=b"{not json")
        missing = await client.get(url + "/v1/nothing-here")
        for response, status, kind in (
            (big, 413, "request_too_large"),
            (bad, 400, "invalid_request_error"),
            (missing, 404, "not_found_error"),
        ):
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert (set(error), error["type"], error["code"]) == ({"message", "type", "param", "code"}, kind, status)


async def test_an_engine_that_restarts_at_old_weights_is_brought_back_by_the_sidecar(
    checkpoint: Path, token_file: Path
) -> None:
    async with (
        sim_engine() as a,
        sim_engine() as b,
        sidecar(a.url, b.url, token_file=token_file) as url,
        httpx.AsyncClient(timeout=30) as client,
    ):
        assert (
            await client.post(url + "/v1/refit", json={"path": str(checkpoint), "version": "s1"})
        ).status_code == 200
        # an engine pod restarting comes back at its initial weights; here: load others on b directly
        other = checkpoint.parent / "other"
        other.write_text("other weights")
        direct = await client.post(
            b.url + "/control/weights/load",
            json={"path": str(other), "version": "stale"},
            headers={"authorization": f"Bearer {TOKEN}"},
        )
        assert direct.status_code == 200
        for _ in range(100):
            if await served_version(b.url) == "s1":
                break
            await asyncio.sleep(0.1)
        assert await served_version(b.url) == "s1"


def test_the_command_needs_exactly_one_way_to_find_engines() -> None:
    result = CliRunner().invoke(drs, ["sidecar"])
    assert result.exit_code == 2 and "--name" in result.output
    result = CliRunner().invoke(drs, ["sidecar", "--name", "x", "--engine", "http://a:1"])
    assert result.exit_code == 2 and "not both" in result.output


def test_the_collective_timeout_is_bounded_by_the_protocols_limit() -> None:
    result = CliRunner().invoke(drs, ["sidecar", "--engine", "http://a:1", "--collective-timeout", "3601"])
    assert result.exit_code == 2 and "--collective-timeout" in result.output


def test_a_trainer_cannot_set_the_engines_own_deadline() -> None:
    """``timeout_s`` is the sidecar's (its ``--collective-timeout``), never a trainer body's field."""
    from drs_protocol.control import CollectiveUpdate, TrainerCollectiveUpdate
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="timeout_s"):
        TrainerCollectiveUpdate.model_validate({"version": "v", "timeout_s": 5})
    assert CollectiveUpdate(version="v").timeout_s == 300.0
    with pytest.raises(ValidationError, match="timeout_s"):
        CollectiveUpdate(version="v", timeout_s=0)


def test_without_a_control_token_the_command_says_where_to_give_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DRS_CONTROL_TOKEN", raising=False)
    result = CliRunner().invoke(drs, ["sidecar", "--engine", "http://127.0.0.1:1", "--port", "0"])
    assert result.exit_code == 1 and "--control-token-file" in result.output


async def test_the_collective_routes_answer_with_the_group_and_each_engines_refusal(token_file: Path) -> None:
    async with (
        sim_engine() as a,
        sim_engine("decode") as b,
        sidecar(a.url, b.url, token_file=token_file, extra=SHORT_COLLECTIVE) as url,
        httpx.AsyncClient(timeout=30) as client,
    ):
        bad = await client.post(url + "/v1/collective/init", json={"ip": "10.0.0.1", "port": 0, "train_world_size": 8})
        assert bad.status_code == 400 and "port" in bad.json()["error"]["message"]
        with refused_port() as port:
            init = await client.post(
                url + "/v1/collective/init", json={"ip": "127.0.0.1", "port": port, "train_world_size": 8}
            )
        assert init.status_code == 502  # no trainer's store there: each engine says so, naming it
        assert init.json()["group"]["world_size"] == 10
        failed = init.json()["failed"]
        # 400: the store refused within the engine's share; 502: its join outran it (torch's retries)
        assert all(f["detail"][:3] in ("400", "502") for f in failed) and len(failed) == 2, failed
        assert all(f"127.0.0.1:{port}" in f["detail"] for f in failed), failed
        update = await client.post(url + "/v1/collective/update", json={"version": "step-5"})
        assert update.status_code == 409 and "collective/init first" in update.json()["error"]["message"]
