"""The announced target weights: an engine that does not hold them refuses new legs (503
``weights_pending``) until it does, or until the target lapses; legs already running go on."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_engine.errors import WeightsPendingError
from drs_engine.weights.target import TargetGate
from drs_protocol.control import WeightsTarget
from drs_protocol.fields import HEADER_WEIGHTS_VERSION, RETRY_AFTER_HEADER
from drs_protocol.lifecycle import FIELD_WEIGHTS_BOUNDARY, FIELD_WEIGHTS_VERSION, WEIGHTS_PENDING_ERROR_TYPE
from drs_protocol.routes import CONTROL_ROUTES, CONTROL_WEIGHTS, ControlOp, Endpoint
from drs_protocol.weights_digest import digest_files
from pydantic import ValidationError

from .conftest import EngineFactory, auth
from .test_nothing_lost import MAX_TOKENS, SLOW_DECODE, completion, sse_events
from .test_protocol import PROMPT_IDS

TARGET = CONTROL_ROUTES[ControlOp.ANNOUNCE_WEIGHTS_TARGET]
LOAD = CONTROL_ROUTES[ControlOp.LOAD_WEIGHTS]
CHAT: dict[str, Any] = {"model": "sim", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 4}


def checkpoint(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir()
    (path / "model.safetensors").write_bytes(name.encode() * 8)
    return path


async def announce(client: httpx.AsyncClient, url: str, version: str | None, **extra: Any) -> dict[str, Any]:
    response = await client.post(url + TARGET, headers=auth(), json={"version": version, "lease_s": 60, **extra})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def test_an_engine_refuses_new_legs_until_it_holds_the_announced_target(
    client: httpx.AsyncClient, engine_factory: EngineFactory, tmp_path: Path
) -> None:
    step = checkpoint(tmp_path, "step-1")
    async with engine_factory("prefill", sim={"weightsLoadSeconds": 0.0}) as engine:
        answer = await announce(client, engine.url, "step-1", digest=digest_files(step))
        refused = await client.post(engine.url + Endpoint.CHAT, json=CHAT)
        shown = (await client.get(engine.url + CONTROL_WEIGHTS, headers=auth())).json()
        load = await client.post(engine.url + LOAD, headers=auth(), json={"path": str(step), "version": "step-1"})
        admitted = await client.post(engine.url + Endpoint.CHAT, json=CHAT)
        held = (await client.get(engine.url + CONTROL_WEIGHTS, headers=auth())).json()
    assert answer["result"]["target"]["held"] is False
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == WEIGHTS_PENDING_ERROR_TYPE
    assert "step-1" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers[RETRY_AFTER_HEADER]) <= 60
    assert shown["weights_version"] == "0"
    assert shown["target"]["version"] == "step-1" and shown["target"]["held"] is False
    assert load.status_code == 200, load.text
    assert admitted.status_code == 200
    assert admitted.headers[HEADER_WEIGHTS_VERSION] == "step-1"
    assert held["target"]["held"] is True


async def test_the_same_version_with_other_bytes_is_not_the_target(
    client: httpx.AsyncClient, engine_factory: EngineFactory, tmp_path: Path
) -> None:
    step, other = checkpoint(tmp_path, "step-1"), checkpoint(tmp_path, "other")
    async with engine_factory("prefill", sim={"weightsLoadSeconds": 0.0}) as engine:
        await client.post(engine.url + LOAD, headers=auth(), json={"path": str(other), "version": "step-1"})
        await announce(client, engine.url, "step-1", digest=digest_files(step))
        refused = await client.post(engine.url + Endpoint.CHAT, json=CHAT)
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == WEIGHTS_PENDING_ERROR_TYPE


async def test_a_withdrawn_target_admits_legs_again(client: httpx.AsyncClient, engine_factory: EngineFactory) -> None:
    async with engine_factory("prefill") as engine:
        await announce(client, engine.url, "step-9")
        refused = await client.post(engine.url + Endpoint.CHAT, json=CHAT)
        withdrawn = await announce(client, engine.url, None)
        admitted = await client.post(engine.url + Endpoint.CHAT, json=CHAT)
        shown = (await client.get(engine.url + CONTROL_WEIGHTS, headers=auth())).json()
    assert refused.status_code == 503
    assert "target" not in withdrawn["result"]
    assert admitted.status_code == 200 and admitted.headers[HEADER_WEIGHTS_VERSION] == "0"
    assert "target" not in shown


async def test_an_announce_does_not_wait_behind_a_load_in_flight(
    client: httpx.AsyncClient, engine_factory: EngineFactory, tmp_path: Path
) -> None:
    """The announce must reach an engine before its load: one queued behind the control lock would not."""
    step = checkpoint(tmp_path, "step-1")
    async with engine_factory("prefill", sim={"speed": 1.0, "weightsLoadSeconds": 30.0}) as engine:
        load = asyncio.create_task(
            client.post(engine.url + LOAD, headers=auth(), json={"path": str(step), "version": "step-1"}, timeout=60)
        )
        try:
            answer = await asyncio.wait_for(announce(client, engine.url, "step-2"), 5.0)
        finally:
            load.cancel()
    assert answer["result"]["target"]["version"] == "step-2"
    assert answer["waited_s"] < 1.0


async def test_a_leg_in_flight_when_the_target_is_announced_keeps_going_and_is_marked_at_the_load(
    client: httpx.AsyncClient, engine_factory: EngineFactory, tmp_path: Path
) -> None:
    step = tmp_path / "step-2"
    step.write_text("new weights")
    async with engine_factory("prefill", sim=SLOW_DECODE) as engine:
        tokens: list[int] = []
        last: dict[str, Any] = {}
        request = completion(PROMPT_IDS, MAX_TOKENS, stream=True)
        async with client.stream("POST", engine.url + Endpoint.COMPLETIONS, json=request) as response:
            async for chunk in sse_events(response):
                tokens += chunk["choices"][0]["token_ids"]
                last = chunk
                if len(tokens) == 5:  # mid-decode: the sidecar announces, then loads
                    await announce(client, engine.url, "step-2")
                    refused = await client.post(engine.url + Endpoint.CHAT, json=CHAT)
                    load = await client.post(
                        engine.url + LOAD, headers=auth(), json={"path": str(step), "version": "step-2"}
                    )
                    assert load.status_code == 200, load.text
    assert refused.status_code == 503
    assert len(tokens) == MAX_TOKENS
    assert last[FIELD_WEIGHTS_VERSION] == "step-2"
    assert 5 <= last[FIELD_WEIGHTS_BOUNDARY] < MAX_TOKENS


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("version", "digest", "admitted"),
    [
        pytest.param("v2", None, True, id="the target's version, no digest to compare: admitted"),
        pytest.param("v2", "wd1:" + "a" * 64, True, id="the target's version and digest: admitted"),
        pytest.param("v2", "wd1:" + "b" * 64, False, id="the target's version with other bytes: refused"),
        pytest.param("v1", "wd1:" + "a" * 64, False, id="another version: refused"),
    ],
)
def test_the_gate_admits_exactly_the_engines_that_hold_the_target(
    version: str, digest: str | None, admitted: bool
) -> None:
    gate = TargetGate(Clock())
    gate.announce(WeightsTarget(version="v2", digest="wd1:" + "a" * 64, lease_s=10), "v1", None)
    if admitted:
        gate.check(version, digest)
    else:
        with pytest.raises(WeightsPendingError):
            gate.check(version, digest)


def test_a_target_lapses_when_its_lease_ends_unless_announced_again() -> None:
    """A sidecar that died between its announce and its loads leaves no engine refusing for good."""
    clock = Clock()
    gate = TargetGate(clock)
    gate.announce(WeightsTarget(version="v2", lease_s=10), "v1", None)
    clock.now += 9
    with pytest.raises(WeightsPendingError) as refused:
        gate.check("v1", None)
    assert refused.value.retry_after_s == 1
    gate.announce(WeightsTarget(version="v2", lease_s=10), "v1", None)  # renewed
    clock.now += 9
    with pytest.raises(WeightsPendingError):
        gate.check("v1", None)
    clock.now += 1
    gate.check("v1", None)  # lapsed: admitted at the weights it holds
    assert gate.state("v1", None) is None


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"version": "v2", "lease_s": 0}, id="a lease of 0 seconds"),
        pytest.param({"version": "v2", "lease_s": 7200}, id="a lease over the bound"),
        pytest.param({"version": " v2", "lease_s": 5}, id="a version with surrounding whitespace"),
        pytest.param({"version": "v2", "digest": "sha:1", "lease_s": 5}, id="a digest of another format"),
        pytest.param({"version": "v2"}, id="no lease"),
    ],
)
def test_a_bad_announce_is_refused_naming_the_field(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        WeightsTarget.model_validate(body)


async def test_a_bad_announce_is_a_400_and_changes_nothing(
    client: httpx.AsyncClient, engine_factory: EngineFactory
) -> None:
    async with engine_factory("prefill") as engine:
        response = await client.post(engine.url + TARGET, headers=auth(), json={"version": "v2", "lease_s": -1})
        admitted = await client.post(engine.url + Endpoint.CHAT, json=CHAT)
    assert response.status_code == 400
    assert "lease_s" in response.text
    assert admitted.status_code == 200
