"""``POST /control/collective/abort`` and the engine that never serves half-loaded weights, on the
sim (the torch backend's real group and broadcast: ``tests/gpu/test_collective_faults.py``)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from drs_engine.errors import CollectiveError, EngineError
from drs_engine.server.runner import RunningEngine
from drs_engine.weights import incomplete

from .conftest import auth

ABORT = "/control/collective/abort"
BODY = {"model": "sim", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 4}


async def test_an_abort_is_answered_while_another_control_call_holds_the_lock(
    client: httpx.AsyncClient, prefill: RunningEngine
) -> None:
    """A collective update in flight holds the control lock; the abort must reach it, not queue."""
    state = prefill.server.state
    async with state.control_lock:
        queued = asyncio.ensure_future(client.post(prefill.url + "/control/prefix_cache/reset", headers=auth()))
        answer = await asyncio.wait_for(
            client.post(prefill.url + ABORT, headers=auth(), json={"reason": "e-1 hung"}), 10
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["result"] == {"aborted": False}  # the sim has no group
        assert not queued.done(), "an ordinary control call still waits for the lock"
    assert (await queued).status_code == 200


async def test_an_abort_needs_a_reason_and_the_token(client: httpx.AsyncClient, prefill: RunningEngine) -> None:
    assert (await client.post(prefill.url + ABORT, json={"reason": "x"})).status_code == 401
    missing = await client.post(prefill.url + ABORT, headers=auth(), json={})
    assert missing.status_code == 400 and "reason" in missing.text


async def test_an_engine_holding_part_of_a_failed_update_refuses_turns_and_health_until_a_good_load(
    client: httpx.AsyncClient, prefill: RunningEngine
) -> None:
    state = prefill.server.state
    incomplete.settle(state, CollectiveError("rank 3: batch 2/5 did not arrive", weights_changed=True), "a", "a")
    for answer in (
        await client.get(prefill.url + "/health"),
        await client.post(prefill.url + "/v1/chat/completions", json=BODY),
    ):
        assert answer.status_code == 503
        assert answer.json()["error"]["type"] == "weights_incomplete"
        assert "batch 2/5" in answer.json()["error"]["message"]
    aborted = await client.post(prefill.url + ABORT, headers=auth(), json={"reason": "r"})
    assert aborted.json()["result"]["weights_incomplete"] is True
    incomplete.settle(state, None, "a", "b")  # a load completed
    assert (await client.get(prefill.url + "/health")).status_code == 200
    assert (await client.post(prefill.url + "/v1/chat/completions", json=BODY)).status_code == 200


class Holder:
    weights_incomplete: str | None = None


@pytest.mark.parametrize(
    ("error", "before", "after", "incomplete_after"),
    [
        pytest.param(None, "d1", "d2", False, id="a success makes the weights whole"),
        pytest.param(CollectiveError("x", weights_changed=True), "d1", "d1", True, id="bytes landed, said the backend"),
        pytest.param(EngineError("x"), "d1", "d2", True, id="a failure that left another digest"),
        pytest.param(EngineError("x"), "d1", None, True, id="a failure after which the digest is unknown"),
        pytest.param(CollectiveError("x"), "d1", "d1", False, id="a failure before any byte changed"),
        pytest.param(EngineError("x"), None, None, False, id="no digest before or after: only the backend can say"),
    ],
)
def test_the_incomplete_rule(
    error: BaseException | None, before: str | None, after: str | None, incomplete_after: bool
) -> None:
    holder = Holder()
    incomplete.settle(holder, error, before, after)
    assert (holder.weights_incomplete is not None) is incomplete_after
    if error is not None and not incomplete_after:  # an earlier incomplete state stays
        holder.weights_incomplete = "earlier"
        incomplete.settle(holder, error, before, after)
        assert holder.weights_incomplete == "earlier"
