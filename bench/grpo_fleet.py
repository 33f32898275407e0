"""The fleet of ``bench/grpo.py`` (and ``bench/lookup_cost.py``): ``sim`` engines in processes of
their own, real tokenizing frontends in the caller's, started and restarted as pods would be.

Not a test. ``python bench/grpo_fleet.py --serve-engines M --engine-proc I ...`` is the engines'
process (what :func:`fleet` starts): engine ``k`` of :func:`engine_slots` for every
``k % --engine-procs == I``, until its stdin closes; one JSON line with their URLs by ``k``, then
one with its event loop's lag.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from drs_engine.config import build_config
from drs_engine.server.runner import start_engine
from drs_frontend.app import FrontendApp
from drs_frontend.config import FrontendConfig
from drs_frontend.server import RunningFrontend, start_frontend
from drs_protocol.enums import Role

MODES = ("ahead", "bounded", "groups", "today")
#: the modes whose frontends look up (``groupLookupEngines: LOOKUP_ENGINES``); ``bounded`` claims after its lookup,
#: as before 2026-12-06
LOOKUP_MODES = ("ahead", "bounded")
#: the lookup modes' width: fixed here (the product's default is 4 too), so a mode's figures keep
#: their meaning if the default changes; ``groups`` and ``today`` do not look up (0)
LOOKUP_ENGINES = 4
LAG_TICK_S = 0.01  # the event loop's lag is sampled this often


@dataclass
class Fleet:
    prefill: list[list[str]]  #: engine URLs by replica
    decode: list[list[str]]
    frontends: list[list[RunningFrontend]]
    stacks: list[list[contextlib.AsyncExitStack]]
    engine_lag: dict[str, float] = field(default_factory=dict)  #: the engines' process's loop lag, the whole round

    @property
    def urls(self) -> list[str]:
        return [f.url for replica in self.frontends for f in replica]


def engine_config(role: str, speed: float) -> Any:
    return build_config(
        {
            "backend": "sim",
            "role": role,
            "host": "127.0.0.1",
            "port": 0,
            "sim": {"speed": speed, "eosProbability": 0.0},
        }
    )


def frontend_config(prefill: list[str], decode: list[str], node: int, mode: str) -> FrontendConfig:
    return FrontendConfig.model_validate(
        {
            "prefill": prefill,
            "decode": decode,
            "host": "127.0.0.1",
            "port": 0,
            "nodeId": node,
            "tokenize": True,
            "healthInterval": 1.0,
            "groupRouting": mode != "today",
            "groupLookupEngines": LOOKUP_ENGINES if mode in LOOKUP_MODES else 0,
            # the frontends share this process's one event loop, the engines another's: on a loaded
            # machine a connect, a probe or a prefix lookup can wait for them longer than the
            # defaults (2 s, 2 s, 0.5 s); lookups_unanswered_after_restart counts what still did not answer
            "timeouts": {"connect": 10.0, "health": 10.0, "prefixLookup": 2.0},
        }
    )


async def serve_frontend(
    stack: contextlib.AsyncExitStack, config: FrontendConfig, *, ahead: bool, openings: int | None = None
) -> RunningFrontend:
    """A frontend, once its probes found every engine up; ``ahead``: a new group's claim goes with
    its lookup (one round trip; off by default), else after it (``bounded``, the default)."""
    running = await stack.enter_async_context(start_frontend(config, app=FrontendApp(config)))
    running.app.relay.lookup.ahead = ahead
    if openings is not None and running.app.relay.chat_tokenizer is not None:
        running.app.relay.chat_tokenizer.max_openings = openings
    pools = (running.app.relay.prefill, running.app.relay.decode)
    async with asyncio.timeout(60):
        while any(pool.answering() < len(pool.engines) for pool in pools):
            await asyncio.sleep(0.05)
    return running


def engine_slots(m: int, args: argparse.Namespace) -> list[tuple[Role, int, int]]:
    """Every engine of the fleet as (role, replica, index), in the order the processes deal them."""
    return [(Role.PREFILL, r, i) for r in range(args.replicas) for i in range(m)] + [
        (Role.DECODE, r, i) for r in range(args.replicas) for i in range(args.decode)
    ]


async def serve_engines(args: argparse.Namespace) -> None:
    """``grpo.py --serve-engines M --engine-proc I``: engine ``k`` of :func:`engine_slots` for every
    ``k % --engine-procs == I``, in this process, until stdin closes; prints their URLs by ``k``."""
    slots = engine_slots(args.serve_engines, args)
    async with contextlib.AsyncExitStack() as stack:
        urls: dict[int, str] = {}
        for k, (role, _, _) in enumerate(slots):
            if k % args.engine_procs == args.engine_proc:
                urls[k] = (await stack.enter_async_context(start_engine(engine_config(role, args.speed)))).url
        lags: list[float] = []
        lag_task = asyncio.create_task(loop_lag(lags))
        print(json.dumps(urls), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        lag_task.cancel()
        lag = {"engine_loop_lag_s_mean": statistics.mean(lags or [0.0]), "engine_loop_lag_s_max": max(lags, default=0)}
        print(json.dumps(lag), flush=True)


@contextlib.asynccontextmanager
async def fleet(args: argparse.Namespace, m: int, mode: str) -> AsyncIterator[Fleet]:
    argv = [__file__, "--serve-engines", str(m), "--replicas", str(args.replicas), "--decode", str(args.decode)]
    argv += ["--speed", str(args.speed), "--engine-procs", str(args.engine_procs)]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            *argv,
            "--engine-proc",
            str(i),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        for i in range(args.engine_procs)
    ]
    made = Fleet([], [], [], [])
    try:
        urls: dict[int, str] = {}
        for proc in procs:
            assert proc.stdout is not None
            urls.update({int(k): u for k, u in json.loads(await asyncio.wait_for(proc.stdout.readline(), 120)).items()})
        prefill: list[list[str]] = [[] for _ in range(args.replicas)]
        decode: list[list[str]] = [[] for _ in range(args.replicas)]
        for k, (role, r, _) in enumerate(engine_slots(m, args)):
            (prefill if role is Role.PREFILL else decode)[r].append(urls[k])
        async with contextlib.AsyncExitStack() as stack:
            frontends: list[list[RunningFrontend]] = []
            stacks: list[list[contextlib.AsyncExitStack]] = []
            for r in range(args.replicas):
                frontends.append([])
                stacks.append([])
                for f in range(args.frontends):
                    own = await stack.enter_async_context(contextlib.AsyncExitStack())
                    config = frontend_config(prefill[r], decode[r], r * args.frontends + f, mode)
                    running = await serve_frontend(own, config, ahead=mode == "ahead", openings=args.openings)
                    frontends[r].append(running)
                    stacks[r].append(own)
            made = Fleet(prefill, decode, frontends, stacks)
            yield made
            for replica_stacks in stacks:
                for own in replica_stacks:
                    await own.aclose()
    finally:
        lags: list[dict[str, float]] = []
        for proc in procs:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.close()
            with contextlib.suppress(TimeoutError, ValueError):
                lags.append(json.loads(await asyncio.wait_for(proc.stdout.readline(), 30)))
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if lags:  # over the engines' processes: the mean of their means, the largest of their maxima
            made.engine_lag["engine_loop_lag_s_mean"] = statistics.mean(g["engine_loop_lag_s_mean"] for g in lags)
            made.engine_lag["engine_loop_lag_s_max"] = max(g["engine_loop_lag_s_max"] for g in lags)


async def restart_all(fleet_: Fleet, outer: contextlib.AsyncExitStack) -> None:
    """Every frontend stopped (its pins, groups and prefix index die with it) and started again
    with the same config and port, as a restarted pod comes back."""
    for r, replica in enumerate(fleet_.frontends):
        for f, running in enumerate(replica):
            config, ahead, chat = running.app.config, running.app.relay.lookup.ahead, running.app.relay.chat_tokenizer
            await fleet_.stacks[r][f].aclose()
            own = await outer.enter_async_context(contextlib.AsyncExitStack())
            openings = chat.max_openings if chat is not None else None
            fleet_.frontends[r][f] = await serve_frontend(own, config, ahead=ahead, openings=openings)
            fleet_.stacks[r][f] = own


async def loop_lag(out: list[float]) -> None:
    """How late the frontends' event loop (shared with this client) wakes a task asked to sleep
    ``LAG_TICK_S``, every tick: what any round trip of theirs waits on top of the network."""
    while True:
        started = time.perf_counter()
        await asyncio.sleep(LAG_TICK_S)
        out.append(time.perf_counter() - started - LAG_TICK_S)


def engine_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="the engines' process of bench/grpo.py's fleet")
    p.add_argument("--serve-engines", type=int, required=True, help="prefill engines per replica (M)")
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--decode", type=int, required=True)
    p.add_argument("--speed", type=float, required=True)
    p.add_argument("--engine-procs", type=int, required=True)
    p.add_argument("--engine-proc", type=int, required=True)
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(serve_engines(engine_args()))
