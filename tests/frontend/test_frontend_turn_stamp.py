"""The turn's stamp (``x-drs-turn-started``, ``drs_protocol.cutover``): a frontend stamps a turn once,
when it receives it, sends the stamp on both legs and returns it in the answer. Real sim engines
and frontends."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import httpx
from drs_engine.server.runner import start_engine
from drs_protocol.cutover import format_stamp, parse_stamp
from drs_protocol.fields import HEADER_TURN_STARTED, HEADER_WEIGHTS_VERSION, control_auth
from drs_protocol.routes import CONTROL_ROUTES, ControlOp, Endpoint

from .conftest import Replica, chat_body, sim_config

TOKEN = "frontend-test-token"
#: Prefill time of the test's turn (sim: seconds per uncached prompt token, at speed 1).
PREFILL_S_PER_TOKEN = 0.15


@contextlib.asynccontextmanager
async def slow_prefill_replica() -> AsyncIterator[Replica]:
    async with contextlib.AsyncExitStack() as stack:
        prefill = await stack.enter_async_context(
            start_engine(
                sim_config("prefill", sim={"speed": 1.0, "prefillSecondsPerToken": PREFILL_S_PER_TOKEN}),
                control_token=TOKEN,
            )
        )
        decode = await stack.enter_async_context(start_engine(sim_config("decode"), control_token=TOKEN))
        yield Replica([prefill], [decode], stack=stack)


async def test_both_legs_carry_the_stamp_taken_when_the_frontend_received_the_turn(
    client: httpx.AsyncClient,
) -> None:
    """The decode engine's target takes effect while the context leg still runs (its prefill takes
    seconds): its generation leg arrives after the cut-over, yet the turn started before it, and the
    engine admits the leg only by the stamp the frontend sent (its own receipt time is after the
    cut-over and it does not hold the target: a 503 ``weights_pending`` the frontend would hold
    until ``weightsPendingHoldSeconds``, here 1 s, then answer 503)."""
    async with slow_prefill_replica() as r:
        (decode,) = r.decode
        front = await r.add_frontend(weights_pending_hold_seconds=1.0)
        sent = time.time()
        cut = sent + 1.0  # long before the prefill (about 20 tokens x 0.15 s) ends
        announced = await client.post(
            decode.url + CONTROL_ROUTES[ControlOp.ANNOUNCE_WEIGHTS_TARGET],
            headers=control_auth(TOKEN),
            json={"version": "step-9", "lease_s": 60, "effective_at": cut},
        )
        answer = await client.post(front.url + Endpoint.CHAT, json=chat_body("a turn across the cut-over"), timeout=60)
        received = time.time()
    assert announced.status_code == 200, announced.text
    assert answer.status_code == 200, answer.text
    assert received > cut + 0.5, "the generation leg did not reach its engine after the cut-over"
    stamp = parse_stamp(answer.headers[HEADER_TURN_STARTED])
    assert sent <= stamp < cut
    assert answer.headers[HEADER_WEIGHTS_VERSION] == "0"  # the weights desired when the turn started


async def test_a_client_cannot_set_the_stamp(client: httpx.AsyncClient) -> None:
    async with slow_prefill_replica() as r:
        front = await r.add_frontend()
        sent = time.time()
        answer = await client.post(
            front.url + Endpoint.CHAT,
            json=chat_body("hi", max_tokens=2),
            headers={HEADER_TURN_STARTED: format_stamp(sent - 3600)},
            timeout=60,
        )
        received = time.time()
    assert answer.status_code == 200, answer.text
    assert sent <= parse_stamp(answer.headers[HEADER_TURN_STARTED]) <= received
