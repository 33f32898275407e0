"""Self-healing engines, with real sim engines on loopback: an engine started under desired
weights with no checkpoint path catches up from a serving peer (its first answer is at the desired
digest and generates the peer's tokens); a peer that dies mid-stream or sends other bytes is
skipped, named, and nothing of it is loaded; a desired load that fails keeps the engine up and
not ready (503 ``weights_pending`` with the reason) and it recovers when the path appears."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from drs_engine.errors import WeightsLoadError
from drs_engine.server.runner import RunningEngine, start_engine
from drs_engine.weights.desired import Peers, weights_from_env
from drs_protocol import env
from drs_protocol.lifecycle import WEIGHTS_PENDING_ERROR_TYPE
from drs_protocol.routes import CONTROL_WEIGHTS, CONTROL_WEIGHTS_STREAM
from drs_protocol.token_source import TokenSource
from drs_protocol.weights_digest import digest_files
from drs_protocol.weights_state import DesiredWeights
from drs_protocol.weights_stream import WeightsPeers

from .conftest import CONTROL_TOKEN, auth, sim_config

CHAT = "/v1/chat/completions"
#: Longest a test waits for an engine's catch-up to end (an event; retries start at 1 s).
CATCH_UP_WAIT_S = 20.0


def checkpoint(root: Path, name: str, files: dict[str, bytes]) -> Path:
    path = root / name
    path.mkdir()
    for rel, content in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(content)
    return path


async def tokens(client: httpx.AsyncClient, url: str) -> list[int]:
    body = {"model": "m", "messages": [{"role": "user", "content": "same prompt"}], "max_tokens": 6}
    response = await client.post(url + CHAT, json=body)
    response.raise_for_status()
    return list(response.json()["choices"][0]["token_ids"])


async def caught_up(engine: RunningEngine) -> None:
    catch_up = engine.server.state.catch_up
    assert catch_up is not None, "the engine started under weights it did not hold"
    async with asyncio.timeout(CATCH_UP_WAIT_S):
        await catch_up.done.wait()


async def failed_once(engine: RunningEngine) -> None:
    catch_up = engine.server.state.catch_up
    assert catch_up is not None
    async with asyncio.timeout(CATCH_UP_WAIT_S):
        while catch_up.last_error is None:  # set by the attempt, under the control lock
            async with engine.server.state.control_lock:
                pass
            await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def peer_at(tmp_path: Path) -> AsyncIterator[tuple[RunningEngine, DesiredWeights]]:
    """A serving sim engine refitted (by path) to step-3; the desired weights without that path."""
    path = checkpoint(tmp_path, "step-3", {"a.bin": b"layer a " * 5000, "b/c.bin": b"layer c" * 3000})
    async with start_engine(sim_config(), control_token=CONTROL_TOKEN) as peer, httpx.AsyncClient() as client:
        load = await client.post(
            peer.url + "/control/weights/load", json={"path": str(path), "version": "step-3"}, headers=auth()
        )
        assert load.status_code == 200
        yield peer, DesiredWeights(version="step-3", digest=digest_files(path))


async def test_an_engine_with_pathless_desired_weights_catches_up_from_a_serving_peer(tmp_path: Path) -> None:
    async with (
        peer_at(tmp_path) as (peer, desired),
        httpx.AsyncClient(timeout=30) as client,
        start_engine(
            sim_config(), control_token=CONTROL_TOKEN, desired_weights=desired, weights_peers=[peer.url]
        ) as late,
    ):
        await caught_up(late)
        held = (await client.get(late.url + CONTROL_WEIGHTS, headers=auth())).json()
        first = await tokens(client, late.url)
        assert held["weights_version"] == "step-3" and held["weights_digest"] == desired.digest
        assert held["catch_up"]["phase"] == "reached" and held["catch_up"]["reached_from"] == peer.url
        assert first == await tokens(client, peer.url), "the peer's weights: the peer's tokens"
        # and it serves as a peer in turn: a third engine catches up from it
        async with start_engine(
            sim_config(), control_token=CONTROL_TOKEN, desired_weights=desired, weights_peers=[late.url]
        ) as third:
            await caught_up(third)
            assert await tokens(client, third.url) == first


async def test_an_engine_serves_nothing_before_it_holds_the_desired_weights(tmp_path: Path) -> None:
    """While pending: /health and turns answer 503 weights_pending; the stream route refuses too."""
    desired = DesiredWeights(version="step-4", path=str(tmp_path / "not-yet"))
    async with (
        start_engine(sim_config(), control_token=CONTROL_TOKEN, desired_weights=desired) as engine,
        httpx.AsyncClient(timeout=30) as client,
    ):
        await failed_once(engine)
        health = await client.get(engine.url + "/health")
        assert health.status_code == 503 and health.json()["error"]["type"] == WEIGHTS_PENDING_ERROR_TYPE
        assert "not-yet" in health.json()["error"]["message"] and "does not exist" in health.json()["error"]["message"]
        turn = await client.post(engine.url + CHAT, json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert turn.status_code == 503 and turn.json()["error"]["type"] == WEIGHTS_PENDING_ERROR_TYPE
        stream = await client.get(engine.url + CONTROL_WEIGHTS_STREAM, headers=auth())
        assert stream.status_code == 503
        held = (await client.get(engine.url + CONTROL_WEIGHTS, headers=auth())).json()
        assert held["catch_up"]["phase"] == "pending" and held["catch_up"]["attempts"] >= 1
        assert "does not exist" in held["catch_up"]["last_error"]


async def test_a_failed_desired_load_stays_up_and_recovers_when_the_path_appears(tmp_path: Path) -> None:
    content = {"model.safetensors": b"the weights of step 5"}
    desired = DesiredWeights(version="step-5", path=str(tmp_path / "step-5"), digest=None)
    async with (
        start_engine(sim_config(), control_token=CONTROL_TOKEN, desired_weights=desired) as engine,
        httpx.AsyncClient(timeout=30) as client,
    ):
        await failed_once(engine)
        checkpoint(tmp_path, "step-5", content)  # the path appears (a slow shared filesystem)
        await caught_up(engine)
        assert (await client.get(engine.url + "/health")).status_code == 200
        held = (await client.get(engine.url + CONTROL_WEIGHTS, headers=auth())).json()
        assert held["weights_version"] == "step-5"
        assert held["weights_digest"] == digest_files(tmp_path / "step-5")
        assert held["catch_up"]["attempts"] >= 2 and held["catch_up"].get("last_error") is None


async def test_the_sidecars_load_ends_a_pending_catch_up(tmp_path: Path) -> None:
    desired = DesiredWeights(version="step-6", path=str(tmp_path / "gone"))
    newer = checkpoint(tmp_path, "step-7", {"w": b"seven"})
    async with (
        start_engine(sim_config(), control_token=CONTROL_TOKEN, desired_weights=desired) as engine,
        httpx.AsyncClient(timeout=30) as client,
    ):
        await failed_once(engine)
        load = await client.post(
            engine.url + "/control/weights/load", json={"path": str(newer), "version": "step-7"}, headers=auth()
        )
        assert load.status_code == 200
        assert (await client.get(engine.url + "/health")).status_code == 200


# ---- peers that fail: a real socket replaying a real peer's stream, cut or altered ------------

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def replaying(
    stream: bytes, mangle: Callable[[bytes], bytes], *, cut_at: int | None = None
) -> AsyncIterator[str]:
    """A peer at the URL yielded that answers the stream route with ``mangle(stream)`` under the
    real ``content-length``, closing the connection after ``cut_at`` bytes of the body."""
    body = mangle(stream)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = f"HTTP/1.1 200 OK\r\ncontent-length: {len(stream)}\r\ncontent-type: application/octet-stream\r\n\r\n"
        writer.write(head.encode() + (body if cut_at is None else body[:cut_at]))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


def flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


async def test_a_peer_that_dies_mid_stream_or_sends_other_bytes_is_skipped_and_named(tmp_path: Path) -> None:
    async with peer_at(tmp_path) as (peer, desired), httpx.AsyncClient(timeout=30) as client:
        real = (await client.get(peer.url + CONTROL_WEIGHTS_STREAM, headers=auth())).content
        async with (
            replaying(real, lambda b: b, cut_at=len(real) // 2) as dying,
            replaying(real, flip_last_byte) as lying,
            start_engine(
                sim_config(), control_token=CONTROL_TOKEN, desired_weights=desired, weights_peers=[dying, lying]
            ) as engine,
        ):
            await failed_once(engine)
            error = engine.server.state.catch_up.last_error  # type: ignore[union-attr]
            assert error is not None
            assert f"{dying}: RemoteProtocolError: peer closed connection" in error, error
            assert lying in error and "digest" in error, error
            held = (await client.get(engine.url + CONTROL_WEIGHTS, headers=auth())).json()
            assert held["weights_digest"] != desired.digest, "nothing of the bad peers was loaded"
            assert held["weights_version"] != "step-3"
            assert (await client.get(engine.url + "/health")).status_code == 503
        # the same bad peers first, then the real one: caught up from the real one
        async with (
            replaying(real, lambda b: b, cut_at=len(real) // 2) as dying,
            replaying(real, flip_last_byte) as lying,
            start_engine(
                sim_config(),
                control_token=CONTROL_TOKEN,
                desired_weights=desired,
                weights_peers=[dying, lying, peer.url],
            ) as engine,
        ):
            await caught_up(engine)
            held = (await client.get(engine.url + CONTROL_WEIGHTS, headers=auth())).json()
            assert held["weights_digest"] == desired.digest and held["catch_up"]["reached_from"] == peer.url
            assert await tokens(client, engine.url) == await tokens(client, peer.url)


async def test_a_peer_holding_other_weights_or_refusing_the_token_is_skipped(tmp_path: Path) -> None:
    async with (
        peer_at(tmp_path) as (peer, desired),
        start_engine(sim_config(), control_token=CONTROL_TOKEN) as stale,
        start_engine(sim_config(), control_token="another fleet's token") as foreign,
        start_engine(
            sim_config(), control_token=CONTROL_TOKEN, desired_weights=desired, weights_peers=[stale.url, foreign.url]
        ) as engine,
    ):
        await failed_once(engine)
        error = engine.server.state.catch_up.last_error  # type: ignore[union-attr]
        assert error is not None
        assert f"{stale.url}: holds" in error and "not the desired digest" in error, error
        assert f"{foreign.url}: answered 401" in error, error
        assert peer.url not in error


async def test_a_catch_up_presents_the_control_token_of_its_moment(tmp_path: Path) -> None:
    """The engine's control token is rotated while it catches up: its next attempt presents the
    new one (the token source re-read from the mounted directory), not the one it started with."""
    tokens = tmp_path / "control-token"
    tokens.mkdir()
    (tokens / "token").write_text("a-token-the-peer-refuses")
    source = TokenSource(tokens, what="control token")
    async with (
        peer_at(tmp_path) as (peer, desired),
        start_engine(sim_config(), control_token=source, desired_weights=desired, weights_peers=[peer.url]) as late,
    ):
        await failed_once(late)  # the peer refused the stale token (401)
        catch_up = late.server.state.catch_up
        assert catch_up is not None and catch_up.pending
        (tokens / "token").write_text(CONTROL_TOKEN)
        await caught_up(late)
        assert catch_up.reached_from == peer.url


async def test_a_peer_placed_after_the_engine_started_is_asked_from_the_mounted_peers_file(tmp_path: Path) -> None:
    """The env list (read at the start) names no peer that holds them; the mounted ConfigMap's
    ``peers`` file, written after the start, does: the next attempt reads it and catches up."""
    mounted = tmp_path / "weights"
    mounted.mkdir()
    peers_file = mounted / env.WEIGHTS_PEERS_KEY
    peers_file.write_text("[]")  # the operator knew of no serving peer when the pod started
    given = weights_from_env({env.WEIGHTS_DIR: str(mounted), env.WEIGHTS_PEERS_JSON: '["http://127.0.0.1:9"]'})
    async with (
        peer_at(tmp_path) as (peer, desired),
        httpx.AsyncClient(timeout=30) as client,
        start_engine(
            sim_config(), control_token=CONTROL_TOKEN, desired_weights=desired, weights_peers=given["weights_peers"]
        ) as late,
    ):
        await failed_once(late)
        first_error = (await client.get(late.url + CONTROL_WEIGHTS, headers=auth())).json()["catch_up"]
        peers_file.write_text(WeightsPeers((peer.url,)).dump())  # the kubelet updates the mounted file
        await caught_up(late)
        held = (await client.get(late.url + CONTROL_WEIGHTS, headers=auth())).json()
    assert "no serving peer holds them" in first_error["last_error"], first_error  # the file's [], not the env's
    assert held["weights_digest"] == desired.digest
    assert held["catch_up"]["reached_from"] == peer.url


def test_the_peers_file_wins_over_the_env_and_a_bad_one_is_named(tmp_path: Path) -> None:
    given = ("http://10.0.0.1:8000",)
    file = tmp_path / env.WEIGHTS_PEERS_KEY
    assert Peers(given, file).current() == given  # not mounted (or no peers key): the env's list
    file.write_text('["http://10.0.0.2:8000"]')
    assert Peers(given, file).current() == ("http://10.0.0.2:8000",)
    file.write_text("")
    assert Peers(given, file).current() == ()
    file.write_text('"http://10.0.0.2:8000"')
    with pytest.raises(WeightsLoadError, match=r"peers file .*not a JSON list") as caught:
        Peers(given, file).current()
    assert caught.value.param == "peers"
    assert weights_from_env({})["weights_peers"] == Peers((), None)
