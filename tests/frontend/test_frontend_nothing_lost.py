"""No lost turns at the frontend: fallback engines of another replica, a held leg, a re-run context
leg, and the weights version on every answer. Real sim engines and frontends on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
from drs_engine.server.runner import start_engine
from drs_protocol.fields import HEADER_WEIGHTS_VERSION

from .conftest import Replica, ReplicaFactory, chat_body, metric_value, sim_config, stop_engine

CHAT = "/v1/chat/completions"
WAIT_S = 20.0


async def test_a_replica_without_prefill_engines_borrows_another_replicas_until_its_own_return(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    async with replica_factory(frontends=0) as other, replica_factory(frontends=0) as ours:
        front = await ours.add_frontend(
            fallback_prefill=[e.url for e in other.prefill], fallback_decode=[e.url for e in other.decode]
        )
        before = await client.post(front.url + CHAT, json=chat_body("mine"))
        assert before.headers["x-drs-prefill"] == ours.prefill[0].url  # own engines first
        assert before.headers["x-drs-decode"] == ours.decode[0].url

        await stop_engine(ours.prefill[0])
        for i in range(3):
            resp = await client.post(front.url + CHAT, json=chat_body(f"turn {i}"))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-drs-prefill"] == other.prefill[0].url
            assert resp.headers["x-drs-decode"] == ours.decode[0].url  # only the missing role is borrowed
        assert (await client.get(front.url + "/ready")).status_code == 200


async def test_a_leg_with_no_engine_up_is_held_until_one_comes_back(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    async with replica_factory(frontends=0) as replica, contextlib.AsyncExitStack() as stack:
        front = await replica.add_frontend(hold_seconds=WAIT_S)
        engine = replica.prefill[0]
        port = engine.config.port
        await stop_engine(engine)
        turn = asyncio.create_task(client.post(front.url + CHAT, json=chat_body("held")))
        # the turn is held, not failed: bring a prefill engine back on the same address
        async with asyncio.timeout(WAIT_S):
            while not _held(await client.get(front.url + "/metrics")):
                await asyncio.sleep(0.02)
        await stack.enter_async_context(start_engine(sim_config("prefill", port=port)))
        resp = await asyncio.wait_for(turn, WAIT_S)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-drs-prefill"] == engine.url


def _held(metrics: httpx.Response) -> bool:
    return metric_value(metrics.text, "drs_frontend_retries_total", '{role="prefill_hold"}') >= 1


async def test_a_generation_leg_whose_context_state_is_gone_reruns_the_context_leg(
    client: httpx.AsyncClient,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        # one prefill engine forgets every context state at once (a 1 ns TTL): its turns must re-run
        forgetful = await stack.enter_async_context(
            start_engine(sim_config("prefill", sim={"kvStoreTtlSeconds": 1e-9}))
        )
        good = await stack.enter_async_context(start_engine(sim_config("prefill")))
        decode = await stack.enter_async_context(start_engine(sim_config("decode")))
        replica = Replica([forgetful, good], [decode], stack=stack)
        front = await replica.add_frontend(ctx_router="round_robin")
        for i in range(4):
            resp = await client.post(front.url + CHAT, json=chat_body(f"turn {i}"))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-drs-prefill"] == good.url
            assert resp.headers[HEADER_WEIGHTS_VERSION] == "0"
        metrics = (await client.get(front.url + "/metrics")).text
    assert metric_value(metrics, "drs_frontend_retries_total", '{role="context_rerun"}') >= 1


SLOW_DECODE = {
    "sim": {
        "speed": 1.0,
        "decodeSecondsPerToken": 0.01,
        "decodeSecondsPerBatchSlot": 0.0,
        "prefillSecondsPerToken": 0.0,
        "weightsLoadSeconds": 0.0,
    }
}


async def test_a_turn_decoding_across_a_refit_answers_with_the_new_version_and_its_boundary(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "step-9"
    checkpoint.write_text("new weights")
    async with replica_factory(engine=SLOW_DECODE) as replica:
        decode = replica.decode[0].server.state
        body = chat_body("a long answer", max_tokens=200, ignore_eos=True)
        turn = asyncio.create_task(client.post(replica.url + CHAT, json=body))
        async with asyncio.timeout(WAIT_S):  # until the generation leg is decoding on the decode engine
            while decode.admission is None or decode.admission.running == 0:
                await asyncio.sleep(0.01)
        for engine in (*replica.prefill, *replica.decode):  # the sidecar's refit, engine by engine
            await engine.server.state.require_backend().load_weights(str(checkpoint), "step-9")
        resp = await asyncio.wait_for(turn, WAIT_S)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert resp.headers[HEADER_WEIGHTS_VERSION] == answer["weights_version"] == "step-9"
    assert 1 <= answer["weights_boundary"] < 200
    assert len(answer["choices"][0]["token_ids"]) == 200


async def test_the_weights_version_reaches_the_client_from_strict_engines_header_alone(
    replica_factory: ReplicaFactory, client: httpx.AsyncClient
) -> None:
    async with replica_factory(engine={"strictTrtllmResponses": True}) as replica:
        resp = await client.post(replica.url + CHAT, json=chat_body("strict"))
    assert resp.status_code == 200, resp.text
    assert "weights_version" not in resp.json()  # a strict engine answers TensorRT-LLM's fields only
    assert resp.headers[HEADER_WEIGHTS_VERSION] == "0"
