"""Engines that fail: retried on another engine of the role, 503 naming the role when none is
left, engine errors passed through, and a client that leaves cancels the engine call."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import httpx
import pytest
from drs_engine.server.runner import start_engine

from .conftest import ReplicaFactory, chat_body, frontend_config, metric_value, sim_config, stop_engine, wait_for_status

CHAT = "/v1/chat/completions"


async def test_a_stopped_prefill_engine_is_skipped_and_the_turn_retried_on_another(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    async with replica_factory(prefill=2, ctx_router="round_robin", health_interval=3600) as replica:
        dead, alive = replica.prefill
        await stop_engine(dead)
        for i in range(4):
            resp = await client.post(replica.url + CHAT, json=chat_body(f"turn {i}"))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-drs-prefill"] == alive.url
        metrics = (await client.get(replica.url + "/metrics")).text
        assert metric_value(metrics, "drs_frontend_upstream_errors_total", '{kind="connect",role="prefill"}') == 1
        assert metric_value(metrics, "drs_frontend_retries_total", '{role="prefill"}') == 1


async def test_a_stopped_decode_engine_is_skipped_and_the_generation_retried(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    async with replica_factory(decode=2, gen_router="round_robin", health_interval=3600) as replica:
        dead, alive = replica.decode
        await stop_engine(dead)
        for stream in (False, True):
            resp = await client.post(replica.url + CHAT, json=chat_body(stream=stream))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-drs-decode"] == alive.url


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_with_every_engine_of_a_role_down_the_answer_is_503_naming_the_role(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient, role: str
) -> None:
    async with replica_factory(prefill=2, decode=2, health_interval=3600) as replica:
        for engine in replica.prefill if role == "prefill" else replica.decode:
            await stop_engine(engine)
        for stream in (False, True):
            resp = await client.post(replica.url + CHAT, json=chat_body(stream=stream))
            assert resp.status_code == 503
            error = resp.json()["error"]
            assert error["role"] == role
            assert f"no {role} engine available" in error["message"]
        if role == "decode":
            assert resp.headers["x-drs-prefill"] in {e.url for e in replica.prefill}
        else:
            assert resp.headers["x-drs-prefill"] == "none"
        assert resp.headers["x-drs-decode"] == "none"
        assert (await client.get(replica.url + "/health")).status_code == 200


async def test_readiness_follows_the_probes_and_liveness_does_not(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    async with replica_factory(decode=2, health_interval=0.05) as replica:
        assert (await wait_for_status(client, replica.url + "/ready", 200)).status_code == 200
        await stop_engine(replica.decode[0])
        assert (await wait_for_status(client, replica.url + "/ready", 200)).json()["decode"] in (1, 2)
        await stop_engine(replica.decode[1])
        ready = await wait_for_status(client, replica.url + "/ready", 503)
        assert ready.status_code == 503
        assert ready.json() == {"ready": False, "prefill": 1, "decode": 0}
        assert (await client.get(replica.url + "/health")).status_code == 200


async def test_the_prober_takes_a_dead_engine_out_before_any_request_fails(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    async with replica_factory(prefill=2, ctx_router="round_robin", health_interval=0.05) as replica:
        dead, alive = replica.prefill
        await stop_engine(dead)
        await wait_for_status(client, replica.url + "/ready", 200)
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while "prefill" in (await client.get(replica.url + "/ready")).text and loop.time() < end:
            metrics = (await client.get(replica.url + "/metrics")).text
            if metric_value(metrics, "drs_frontend_engine_up", f'{{engine="{dead.url}",role="prefill"}}') == 0:
                break
            await asyncio.sleep(0.05)
        for i in range(3):
            resp = await client.post(replica.url + CHAT, json=chat_body(f"turn {i}"))
            assert resp.headers["x-drs-prefill"] == alive.url
        metrics = (await client.get(replica.url + "/metrics")).text
        assert metric_value(metrics, "drs_frontend_upstream_errors_total", '{kind="connect",role="prefill"}') == 0


async def test_a_prefill_engine_that_times_out_is_cooled_down_and_the_turn_retried(client: httpx.AsyncClient) -> None:
    slow = sim_config("prefill", sim={"speed": 1.0, "prefillSecondsPerToken": 0.1})
    async with contextlib.AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(start_engine(c))
            for c in (slow, sim_config("prefill"), sim_config("decode"))
        ]
        config = frontend_config(
            [engines[0].url, engines[1].url], [engines[2].url], ctx_router="round_robin", timeouts={"context": 0.3}
        )
        from drs_frontend.server import start_frontend

        frontend = await stack.enter_async_context(start_frontend(config))
        resp = await client.post(frontend.url + CHAT, json=chat_body("a prompt long enough to be slow"))
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-drs-prefill"] == engines[1].url
        metrics = (await client.get(frontend.url + "/metrics")).text
        assert metric_value(metrics, "drs_frontend_upstream_errors_total", '{kind="timeout",role="prefill"}') == 1


async def test_an_engine_4xx_passes_through_with_its_status_and_body(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    async with replica_factory(engine={"model": {"path": "sim-qwen3", "maxModelLen": 16}}) as replica:
        body = chat_body("word " * 100)
        direct = await client.post(replica.prefill[0].url + CHAT, json=body)
        relayed = await client.post(replica.url + CHAT, json=body)
        assert relayed.status_code == direct.status_code == 400
        assert "context length" in relayed.text
        assert relayed.json() == direct.json()
        assert relayed.headers["x-drs-prefill"] == replica.prefill[0].url


async def in_flight(client: httpx.AsyncClient, engine_url: str) -> float:
    return metric_value((await client.get(engine_url + "/metrics")).text, "drs_engine_requests_in_flight")


async def wait_until_zero(read: Callable[[], Awaitable[float]], deadline: float = 10.0) -> float:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while (value := await read()) > 0 and loop.time() < end:
        await asyncio.sleep(0.05)
    return value


SLOW_DECODE = {"sim": {"speed": 1.0, "decodeSecondsPerToken": 0.05, "prefillSecondsPerToken": 0.0}}


async def test_a_streaming_client_that_disconnects_cancels_the_decode_call(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    async with replica_factory(engine=SLOW_DECODE) as replica:
        decode_url = replica.decode[0].url
        async with httpx.AsyncClient() as impatient:
            body = chat_body(max_tokens=2000, stream=True)  # about 100 s of decoding
            async with impatient.stream("POST", replica.url + CHAT, json=body) as resp:
                assert resp.status_code == 200
                async for _ in resp.aiter_bytes():
                    break  # one chunk, then hang up
        assert await wait_until_zero(lambda: in_flight(client, decode_url)) == 0
        metrics = (await client.get(replica.url + "/metrics")).text
        assert metric_value(metrics, "drs_frontend_client_disconnects_total") == 1


async def test_a_client_that_disconnects_mid_turn_cancels_the_frontends_engine_call(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    async with replica_factory(engine=SLOW_DECODE) as replica:
        decode_url = replica.decode[0].url

        async def frontend_in_flight() -> float:
            text = (await client.get(replica.url + "/metrics")).text
            return metric_value(text, "drs_frontend_engine_in_flight", f'{{engine="{decode_url}",role="decode"}}')

        with pytest.raises(httpx.ReadTimeout):
            async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=1.0)) as impatient:
                await impatient.post(replica.url + CHAT, json=chat_body(max_tokens=2000))
        assert await wait_until_zero(frontend_in_flight) == 0
        assert await wait_until_zero(lambda: in_flight(client, decode_url)) == 0  # the engine stopped too
        metrics = (await client.get(replica.url + "/metrics")).text
        assert metric_value(metrics, "drs_frontend_client_disconnects_total") == 1
        assert (
            metric_value(metrics, "drs_frontend_requests_total", '{endpoint="/v1/chat/completions",status="200"}') == 0
        )
