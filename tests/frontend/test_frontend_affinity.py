"""Conversation affinity measured on the engines: 200 conversations x 10 turns, 2 frontends, 4
prefill engines. A turn *hits* when the prefill engine that serves it already holds the previous
turn's prompt: the sim engine reports the cached prefix of every context leg (relayed as
``usage.prompt_tokens_details.cached_tokens``), and the sum of those figures is checked against the
engines' own ``drs_engine_prefix_cache_hit_tokens_total``; loads come from
``drs_engine_prefix_cache_query_tokens_total``. The router's own claims are not used.

The first test turns the group lookup off (``group_lookup_engines=0``): rendezvous over the
openings alone places the conversations, so each engine's share is predicted exactly. The second
runs the default (the bounded placement, which may move a new group off a busy first choice, so
shares depend on timing): it checks the hit rate across a frontend restart and the load bound.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import Any

import httpx
from drs_frontend.routing.groups import opening_of
from drs_frontend.routing.rendezvous import hrw_order

from .conftest import Replica, ReplicaFactory, metric_value

CONVERSATIONS = 200
TURNS = 10
BLOCK = 32  # the sim engine's tokens per cache block
CONCURRENCY = 32
BALANCE = 1.25  # the spread the test asks for when rendezvous alone would be within it
SHARE_TOLERANCE = 0.02  # an engine's query-token share vs its predicted conversation share
RETRIES = 3  # a turn's retries after a 5xx (as NeMo-Gym's client), each after a longer pause
RETRY_BACKOFF_S = 0.5


@dataclass
class Conversation:
    session: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    previous_prompt: int = 0
    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0
    retried: int = 0


def gym_frontend(session: str, urls: list[str]) -> str:
    """NeMo-Gym's choice of frontend for a session (PROTOCOL.md section 1)."""
    return urls[int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big") % len(urls)]


def opening_message(session: str) -> dict[str, Any]:
    opening = f"Trajectory {session}. " + " ".join(f"fact-{session}-{i}" for i in range(20))
    return {"role": "user", "content": opening}


def predicted_shares(sessions: list[str], engine_urls: list[str]) -> list[float]:
    """Each engine's share of the conversations, as rendezvous over their openings places them."""
    counts = dict.fromkeys(engine_urls, 0)
    for session in sessions:
        opening = opening_of([opening_message(session)])
        assert opening is not None
        counts[hrw_order(opening.key, engine_urls)[0]] += 1
    return [counts[u] / len(sessions) for u in engine_urls]


@dataclass(frozen=True)
class Spread:
    measured: float  #: busiest engine's query tokens over the mean
    predicted: float  #: busiest engine's predicted conversations over the mean
    shares: list[float]  #: each engine's share of the query tokens
    expected: list[float]  #: each engine's predicted share of the conversations

    def check_bound(self) -> None:
        assert self.measured <= max(BALANCE, self.predicted + SHARE_TOLERANCE * len(self.shares)), self

    def check(self) -> None:
        """The bound, and every engine's share as rendezvous alone predicts it."""
        self.check_bound()
        for share, expected in zip(self.shares, self.expected, strict=True):
            assert abs(share - expected) <= SHARE_TOLERANCE, self


async def take_turn(client: httpx.AsyncClient, replica: Replica, conv: Conversation, turn: int) -> None:
    if turn == 0:
        conv.messages.append(opening_message(conv.session))
    else:
        conv.messages.append({"role": "user", "content": f"Observation {turn} for {conv.session}: continue."})
    body = {
        "model": "sim-qwen3",
        "messages": conv.messages,
        "max_tokens": 6,
        "conversation_params": {"conversation_id": conv.session},
        "return_token_ids": True,
    }
    url = gym_frontend(conv.session, [f.url for f in replica.frontends])
    resp = await client.post(url + "/v1/chat/completions", json=body)
    for attempt in range(RETRIES):
        # NeMo-Gym retries a 5xx, and so does this client: the sim decode engine's KV fetch from
        # the prefill engine can lose a keep-alive race (502, an engine-side issue, reported), and
        # on a loaded machine a restarted frontend's first probes can time out (503, none is up).
        if not (resp.status_code == 503 or (resp.status_code == 502 and "cannot fetch context state" in resp.text)):
            break
        if attempt == 0:  # turns retried, not attempts
            conv.retried += 1
        await asyncio.sleep(RETRY_BACKOFF_S * (attempt + 1))
        resp = await client.post(url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    message = data["choices"][0]["message"]
    cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
    conv.cached_tokens += cached
    if turn > 0:
        if cached >= (conv.previous_prompt // BLOCK) * BLOCK:
            conv.hits += 1
        else:
            conv.misses += 1
    conv.previous_prompt = len(message["prompt_token_ids"])
    conv.messages.append(
        {
            "role": "assistant",
            "content": message["content"],
            **{k: message[k] for k in ("prompt_token_ids", "generation_token_ids")},
        }
    )


async def run_turns(client: httpx.AsyncClient, replica: Replica, convs: list[Conversation], turns: range) -> None:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(conv: Conversation) -> None:
        for turn in turns:
            async with gate:
                await take_turn(client, replica, conv, turn)

    await asyncio.gather(*(one(c) for c in convs))


async def engine_totals(client: httpx.AsyncClient, replica: Replica) -> tuple[list[float], list[float]]:
    queries, hits = [], []
    for engine in replica.prefill:
        text = (await client.get(engine.url + "/metrics")).text
        queries.append(metric_value(text, "drs_engine_prefix_cache_query_tokens_total"))
        hits.append(metric_value(text, "drs_engine_prefix_cache_hit_tokens_total"))
    return queries, hits


async def context_reruns(client: httpx.AsyncClient, replica: Replica) -> float:
    """Context legs the frontends ran again (a decode engine lost the context state): such a
    turn's first leg counted its hit on the engine, not in the reply."""
    total = 0.0
    for frontend in replica.frontends:
        text = (await client.get(frontend.url + "/metrics")).text
        total += metric_value(text, "drs_frontend_retries_total", '{role="context_rerun"}')
    return total


async def affinity_run(
    replica_factory: ReplicaFactory, *, restart: bool, **frontend: Any
) -> tuple[float, Spread, list[Conversation]]:
    async with replica_factory(prefill=4, decode=2, frontends=2, tokenize=True, **frontend) as replica:
        engine_urls = [e.url for e in replica.prefill]
        limits = httpx.Limits(max_connections=CONCURRENCY * 2)
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
            convs = [Conversation(f"session-{i:04d}") for i in range(CONVERSATIONS)]
            await run_turns(client, replica, convs, range(TURNS // 2))
            reruns = 0.0
            if restart:  # the restarted frontend's counters start again at zero
                reruns += await context_reruns(client, replica)
                await replica.restart_frontend(1)
            await run_turns(client, replica, convs, range(TURNS // 2, TURNS))
            reruns += await context_reruns(client, replica)
            queries, hits = await engine_totals(client, replica)
    retried = sum(c.retried for c in convs)
    assert retried + reruns <= CONVERSATIONS * TURNS // 100
    if retried == 0 and reruns == 0:  # a retried turn's first context leg counted its hit on the engine only
        assert sum(c.cached_tokens for c in convs) == sum(hits)  # per-turn figures are the engines' own
    else:
        assert sum(c.cached_tokens for c in convs) <= sum(hits)
    hit_rate = sum(c.hits for c in convs) / sum(c.hits + c.misses for c in convs)
    expected = predicted_shares([c.session for c in convs], engine_urls)
    spread = Spread(
        measured=max(queries) / (sum(queries) / len(queries)),
        predicted=max(expected) * len(expected),
        shares=[q / sum(queries) for q in queries],
        expected=expected,
    )
    return hit_rate, spread, convs


async def test_conversations_stay_on_the_prefill_engine_that_holds_their_prefix(
    replica_factory: ReplicaFactory,
) -> None:
    hit_rate, spread, convs = await affinity_run(replica_factory, restart=False, group_lookup_engines=0)
    assert sum(c.hits + c.misses for c in convs) == CONVERSATIONS * (TURNS - 1)
    assert hit_rate >= 0.99
    spread.check()


async def test_a_restarted_frontend_sends_known_conversations_back_to_their_engines(
    replica_factory: ReplicaFactory,
) -> None:
    hit_rate, spread, _ = await affinity_run(replica_factory, restart=True)
    assert hit_rate >= 0.95
    spread.check_bound()
