"""A load that carries its announce (``LoadWeights.announce``: one call per engine instead of an
announce round first): the engine takes the target the moment the call arrives, before it queues
for the control lock or reads anything, and answers ``told_lead_s`` (seconds left until the
cut-over, on its clock) and ``late_legs``; a cut-over too far ahead binds nothing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
from drs_protocol.cutover import MAX_SWITCH_AHEAD_S
from drs_protocol.fields import HEADER_WEIGHTS_VERSION
from drs_protocol.lifecycle import WEIGHTS_PENDING_ERROR_TYPE
from drs_protocol.routes import CONTROL_WEIGHTS

from .conftest import EngineFactory, auth
from .test_cutover import chat
from .test_weights_target import LOAD, checkpoint

WAIT_S = 20.0


def folded(path: Path, version: str, at: float, digest: str | None = None) -> dict[str, Any]:
    return {"path": str(path), "version": version, "effective_at": at, "announce": {"digest": digest, "lease_s": 30}}


async def weights(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    answer: dict[str, Any] = (await client.get(url + CONTROL_WEIGHTS, headers=auth())).json()
    return answer


async def test_a_load_carrying_its_target_binds_it_on_arrival_while_another_load_holds_the_lock(
    client: httpx.AsyncClient, engine_factory: EngineFactory, tmp_path: Path
) -> None:
    first, second = checkpoint(tmp_path, "step-1"), checkpoint(tmp_path, "step-2")
    async with engine_factory("prefill", sim={"weightsLoadSeconds": 0.0}) as engine:
        held_until = time.time() + 2.0  # the first load holds the control lock until its cut-over
        busy = asyncio.create_task(
            client.post(
                engine.url + LOAD,
                headers=auth(),
                json={"path": str(first), "version": "step-1", "effective_at": held_until},
            )
        )
        cut = held_until + 0.5
        sent = time.time()
        load = asyncio.create_task(client.post(engine.url + LOAD, headers=auth(), json=folded(second, "step-2", cut)))
        deadline = time.monotonic() + WAIT_S
        while ((await weights(client, engine.url)).get("target") or {}).get("version") != "step-2":
            assert time.monotonic() < deadline, "the load's target never bound the engine"
            await asyncio.sleep(0.01)
        bound_while_queued = not busy.done()
        refused = await chat(client, engine.url, cut + 0.001)  # a turn started after the cut-over
        served = await chat(client, engine.url, cut - 5)  # one started long before it
        first_answer, answer = await busy, await load
        after = await chat(client, engine.url, cut + 1)
    assert bound_while_queued, "the target bound only once the load had the control lock"
    assert refused.status_code == 503 and refused.json()["error"]["type"] == WEIGHTS_PENDING_ERROR_TYPE
    assert served.status_code == 200 and served.headers[HEADER_WEIGHTS_VERSION] in {"0", "step-1"}
    assert first_answer.status_code == 200, first_answer.text
    assert answer.status_code == 200, answer.text
    result = answer.json()["result"]
    assert 0 < result["told_lead_s"] <= cut - sent, result
    assert result.get("late_legs", 0) == 0  # answers leave defaults out
    assert "told_lead_s" not in first_answer.json()["result"]  # it carried no target
    assert after.status_code == 200 and after.headers[HEADER_WEIGHTS_VERSION] == "step-2"


async def test_a_load_carrying_its_target_after_the_cut_over_says_so_and_counts_the_late_legs(
    client: httpx.AsyncClient, engine_factory: EngineFactory, tmp_path: Path
) -> None:
    step = checkpoint(tmp_path, "step-1")
    async with engine_factory("prefill", sim={"weightsLoadSeconds": 0.0}) as engine:
        cut = time.time() - 0.5
        late = await chat(client, engine.url, cut + 0.001)  # answered at the old weights: nothing told it yet
        answer = await client.post(engine.url + LOAD, headers=auth(), json=folded(step, "step-1", cut))
    assert late.status_code == 200 and late.headers[HEADER_WEIGHTS_VERSION] == "0"
    assert answer.status_code == 200, answer.text
    assert answer.json()["result"]["told_lead_s"] < 0
    assert answer.json()["result"]["late_legs"] == 1


async def test_a_load_carrying_a_cut_over_too_far_ahead_binds_nothing(
    client: httpx.AsyncClient, engine_factory: EngineFactory, tmp_path: Path
) -> None:
    step = checkpoint(tmp_path, "step-1")
    async with engine_factory("prefill") as engine:
        at = time.time() + MAX_SWITCH_AHEAD_S + 30
        refused = await client.post(engine.url + LOAD, headers=auth(), json=folded(step, "step-1", at))
        info = await weights(client, engine.url)
        served = await chat(client, engine.url, at + 1)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "effective_at"
    assert info.get("target") is None and info["weights_version"] == "0"
    assert served.status_code == 200
