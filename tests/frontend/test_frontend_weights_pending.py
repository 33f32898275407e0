"""A frontend facing engines that do not hold the announced target weights (503 ``weights_pending``):
it skips them for ``weightsPendingRetrySeconds``, serves the turn on one that holds the target, or
holds it until one does, up to ``weightsPendingHoldSeconds``. Real sim engines and frontends."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_engine.server.runner import RunningEngine, start_engine
from drs_frontend.legs import weights_pending
from drs_frontend.upstream import UpstreamResponse
from drs_protocol.errors import error_body
from drs_protocol.fields import HEADER_PREFILL_ENGINE, HEADER_WEIGHTS_VERSION, control_auth
from drs_protocol.lifecycle import DRAINING_ERROR_TYPE, WEIGHTS_PENDING_ERROR_TYPE
from drs_protocol.routes import CONTROL_ROUTES, ControlOp, Endpoint

from .conftest import Replica, chat_body, metric_value, sim_config

TOKEN = "frontend-test-token"
WAIT_S = 20.0


@contextlib.asynccontextmanager
async def replica(prefill: int, decode: int = 1) -> AsyncIterator[Replica]:
    async with contextlib.AsyncExitStack() as stack:
        engines = {
            role: [
                await stack.enter_async_context(
                    start_engine(sim_config(role, sim={"weightsLoadSeconds": 0.0}), control_token=TOKEN)
                )
                for _ in range(n)
            ]
            for role, n in (("prefill", prefill), ("decode", decode))
        }
        yield Replica(engines["prefill"], engines["decode"], stack=stack)


async def control(client: httpx.AsyncClient, engine: RunningEngine, op: ControlOp, body: dict[str, Any]) -> None:
    response = await client.post(engine.url + CONTROL_ROUTES[op], headers=control_auth(TOKEN), json=body)
    assert response.status_code == 200, response.text


async def announce(client: httpx.AsyncClient, engine: RunningEngine, version: str) -> None:
    await control(client, engine, ControlOp.ANNOUNCE_WEIGHTS_TARGET, {"version": version, "lease_s": 60})


def pending_answers(metrics: str) -> float:
    return metric_value(
        metrics, "drs_frontend_upstream_errors_total", f'{{kind="{WEIGHTS_PENDING_ERROR_TYPE}",role="prefill"}}'
    )


async def test_an_engine_pending_the_target_is_skipped_for_one_that_holds_it(client: httpx.AsyncClient) -> None:
    async with replica(prefill=2) as r:
        pending, current = r.prefill
        front = await r.add_frontend(ctx_router="round_robin")
        await announce(client, pending, "step-1")
        answers = [await client.post(front.url + Endpoint.CHAT, json=chat_body(f"turn {i}")) for i in range(4)]
        metrics = (await client.get(front.url + "/metrics")).text
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert {a.headers[HEADER_PREFILL_ENGINE] for a in answers} == {current.url}
    assert pending_answers(metrics) >= 1


async def test_a_turn_is_held_until_an_engine_holds_the_target_then_runs_there(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "step-1"
    checkpoint.write_text("weights of step 1")
    async with replica(prefill=1) as r:
        (engine,) = r.prefill
        front = await r.add_frontend()  # holdSeconds 0: a down engine would be a 503 at once
        await announce(client, engine, "step-1")
        turn = asyncio.create_task(client.post(front.url + Endpoint.CHAT, json=chat_body("held")))
        async with asyncio.timeout(WAIT_S):
            while pending_answers((await client.get(front.url + "/metrics")).text) < 1:
                await asyncio.sleep(0.01)
        assert not turn.done()
        await control(client, engine, ControlOp.LOAD_WEIGHTS, {"path": str(checkpoint), "version": "step-1"})
        loaded = time.monotonic()
        answer = await asyncio.wait_for(turn, WAIT_S)
        ran_after = time.monotonic() - loaded
        prefill_version = await client.post(engine.url + Endpoint.CHAT, json=chat_body("direct"))
    assert answer.status_code == 200, answer.text
    assert answer.headers[HEADER_PREFILL_ENGINE] == engine.url
    assert prefill_version.headers[HEADER_WEIGHTS_VERSION] == "step-1"
    assert ran_after < 5.0  # looked again within weightsPendingRetrySeconds, not at the next probe


async def test_a_turn_held_past_weights_pending_hold_seconds_is_a_503_naming_the_role(
    client: httpx.AsyncClient,
) -> None:
    async with replica(prefill=1) as r:
        front = await r.add_frontend(weights_pending_hold_seconds=0.3)
        await announce(client, r.prefill[0], "step-1")
        started = time.monotonic()
        answer = await client.post(front.url + Endpoint.CHAT, json=chat_body("never"))
        waited = time.monotonic() - started
    assert answer.status_code == 503
    assert "prefill" in answer.json()["error"]["message"]
    assert 0.3 <= waited < 5.0


async def test_a_generation_leg_waits_for_its_decode_engine_to_hold_the_target(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "step-1"
    checkpoint.write_text("weights of step 1")
    async with replica(prefill=1, decode=1) as r:
        front = await r.add_frontend()
        (decode,) = r.decode
        await announce(client, decode, "step-1")
        turn = asyncio.create_task(client.post(front.url + Endpoint.CHAT, json=chat_body("held at decode")))
        async with asyncio.timeout(WAIT_S):
            while not metric_value(
                (await client.get(front.url + "/metrics")).text,
                "drs_frontend_upstream_errors_total",
                f'{{kind="{WEIGHTS_PENDING_ERROR_TYPE}",role="decode"}}',
            ):
                await asyncio.sleep(0.01)
        await control(client, decode, ControlOp.LOAD_WEIGHTS, {"path": str(checkpoint), "version": "step-1"})
        answer = await asyncio.wait_for(turn, WAIT_S)
    assert answer.status_code == 200, answer.text
    assert answer.headers[HEADER_WEIGHTS_VERSION] == "step-1"  # its tokens come from the target weights


@pytest.mark.parametrize(
    ("status", "body", "pending"),
    [
        pytest.param(503, error_body(503, "x", type_=WEIGHTS_PENDING_ERROR_TYPE), True, id="503 weights_pending"),
        pytest.param(503, error_body(503, "x", type_=DRAINING_ERROR_TYPE), False, id="503 draining"),
        pytest.param(400, error_body(400, "x", type_=WEIGHTS_PENDING_ERROR_TYPE), False, id="another status"),
        pytest.param(503, b"not json", False, id="a body that is not JSON"),
        pytest.param(503, [1, 2], False, id="JSON that is not an error body"),
    ],
)
def test_only_a_503_whose_error_type_is_weights_pending_counts(status: int, body: Any, pending: bool) -> None:
    import json

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert weights_pending(UpstreamResponse(status, "application/json", raw)) is pending
