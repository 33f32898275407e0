"""The operator's engine client (``drs_operator.kube.engines``) against real sim engines (the GPU
engine's test double) and sockets that never answer: an answer is what the engine holds; a wrong
token, a refused port, an engine that hangs or one past the pass's budget is unknown, and a pass
returns within its budget whatever the engines do."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

from drs_engine.config import build_config
from drs_engine.server.runner import RunningEngine, start_engine
from drs_operator.engine_observation import Target
from drs_operator.kube.engines import EngineClient, control_token
from drs_protocol.weights_state import DesiredWeights

TOKEN = "operator-test-token"


@contextlib.asynccontextmanager
async def sim_engine() -> AsyncIterator[RunningEngine]:
    config = build_config({"backend": "sim", "role": "decode", "host": "127.0.0.1", "port": 0, "sim": {"speed": 0}})
    async with start_engine(config, control_token=TOKEN) as engine:
        yield engine


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[tuple[str, list[int]]]:
    """Accepts connections and never answers; yields its URL and the peak of open connections."""
    open_now, peak = 0, [0]
    release = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now
        open_now += 1
        peak[0] = max(peak[0], open_now)
        try:
            await release.wait()
        finally:
            open_now -= 1
            writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", peak
    finally:
        release.set()
        server.close()
        await server.wait_closed()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_an_engine_answers_what_it_holds_and_a_wrong_token_or_closed_port_is_unknown() -> None:
    client = EngineClient()
    try:
        async with sim_engine() as engine:
            ok, wrong = await asyncio.gather(
                client.weights(Target("e0", engine.url), TOKEN), client.weights(Target("e0", engine.url), "nope")
            )
            info = await client.observe([Target("e0", engine.url)], TOKEN)
        assert ok.held is not None and ok.held.version and ok.held.digest and ok.held.digest.startswith("wd1:")
        assert info[0].held == ok.held
        assert wrong.held is None and "401" in wrong.detail
        refused = await client.weights(Target("gone", f"http://127.0.0.1:{_closed_port()}"), TOKEN)
        assert refused.held is None and "unreachable" in refused.detail
        assert [o.held for o in await client.observe([Target("e0", "http://127.0.0.1:1")], None)] == [None]
    finally:
        await client.close()


async def test_a_hung_engine_is_unknown_within_the_call_timeout() -> None:
    client = EngineClient(call_s=0.3, budget_s=5.0)
    try:
        async with silent_server() as (url, _):
            started = time.monotonic()
            (obs,) = await client.observe([Target("hung", url)], TOKEN)
            took = time.monotonic() - started
        assert obs.held is None and "no answer within 0.3s" in obs.detail
        assert took < 2.0, took
    finally:
        await client.close()


async def test_a_pass_returns_within_its_budget_with_bounded_concurrency_and_answers_kept() -> None:
    client = EngineClient(call_s=30.0, budget_s=0.5, concurrency=4)
    try:
        async with sim_engine() as engine, silent_server() as (url, peak):
            targets = [Target("real", engine.url), *(Target(f"hung-{i}", url) for i in range(12))]
            started = time.monotonic()
            out = await client.observe(targets, TOKEN)
            took = time.monotonic() - started
        assert took < 0.5 + 1.0, took
        assert [o.engine for o in out] == [t.engine for t in targets]
        assert out[0].held is not None, "an engine that answered in time keeps its answer"
        assert all(o.held is None and "budget" in o.detail for o in out[1:]), out
        assert 1 <= peak[0] <= 4, peak
    finally:
        await client.close()


def test_the_control_token_is_read_from_the_fleets_secret() -> None:
    encoded = base64.b64encode(b"s3cret").decode()
    assert control_token({"fleet-control": {"data": {"token": encoded}}}, "fleet") == "s3cret"
    assert control_token({"fleet-control": {"stringData": {"token": "plain"}}}, "fleet") == "plain"
    assert control_token({"fleet-control": {"data": {"token": "%%%"}}}, "fleet") is None
    assert control_token({}, "fleet") is None


async def test_an_engine_catching_up_says_why_and_is_not_serving(tmp_path: Path) -> None:
    """A real sim engine started under desired weights whose path does not exist: up, not ready;
    asked as a not-serving target, its answer carries the reason."""
    config = build_config({"backend": "sim", "role": "decode", "host": "127.0.0.1", "port": 0, "sim": {"speed": 0}})
    desired = DesiredWeights(version="step-2", path=str(tmp_path / "not-there"))
    client = EngineClient()
    try:
        async with start_engine(config, control_token=TOKEN, desired_weights=desired) as engine:
            catch_up = engine.server.state.catch_up
            assert catch_up is not None
            async with asyncio.timeout(20):
                while catch_up.attempts < 1 or catch_up.last_error is None:
                    async with engine.server.state.control_lock:  # an attempt runs under it
                        pass
                    await asyncio.sleep(0)
            obs = await client.weights(Target("e0", engine.url, serving=False), TOKEN)
        assert not obs.serving and obs.held is not None
        assert obs.catch_up is not None and "not-there" in obs.catch_up and "does not exist" in obs.catch_up
    finally:
        await client.close()
