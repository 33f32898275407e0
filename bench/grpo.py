"""Benchmark: GRPO groups over a sim fleet, group routing beside today's routing in the same run.

Not a test. Starts, in a process of their own (``--engine-procs P``: dealt round robin to P
processes, as pods would not share an event loop), N replicas of M ``sim`` prefill engines + K decode engines
(the latency model at ``--speed``: prefill time for uncached tokens only, in iterations that share
no block still being computed, as TensorRT-LLM's executor) and F real frontends per replica
(tokenizing) in this one, and drives Gym-shaped GRPO load: P prompts x n siblings x T turns, every sibling its
own session with its own conversation id, sent to ``status.urls[sha256(session) % N*F]``; the
siblings of one prompt start within ``--spread-ms`` (100 ms) of each other, the prompts
``--gap-ms`` apart. Before turn 1 every frontend is restarted (``--no-restart`` to keep them): later
turns must find their engine without the frontends' memory.

Four modes (``--modes``), each with a fresh fleet per round, rounds interleaved (in reverse order every
other round, so neither mode always runs first): ``ahead`` (``groupLookupEngines: 4``, since
2026-12-06: as ``bounded``, but a frontend that has the engines' figures from earlier answers sends a
new group's claim *with* its lookup, one round trip, and takes it back where the answers found the
group elsewhere), ``bounded``
(``groupLookupEngines: 4``: by opening, a new group on the first of its rendezvous engines within
the load bound over the recent prefill work the engines report in the prefix-held answer, a turn
unknown to its frontend placed where that lookup finds its opening held or in flight, a new
group's placement claimed on its engine before its leg is sent (counted there at once, within the
bound: refused, the walk goes on with the engine's live figure); siblings
held for the first one's context leg by the frontend, and by the engine for a sibling another
frontend sent), ``groups`` (``groupLookupEngines: 0``, the default: by opening, the first
rendezvous engine whatever the load, no lookup) and ``today``
(``groupRouting: false``: rendezvous over the conversation id). Figures per mode and M, each the median over ``--rounds``
(after ``--warmup`` rounds not counted), with the spread (min..max):

* ``prompt_prefills_per_group_replica``: prompt tokens the prefill engines computed during turn 0
  (their own counters, query - hit) / (prompt tokens x the (group, replica) pairs that got a
  sibling): 1.0 is one prefill of the shared prompt per replica per group;
* ``colocation``: per (group, replica), the share of its siblings on its most used prefill engine;
* ``group_completion_s``: per group, first sibling sent to last sibling's turn-0 answer (mean);
* ``sibling_turn0_s``: a sibling's turn-0 latency (mean and max), held siblings included;
* ``later_turn_affinity``: turns >= 1 whose prefill engine held the previous turn's prompt (its
  reported cached tokens cover the previous prompt's full blocks);
* ``prefill_work_max_over_mean`` / ``decode_turns_max_over_mean``: per replica, the busiest prefill
  engine's computed tokens and decode engine's turns over their mean (worst replica);
* ``claims_*``: the frontends' claims during turn 0 (claimed, refused, unanswered, taken_back: a
  claim sent with the lookup that did not stand);
* ``turn0_*_s_mean``: where turn 0 waits, from the frontends' histograms (means over every frontend):
  the lookup and claims of a routing miss (``placement``) and each of its round trips (``lookup``,
  ``claim``, ``reask``: every engine asked again after a refusal, ``lookup_claim``: the one round
  trip of ``ahead``), a held sibling's hold, the
  context leg and the generation leg;
* ``turn0_loop_lag_s_*``: how late the frontends' event loop (one process with this client) wakes a
  10 ms sleep during turn 0 (mean, max): the queueing under every round trip of theirs;
  ``engine_loop_lag_s_*``: the same of the engines' processes, over the whole round (the mean
  of their means, the largest of their maxima).

The last line is one JSON object with every figure and the ratios of the modes' (ahead / bounded, ahead / groups, ahead / today, bounded / groups, groups / today)
of the medians, and (``*_paired``) of each round's latencies to the other mode's in the same round
(the rounds alternate modes, so a pair ran under about the same machine load): their median, spread
and in how many pairs the first mode was slower.

``--hog-duty D [--hog-procs P]`` runs P processes beside the fleet, each spinning D of every 10 ms
(``bench/hog.py``: a known load, unlike the machine's own; the line carries the load average before
and after); ``--stalls N`` prints, per round, the N stacks the frontends' loop was sampled in
while turn 0 stalled it (``bench/stalls.py``).

    .venv/bin/python bench/grpo.py [--prefill 2,4] [--prompts 8] [--siblings 8] [--turns 3] [--rounds 3]
        [--modes ahead,bounded,groups,today] [--task-words 160] [--hog-duty 0] [--stalls 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from drs_protocol import fields, routes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.grpo_fleet import MODES, Fleet, fleet, loop_lag, restart_all
from bench.grpo_summary import summarize
from bench.hog import hogging, loadavg
from bench.stalls import StallSampler

BLOCK = 32  # the sim engine's tokens per block
SIBLINGS_MOVED = 'drs_frontend_group_siblings_total{placed="moved"}'
CLAIMS = "drs_frontend_group_claims_total"
SYSTEM = "You are a careful agent. Think step by step, call a tool when it helps, answer briefly. " * 8


@dataclass
class Session:
    name: str
    group: int
    url: str
    replica: int
    messages: list[dict[str, Any]]
    previous_prompt: int = 0
    first_prompt: int = 0
    engines: list[str] = field(default_factory=list)
    hits: int = 0
    later: int = 0
    sent: float = 0.0
    retries: int = 0
    answered: float = 0.0


def gym_url(session: str, urls: list[str]) -> int:
    return int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big") % len(urls)


async def scrape(client: httpx.AsyncClient, url: str) -> str:
    """GET ``url``, once more when a kept-alive connection was closed under it (uvicorn's keep-alive)."""
    try:
        return (await client.get(url)).text
    except httpx.TransportError:
        return (await client.get(url)).text


async def engine_counters(client: httpx.AsyncClient, engines: list[str]) -> list[tuple[float, float]]:
    out = []
    for engine in engines:
        text = await scrape(client, engine + routes.METRICS)
        values = {}
        names = ("drs_engine_prefix_cache_query_tokens_total", "drs_engine_prefix_cache_hit_tokens_total")
        for line in text.splitlines():
            for name in names:
                if line.startswith(name + " "):
                    values[name] = float(line.split()[1])
        out.append((values.get(names[0], 0.0), values.get(names[1], 0.0)))
    return out


async def frontend_sum(client: httpx.AsyncClient, urls: list[str], sample: str) -> float:
    """One sample of every frontend's /metrics, summed (0 where a frontend has none)."""
    total = 0.0
    for url in urls:
        for line in (await scrape(client, url + routes.METRICS)).splitlines():
            if line.startswith(sample + " "):
                total += float(line.split()[1])
    return total


async def mean_of(client: httpx.AsyncClient, urls: list[str], histogram: str) -> float:
    """A histogram's mean over every frontend (``name{labels}``: its _sum over its _count; 0 if empty)."""
    name, _, labels = histogram.partition("{")
    labels = "{" + labels if labels else ""
    count = await frontend_sum(client, urls, f"{name}_count{labels}")
    return (await frontend_sum(client, urls, f"{name}_sum{labels}")) / count if count else 0.0


async def turn0_figures(client: httpx.AsyncClient, urls: list[str]) -> dict[str, float]:
    """The frontends' own figures of turn 0 (read before they restart): groups the bound moved,
    claims by outcome, and where turn 0 waits (the histograms' means)."""
    out = {"groups_moved_by_the_bound": await frontend_sum(client, urls, SIBLINGS_MOVED)}
    for outcome in ("claimed", "refused", "unanswered", "taken_back"):
        out[f"claims_{outcome}"] = await frontend_sum(client, urls, f'{CLAIMS}{{outcome="{outcome}"}}')
    for name, series in (
        ("placement", "drs_frontend_group_placement_seconds"),
        ("lookup", 'drs_frontend_group_round_trip_seconds{phase="lookup"}'),
        ("claim", 'drs_frontend_group_round_trip_seconds{phase="claim"}'),
        ("reask", 'drs_frontend_group_round_trip_seconds{phase="reask"}'),
        ("lookup_claim", 'drs_frontend_group_round_trip_seconds{phase="lookup_claim"}'),
        ("hold", "drs_frontend_group_hold_seconds"),
        ("context_leg", 'drs_frontend_leg_seconds{leg="context"}'),
        ("generation_leg", 'drs_frontend_leg_seconds{leg="generation"}'),
    ):
        out[f"turn0_{name}_s_mean"] = await mean_of(client, urls, series)
    return out


async def take_turn(client: httpx.AsyncClient, fleet_: Fleet, s: Session, turn: int, args: argparse.Namespace) -> None:
    body = {
        "model": "sim-qwen3",
        "messages": s.messages,
        "max_tokens": args.max_tokens,
        "conversation_params": {"conversation_id": s.name},
    }
    url = fleet_.urls[gym_url(s.name, fleet_.urls)]
    started = time.perf_counter()
    resp: httpx.Response | None = None
    for attempt in range(4):  # NeMo-Gym retries a 5xx or a broken connection
        try:
            resp = await client.post(url + routes.Endpoint.CHAT.value, json=body)
        except httpx.TransportError as exc:  # a keep-alive connection to a frontend before its restart
            s.retries += 1
            print(f"  {s.name} turn {turn}: {type(exc).__name__} (attempt {attempt + 1})", file=sys.stderr)
            continue
        if resp.status_code == 200:
            break
        s.retries += 1
        print(f"  {s.name} turn {turn}: {resp.status_code} {resp.text[:120]} (attempt {attempt + 1})", file=sys.stderr)
    if resp is None:
        raise RuntimeError(f"{s.name} turn {turn}: no answer from {url}")
    resp.raise_for_status()
    if turn == 0:
        s.sent, s.answered = started, time.perf_counter()
    data = resp.json()
    message = data["choices"][0]["message"]
    cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
    if turn == 0:
        s.first_prompt = data["usage"]["prompt_tokens"]
    else:
        s.later += 1
        s.hits += cached >= (s.previous_prompt // BLOCK) * BLOCK
    s.previous_prompt = data["usage"]["prompt_tokens"]
    s.engines.append(resp.headers[fields.HEADER_PREFILL_ENGINE])
    s.engines.append("decode:" + resp.headers[fields.HEADER_DECODE_ENGINE])
    s.messages.append({"role": "assistant", "content": message["content"]})
    s.messages.append({"role": "user", "content": f"Observation {turn + 1} for {s.name}: the tool returned 42."})


def prompt_of(group: int, rng: random.Random, args: argparse.Namespace) -> list[dict[str, Any]]:
    words = " ".join(f"w{rng.randrange(10_000)}" for _ in range(args.task_words))
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task {group}: {words}"}]


async def watched(args: argparse.Namespace, label: str, turn0: Awaitable[Any]) -> list[float]:
    """``turn0`` awaited while the loop's lag is sampled (returned) and, with ``--stalls``, the
    stacks that stalled it (printed)."""
    lags: list[float] = []
    lag_task = asyncio.create_task(loop_lag(lags))
    stalls = StallSampler() if args.stalls else None  # sampling costs a thread: only when asked
    async with stalls or contextlib.nullcontext():
        await turn0
    lag_task.cancel()
    if stalls is not None:
        top = [dataclasses.asdict(x) for x in stalls.top(args.stalls)]
        print(f"{label} turn 0 stalls: {json.dumps(top)}", file=sys.stderr)
    return lags


async def one_round(args: argparse.Namespace, m: int, mode: str, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=256)
    async with (
        contextlib.AsyncExitStack() as outer,
        fleet(args, m, mode) as fl,
        httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client,
    ):
        urls = fl.urls
        sessions: list[Session] = []
        for g in range(args.prompts):
            prompt = prompt_of(g, rng, args)
            for i in range(args.siblings):
                name = f"step{seed}-p{g}-s{i}"
                index = gym_url(name, urls)
                replica = index // args.frontends
                sessions.append(Session(name, g, urls[index], replica, [dict(x) for x in prompt]))
        all_prefill = [e for replica in fl.prefill for e in replica]
        before = await engine_counters(client, all_prefill)

        async def first(s: Session) -> None:
            await asyncio.sleep(s.group * args.gap_ms / 1000 + rng.uniform(0, args.spread_ms / 1000))
            await take_turn(client, fl, s, 0, args)

        lags = await watched(args, f"M={m} {mode}", asyncio.gather(*(first(s) for s in sessions)))
        after = await engine_counters(client, all_prefill)
        frontend_figures = await turn0_figures(client, fl.urls)
        frontend_figures["turn0_loop_lag_s_mean"] = statistics.mean(lags) if lags else 0.0
        frontend_figures["turn0_loop_lag_s_max"] = max(lags, default=0.0)
        if args.restart:
            await restart_all(fl, outer)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as later:  # fresh connections
            for turn in range(1, args.turns):
                await asyncio.gather(*(take_turn(later, fl, s, turn, args) for s in sessions))
        final = await engine_counters(client, all_prefill)
        found = await frontend_sum(client, fl.urls, 'drs_frontend_group_lookups_total{outcome="found"}')
        unanswered = await frontend_sum(client, fl.urls, 'drs_frontend_group_lookups_total{outcome="unanswered"}')

    pairs: dict[tuple[int, int], list[str]] = defaultdict(list)
    for s in sessions:
        pairs[(s.group, s.replica)].append(s.engines[0])
    computed0 = sum((a[0] - a[1]) - (b[0] - b[1]) for a, b in zip(after, before, strict=True))
    first_prompt = statistics.mean(s.first_prompt for s in sessions)  # the same for every sibling
    colocation = statistics.mean(Counter(v).most_common(1)[0][1] / len(v) for v in pairs.values())
    completion = []
    for g in range(args.prompts):
        members = [s for s in sessions if s.group == g]
        completion.append(max(s.answered for s in members) - min(s.sent for s in members))
    turn0 = [s.answered - s.sent for s in sessions]
    work_ratio = 0.0
    decode_ratio = 0.0
    offset = 0
    for r, replica in enumerate(fl.prefill):
        work = [(final[offset + i][0] - final[offset + i][1]) for i in range(len(replica))]
        offset += len(replica)
        work_ratio = max(work_ratio, max(work) / (sum(work) / len(work)) if sum(work) else 0.0)
        decodes = Counter(
            e for s in sessions if s.replica == r for e in s.engines if e.startswith("decode:") and e != "decode:none"
        )
        counts = [decodes.get("decode:" + e, 0) for e in fl.decode[r]]
        decode_ratio = max(decode_ratio, max(counts) / (sum(counts) / len(counts)) if sum(counts) else 0.0)
    return {
        "prompt_prefills_per_group_replica": computed0 / (first_prompt * len(pairs)),
        "colocation": colocation,
        "group_completion_s": statistics.mean(completion),
        "sibling_turn0_s_mean": statistics.mean(turn0),
        "sibling_turn0_s_max": max(turn0),
        "later_turn_affinity": sum(s.hits for s in sessions) / max(1, sum(s.later for s in sessions)),
        "prefill_work_max_over_mean": work_ratio,
        "decode_turns_max_over_mean": decode_ratio,
        "prompt_tokens": first_prompt,
        "client_retries": sum(s.retries for s in sessions),
        **frontend_figures,
        **fl.engine_lag,
        "lookups_found_after_restart": found,
        "lookups_unanswered_after_restart": unanswered,
    }


async def main(args: argparse.Namespace) -> None:
    ms = [int(x) for x in args.prefill.split(",")]
    unknown = sorted(set(args.modes.split(",")) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes: {unknown[0]!r} is not one of {', '.join(MODES)}")
    rounds: dict[tuple[int, str], list[dict[str, float]]] = defaultdict(list)
    started = time.perf_counter()
    load_before = loadavg()
    with hogging(args.hog_duty, args.hog_procs):
        await all_rounds(args, ms, rounds)
    config = {k: v for k, v in vars(args).items()}
    print(
        json.dumps(
            {
                "bench": "grpo",
                "config": config,
                "wall_s": round(time.perf_counter() - started, 1),
                "loadavg": {"before": load_before, "after": loadavg()},
                "results": summarize(rounds),
            }
        )
    )


async def all_rounds(
    args: argparse.Namespace, ms: list[int], rounds: dict[tuple[int, str], list[dict[str, float]]]
) -> None:
    for number in range(args.warmup + args.rounds):
        for m in ms:
            modes = args.modes.split(",")
            for mode in modes if number % 2 == 0 else modes[::-1]:  # neither mode always goes first
                figures = await one_round(args, m, mode, seed=1000 * number + m)
                counted = number >= args.warmup
                label = f"round {number + 1 - args.warmup}" if counted else "warm-up"
                print(
                    f"{label} M={m} {mode}: {json.dumps({k: round(v, 3) for k, v in figures.items()})}", file=sys.stderr
                )
                if counted:
                    rounds[(m, mode)].append(figures)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--prefill", default="2,4", help="prefill engines per replica (M), comma-separated")
    p.add_argument("--decode", type=int, default=2, help="decode engines per replica (K)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--frontends", type=int, default=2, help="frontends per replica (F)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (P)")
    p.add_argument("--siblings", type=int, default=8, help="samples per prompt (n)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--task-words", type=int, default=160, help="words of each prompt's task (~3 tokens each)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--spread-ms", type=float, default=100.0, help="siblings of a prompt start within this")
    p.add_argument("--gap-ms", type=float, default=50.0, help="between the prompts' bursts")
    p.add_argument("--speed", type=float, default=1.0, help="the sim latency model's speed")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-restart", dest="restart", action="store_false")
    p.add_argument(
        "--openings",
        type=int,
        default=None,
        help="the frontends' shared first turns kept (0: none; default: the code's)",
    )
    p.add_argument(
        "--engine-procs", type=int, default=1, help="processes the engines are dealt to, round robin (1: one for all)"
    )
    p.add_argument(
        "--hog-duty",
        type=float,
        default=0.0,
        help="a controlled load beside the fleet: processes spinning this share of every 10 ms (0: none)",
    )
    p.add_argument("--hog-procs", type=int, default=1, help="spinning processes at --hog-duty")
    p.add_argument(
        "--stalls", type=int, default=0, help="print the N stacks most sampled while turn 0 stalled the loop (0: none)"
    )
    args = p.parse_args(argv)
    if not 0.0 <= args.hog_duty <= 1.0:
        p.error(f"--hog-duty: {args.hog_duty:g} is not within 0..1 (the share of every 10 ms a process spins)")
    if args.hog_procs < 0:
        p.error(f"--hog-procs: {args.hog_procs} is below 0")
    return args


if __name__ == "__main__":
    parsed = parse_args()
    asyncio.run(main(parsed))
