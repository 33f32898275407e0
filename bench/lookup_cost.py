"""Benchmark: where a group lookup's round trip goes (issue 27), each part beside a bare round trip in the same run.

Not a test. Reuses ``bench/grpo.py``'s fleet (one replica: ``--engines`` ``sim`` prefill engines, 1 by
default, and one decode engine in a process of their own (``--engine-procs P``: dealt to P), one real tokenizing frontend in this one,
``groupLookupEngines: 4``; every lookup asks every prefill engine, the bare round trips the first)
and times, per round (after ``--warmup`` rounds not counted), the median over ``--calls`` calls of:

* in this process, the CPU of each part (``cpu_*_us``): the frontend tokenizing a sibling's first
  turn (a conversation it has not seen: ``tokenize``), building the lookup's body (``body``: the
  turn's ids, validated, JSON-encoded; ``body_bytes``), and what the engine's handler does with it
  (``engine_parse``: JSON + the ``PrefixHeldRequest`` model; ``engine_hash``: the prompt's block
  hashes and the cache walk; ``engine_render``: rendering the opening's messages with the chat
  template, what an engine does for a frontend that does not tokenize);
* round trips over loopback, one at a time (``rtt_*_ms``): ``health`` (GET /health, the baseline),
  ``tiny`` (the lookup route with a 2-id prompt), ``lookup`` (:meth:`PrefixLookup.ask` of a
  turn's ids, end to end);
* 64 at once (``burst_*``), as a group's siblings: ``distinct`` (64 lookups of different prompts:
  no sharing), ``shared`` (64 lookups of one prompt, sibling ids differ: the frontend's in-flight
  sharing), ``tokenize_then_ask`` (each tokenizes its turn on the event loop, as the relay does,
  then asks: the lookup's latency with its siblings' tokenization queued on the same loop), and
  ``turns`` (64 siblings of one new prompt as real chat turns through the frontend's HTTP port: the
  frontend's own ``drs_frontend_group_round_trip_seconds{phase="lookup"}`` mean and its placement's);
  for each the per-call mean and max latency, the wall time, and the event loop's lag (a 1 ms
  sleep's lateness) while it ran.

The last line is one JSON object: every figure's median and spread (min..max) over the rounds and
the ratios of the round trips to ``rtt_health_ms`` (per round, then median).

    .venv/bin/python bench/lookup_cost.py [--rounds 5] [--warmup 1] [--calls 50] [--burst 64] [--engines 1]
        [--engine-procs 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from drs_engine.prefix_cache import PrefixCache
from drs_engine.prefix_hash import block_hashes
from drs_engine.server.body import validate
from drs_frontend.lookup import PrefixLookup
from drs_frontend.routing import RouteRequest
from drs_frontend.routing.groups import opening_messages
from drs_frontend.tokenization import ChatTokenizer
from drs_protocol import routes
from drs_protocol.body import parse_json_object
from drs_protocol.chat import render_prompt_ids
from drs_protocol.prefix_lookup import PrefixHeldRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import grpo, grpo_fleet

LAG_TICK_S = 0.001


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(values), 4), "spread": [round(min(values), 4), round(max(values), 4)]}


class Lag:
    """The event loop's lateness waking a ``LAG_TICK_S`` sleep while a section runs."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(LAG_TICK_S)
            self.samples.append(time.perf_counter() - started - LAG_TICK_S)

    def __enter__(self) -> Lag:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def timed_calls(n: int, call: Callable[[int], Awaitable[Any]]) -> list[float]:
    out = []
    for i in range(n):
        started = time.perf_counter()
        await call(i)
        out.append(time.perf_counter() - started)
    return out


def cpu_calls(n: int, call: Callable[[int], Any]) -> list[float]:
    out = []
    for i in range(n):
        started = time.perf_counter()
        call(i)
        out.append(time.perf_counter() - started)
    return out


async def burst(n: int, call: Callable[[int], Awaitable[Any]]) -> dict[str, float]:
    """``n`` calls at once: per-call latency (mean, max), wall, the loop's lag meanwhile (mean, max)."""
    latencies: list[float] = []

    async def one(i: int) -> None:
        started = time.perf_counter()
        await call(i)
        latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    with Lag() as lag:
        await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - started
    return {
        "mean_ms": 1000 * statistics.mean(latencies),
        "max_ms": 1000 * max(latencies),
        "wall_ms": 1000 * wall,
        "lag_mean_ms": 1000 * statistics.mean(lag.samples or [0.0]),
        "lag_max_ms": 1000 * max(lag.samples or [0.0]),
    }


async def histogram_sums(client: httpx.AsyncClient, url: str, names: list[str]) -> dict[str, float]:
    text = await grpo.scrape(client, url + routes.METRICS)
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        for name in names:
            if line.startswith(name + " "):
                out[name] = float(line.split()[1])
    return out


@dataclass
class Setup:
    """One round's fleet pieces and prompts: ``calls`` prompts, each already tokenized once."""

    args: argparse.Namespace
    number: int
    lookup: PrefixLookup
    chat: ChatTokenizer
    engines: list[str]
    prompts: list[list[dict[str, Any]]]
    ids: list[Sequence[int]]

    def route_of(self, g: int) -> RouteRequest:
        return RouteRequest(conversation_id=f"r{self.number}-c{g}", prompt_ids=self.ids[g], messages=self.prompts[g])


def cpu_parts(r: Setup) -> dict[str, float]:
    """The CPU of each part, in this process: the frontend's and what the engine's handler does."""
    n, chat, prompts, ids = r.args.calls, r.chat, r.prompts, r.ids
    tokenize = cpu_calls(n, lambda g: chat.prompt_ids(f"r{r.number}-t{g}", prompts[g]))
    bodies = [PrefixLookup._body(r.route_of(g), prompts[g], live=True) for g in range(n)]
    body = cpu_calls(n, lambda g: PrefixLookup._body(r.route_of(g), prompts[g], live=True))
    parse = cpu_calls(n, lambda g: validate(PrefixHeldRequest, parse_json_object(bodies[g])))
    cache = PrefixCache(tokens_per_block=grpo.BLOCK, capacity_tokens=1 << 20)
    cache.insert(block_hashes(b"seed", ids[0], grpo.BLOCK))
    hashed = cpu_calls(n, lambda g: cache.held(block_hashes(b"seed", ids[g], grpo.BLOCK)))
    render = cpu_calls(
        n,
        lambda g: render_prompt_ids(
            chat.tokenizer, [dict(m) for m in opening_messages(prompts[g])], add_generation_prompt=False
        ),
    )
    out: dict[str, float] = {}
    for name, values in (
        ("tokenize", tokenize),
        ("body", body),
        ("engine_parse", parse),
        ("engine_hash", hashed),
        ("engine_render", render),
    ):
        out[f"cpu_{name}_us"] = 1e6 * statistics.median(values)
    out["body_bytes"] = statistics.median(len(b) for b in bodies)
    out["prompt_ids"] = statistics.median(len(i) for i in ids)
    return out


async def round_trips(r: Setup) -> dict[str, float]:
    """Round trips one at a time: the bare ``GET /health``, a 2-id lookup, a turn's lookup end to end."""
    upstream, engine, n = r.lookup.upstream, r.engines[0], r.args.calls
    tiny = b'{"prompt_token_ids": [1, 2], "live": true}'
    rtt = {
        "health": await timed_calls(n, lambda g: upstream.get(engine + routes.HEALTH, 5.0)),
        "tiny": await timed_calls(n, lambda g: upstream.post_json(engine + routes.PREFIX_HELD, tiny, 5.0)),
        "lookup": await timed_calls(n, lambda g: r.lookup.ask(r.engines, r.route_of(g), live=True)),
    }
    out = {f"rtt_{name}_ms": 1000 * statistics.median(values) for name, values in rtt.items()}
    for name in ("tiny", "lookup"):
        out[f"rtt_{name}_over_health"] = out[f"rtt_{name}_ms"] / out["rtt_health_ms"]
    return out


async def lookup_bursts(r: Setup) -> dict[str, float]:
    """``burst`` lookups at once: of distinct prompts, of one prompt, each after tokenizing its turn."""
    n, number, chat, lookup, urls = r.args.burst, r.number, r.chat, r.lookup, r.engines
    more = [grpo.prompt_of(10_000 + g, random.Random(number * 7 + g), r.args) for g in range(n)]
    more_ids = [chat.prompt_ids(f"r{number}-more-{g}", p).ids for g, p in enumerate(more)]
    sections: dict[str, Callable[[int], Awaitable[Any]]] = {
        "distinct": lambda g: lookup.ask(
            urls, RouteRequest(conversation_id=f"d{g}", prompt_ids=more_ids[g], messages=more[g]), live=True
        ),
        "shared": lambda g: lookup.ask(
            urls, RouteRequest(conversation_id=f"s{g}", prompt_ids=more_ids[0], messages=more[0]), live=True
        ),
    }
    asked: list[float] = []

    async def tokenize_then_ask(g: int) -> None:
        await asyncio.sleep(0)
        turn = chat.prompt_ids(f"r{number}-tta-{g}", more[1])
        started = time.perf_counter()
        await lookup.ask(
            urls, RouteRequest(conversation_id=f"tta{g}", prompt_ids=turn.ids, messages=more[1]), live=True
        )
        asked.append(time.perf_counter() - started)

    out: dict[str, float] = {}
    for name, call in sections.items():
        for key, value in (await burst(n, call)).items():
            out[f"burst_{name}_{key}"] = value
    for key, value in (await burst(n, tokenize_then_ask)).items():
        out[f"burst_tokenize_then_ask_{key}"] = value
    out["burst_tokenize_then_ask_ask_only_mean_ms"] = 1000 * statistics.mean(asked)
    return out


async def turns_burst(r: Setup, front: str) -> dict[str, float]:
    """``burst`` sibling first turns of one new prompt through the frontend's HTTP port, and its own
    figures of their lookup and placement."""
    names = [
        'drs_frontend_group_round_trip_seconds_sum{phase="lookup"}',
        'drs_frontend_group_round_trip_seconds_count{phase="lookup"}',
        "drs_frontend_group_placement_seconds_sum",
        "drs_frontend_group_placement_seconds_count",
    ]
    task = grpo.prompt_of(20_000 + r.number, random.Random(r.number), r.args)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=256)
    out: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        before = await histogram_sums(client, front, names)

        async def turn(g: int) -> None:
            body = {
                "model": "sim-qwen3",
                "messages": task,
                "max_tokens": r.args.max_tokens,
                "conversation_params": {"conversation_id": f"r{r.number}-turn-{g}"},
            }
            (await client.post(front + routes.Endpoint.CHAT.value, json=body)).raise_for_status()

        for key, value in (await burst(r.args.burst, turn)).items():
            out[f"burst_turns_{key}"] = value
        after = await histogram_sums(client, front, names)
    d = {k: after[k] - before[k] for k in names}
    out["burst_turns_lookups"] = d[names[1]]
    out["burst_turns_lookup_round_trip_ms"] = 1000 * d[names[0]] / d[names[1]] if d[names[1]] else 0.0
    out["burst_turns_placement_ms"] = 1000 * d[names[2]] / d[names[3]] if d[names[3]] else 0.0
    return out


async def one_round(args: argparse.Namespace, fleet_args: argparse.Namespace, number: int) -> dict[str, float]:
    async with grpo_fleet.fleet(fleet_args, args.engines, "bounded") as fl:
        relay = fl.frontends[0][0].app.relay
        chat = relay.chat_tokenizer
        assert chat is not None
        prompts = [grpo.prompt_of(g, random.Random(number * 1000 + g), args) for g in range(args.calls)]
        ids: list[Sequence[int]] = [chat.prompt_ids(f"r{number}-warm-{g}", p).ids for g, p in enumerate(prompts)]
        r = Setup(args, number, relay.lookup, chat, fl.prefill[0], prompts, ids)
        return {
            **cpu_parts(r),
            **await round_trips(r),
            **await lookup_bursts(r),
            **await turns_burst(r, fl.frontends[0][0].url),
        }


async def main(args: argparse.Namespace) -> None:
    fleet_args = grpo.parse_args(["--replicas", "1", "--frontends", "1", "--decode", "1"])
    fleet_args.speed, fleet_args.engine_procs = args.speed, args.engine_procs
    rounds: list[dict[str, float]] = []
    started = time.perf_counter()
    for number in range(args.warmup + args.rounds):
        figures = await one_round(args, fleet_args, number)
        label = f"round {number + 1 - args.warmup}" if number >= args.warmup else "warm-up"
        print(f"{label}: {json.dumps({k: round(v, 3) for k, v in figures.items()})}", file=sys.stderr)
        if number >= args.warmup:
            rounds.append(figures)
    print(
        json.dumps(
            {
                "bench": "lookup_cost",
                "config": vars(args),
                "loadavg": os.getloadavg(),
                "wall_s": round(time.perf_counter() - started, 1),
                "results": {k: spread([r[k] for r in rounds]) for k in rounds[0]},
            }
        )
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--calls", type=int, default=50, help="calls per part per round")
    p.add_argument("--burst", type=int, default=64, help="siblings at once")
    p.add_argument("--engines", type=int, default=1, help="prefill engines, every one asked by each lookup")
    p.add_argument("--engine-procs", type=int, default=1, help="processes the engines are dealt to (bench/grpo.py's)")
    p.add_argument("--task-words", type=int, default=160, help="as bench/grpo.py's (~3 tokens each)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--speed", type=float, default=1.0, help="the sim latency model's speed")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
