"""Every upstream client behind the one interface: a turn, a streamed turn, a refused engine."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from drs_frontend.upstream.raw_client import _Slots

from .conftest import ReplicaFactory, chat_body, metric_value, stop_engine

CLIENTS = ["raw", "aiohttp", "httpx"]


@pytest.mark.parametrize("upstream", CLIENTS)
async def test_each_upstream_client_serves_turns_streamed_and_not(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient, upstream: str
) -> None:
    async with replica_factory(upstream_client=upstream) as replica:
        for i in range(3):  # several turns: connections are reused
            resp = await client.post(replica.url + "/v1/chat/completions", json=chat_body(f"turn {i}"))
            assert resp.status_code == 200, resp.text
            assert len(resp.json()["choices"][0]["message"]["generation_token_ids"]) == 8
        streamed = await client.post(replica.url + "/v1/chat/completions", json=chat_body(stream=True))
        assert streamed.status_code == 200
        assert streamed.text.rstrip().endswith("data: [DONE]")
        rejected = await client.post(replica.url + "/v1/chat/completions", json=chat_body(frobnicate=1))
        assert rejected.status_code == 400


@pytest.mark.parametrize("upstream", CLIENTS)
async def test_each_upstream_client_reports_a_refused_engine_as_a_connect_error(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient, upstream: str
) -> None:
    async with replica_factory(
        prefill=2, ctx_router="round_robin", health_interval=3600, upstream_client=upstream
    ) as replica:
        await client.post(replica.url + "/v1/chat/completions", json=chat_body("warm up both"))
        await client.post(replica.url + "/v1/chat/completions", json=chat_body("warm up both"))
        await stop_engine(replica.prefill[0])
        for i in range(2):
            resp = await client.post(replica.url + "/v1/chat/completions", json=chat_body(f"after {i}"))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-drs-prefill"] == replica.prefill[1].url
        metrics = (await client.get(replica.url + "/metrics")).text
        assert metric_value(metrics, "drs_frontend_upstream_errors_total", '{kind="connect",role="prefill"}') == 1


async def test_connection_slots_are_taken_without_waiting_until_full_then_handed_on_in_order() -> None:
    slots = _Slots(2)
    await slots.take()
    await slots.take()
    order: list[int] = []

    async def wait(i: int) -> None:
        await slots.take()
        order.append(i)

    waiters = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0)
    waiters[0].cancel()  # a waiter that gives up is skipped
    slots.give()
    slots.give()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert order == [1, 2]
    assert slots.free == 0
    slots.give()
    slots.give()
    assert slots.free == 2
