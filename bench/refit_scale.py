"""The refit's own overhead at fleet scale: the trainer's ``POST /v1/refit`` to ``drs sidecar``
until every engine's digest is verified, over N real sim engines (prints one JSON line).

The engines (``sim``, ``weightsLoadSeconds: 0``: the transfer itself is excluded, as the issue's
target says) run in one child process (``--engine-processes N``: spread over N, so that the
figure measures the sidecar rather than one process hosting N servers), the sidecar's app in this one with a static fleet of their
URLs (``--concurrency`` loads at once, 256 by default), and a trainer client posts the refits over
loopback HTTP. Every refit carries the checkpoint's digest, so each of the N answers is checked.
Reports, over the refits after a first one (the warm-up: first contact with every engine, reported
on its own as ``warmup``), median, min and max of each refit's wall time as the trainer saw it
(target <= 0.5 s at 256 engines), the sidecar's own ``elapsed_s``, the time until every engine
was told (``target_announced_s``: the announce round, or with ``--fold-announce`` the last engine's
receipt of its load, measured one way by the engines) and cut-over margin (and the call less its margin, ``after_cutover_s``), and the CPU
seconds per refit of this process (``sidecar_cpu_s``: the sidecar's fan-out, parsing and digest
checks, plus the trainer's one call) and of the engines' process (``engines_cpu_s``, from
``/proc``; ``engines_idle_cpu_per_s``: that process's CPU per second with nothing asked of it,
a cost of putting N servers in one process that a refit's wall time pays too). Both processes share this machine's cores with other work, so on a small or busy
machine the wall time is mostly waiting for a core; the CPU seconds are the orchestration's own
cost wherever the engines run, and hold under load. ``loadavg_1m`` is the machine's load. Also
the seconds each refit this process spent in its garbage collector (``sidecar_gc_s``) and the
engines' process's over all refits (``engines_gc``). Both processes run on uvloop, as ``drs
engine`` (uvicorn picks it) and ``drs sidecar`` do; ``--loop asyncio`` is this bench before
2026-12-06. ``--profile``/``--profile-engines`` profile CPU time (``time.process_time``).

    python bench/refit_scale.py [--engines 256] [--refits 5] [--fold-announce] [--loop uvloop|asyncio]
        [--engine-processes 1] [--profile sidecar.prof] [--profile-engines engines.prof]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import uvloop
from drs_protocol import env

#: Seconds the child may take to start its engines.
START_TIMEOUT_S = 900.0
#: Seconds over which the engines' idle CPU is measured, before the first refit.
IDLE_WINDOW_S = 2.0
#: ``--loop``: how each process runs its event loop.
LOOPS: dict[str, Callable[[Coroutine[Any, Any, Any]], Any]] = {"uvloop": uvloop.run, "asyncio": asyncio.run}


async def serve(count: int, profile: str | None) -> None:
    """The child: ``count`` sim engines; prints their URLs as one JSON line, then waits for EOF
    (``profile``: cProfile from then on into that file)."""
    from drs_engine.config import build_config
    from drs_engine.server.runner import start_engine

    config = {"backend": "sim", "role": "prefill", "host": "127.0.0.1", "port": 0}
    sim = {"speed": 0, "weightsLoadSeconds": 0}
    async with contextlib.AsyncExitStack() as stack:
        urls = []
        for _ in range(count):
            engine = await stack.enter_async_context(
                start_engine(build_config({**config, "sim": sim}), control_token=os.environ[env.CONTROL_TOKEN])
            )
            urls.append(engine.url)
        profiler = cProfile.Profile(time.process_time) if profile else None  # CPU, not wall: the box is shared
        if profiler is not None:
            profiler.enable()
        clock = GcClock()
        print(json.dumps(urls), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        if profiler is not None and profile:
            profiler.disable()
            profiler.dump_stats(profile)
        print(json.dumps(clock.figures()), flush=True)  # from the first refit on


class GcClock:
    """Seconds this process spent in the garbage collector, and its collections per generation."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections[info["generation"]] += 1

    def figures(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 3), "collections": self.collections}


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system) processes ``pids`` have used so far (Linux ``/proc``)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _numbered(path: str, i: int, count: int) -> str:
    """``path`` for the ``i``-th of ``count`` engines' processes (one process: ``path`` itself)."""
    return path if count <= 1 else f"{path}.{i}"


def _split(count: int, parts: int) -> list[range]:
    """``count`` engines over ``parts`` processes, as evenly as they go (none empty)."""
    parts = max(1, min(parts, count))
    return [range(i * count // parts, (i + 1) * count // parts) for i in range(parts)]


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of the rounds after the warm-up one (3 decimals)."""
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


async def idle_cpu(pids: list[int]) -> float:
    """CPU seconds per second processes ``pids`` use over :data:`IDLE_WINDOW_S` while nothing is asked of them."""
    before = cpu_seconds(pids)
    await asyncio.sleep(IDLE_WINDOW_S)  # a measuring window, not a wait for an event
    return (cpu_seconds(pids) - before) / IDLE_WINDOW_S


async def drive(
    urls: list[str],
    token: str,
    refits: int,
    concurrency: int,
    engines_pids: list[int],
    profile: str | None,
    fold: bool,
) -> dict[str, Any]:
    """``refits + 1`` refits through a real sidecar app (the first one warms up: first contact
    with every engine, connections opened, and is reported on its own)."""
    import httpx
    import uvicorn
    from drs_protocol.routes import TrainerRoute
    from drs_protocol.weights_digest import digest_files
    from drs_sidecar.app import build_app
    from drs_sidecar.control import ControlClient
    from drs_sidecar.fleet import StaticFleet
    from drs_sidecar.metrics import SidecarMetrics
    from drs_sidecar.refit import Refitter

    startup_cpu, startup_wall = time.process_time(), time.perf_counter()
    refitter = Refitter(StaticFleet(urls), ControlClient(token), SidecarMetrics(), concurrency=concurrency)
    refitter.targets.fold = fold  # each load carries its target: one call per engine (--fold-announce)
    server = uvicorn.Server(uvicorn.Config(build_app(refitter, reconcile_s=3600), port=0, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:  # the sidecar's first fleet read and reconcile pass: first contact
        await asyncio.sleep(0.01)
    startup = {"wall": time.perf_counter() - startup_wall, "cpu": time.process_time() - startup_cpu}
    clock = GcClock()
    idle_cpu_per_s = await idle_cpu(engines_pids)
    profiler = cProfile.Profile(time.process_time) if profile else None  # CPU, not wall: the box is shared
    sidecar = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    rounds: list[dict[str, Any]] = []
    engine_s: list[float] = []  #: each engine's load call, as the sidecar timed it (after the warm-up)
    with tempfile.TemporaryDirectory() as tmp:
        async with httpx.AsyncClient(timeout=600) as client:
            for i in range(refits + 1):  # the first warms connections up and is not counted
                checkpoint = Path(tmp) / f"step-{i}"
                checkpoint.mkdir()
                (checkpoint / "model.safetensors").write_bytes(os.urandom(64))
                body = {"path": str(checkpoint), "version": f"step-{i}", "digest": digest_files(checkpoint)}
                if profiler is not None and i == 1:
                    profiler.enable()
                started, cpu, engines_cpu = time.perf_counter(), time.process_time(), cpu_seconds(engines_pids)
                in_gc = clock.seconds
                response = await client.post(sidecar + TrainerRoute.REFIT, json=body)
                wall, cpu = time.perf_counter() - started, time.process_time() - cpu
                engines_cpu = cpu_seconds(engines_pids) - engines_cpu
                report = response.json()
                if response.status_code != 200 or report["ok"] != len(urls):
                    raise SystemExit(f"refit {i} incomplete: {response.status_code} {json.dumps(report)[:2000]}")
                rounds.append(
                    {
                        "wall": wall,
                        "inside": report["elapsed_s"],
                        "announce": report.get("target_announced_s") or 0.0,
                        "margin": report.get("cutover_margin_s") or 0.0,
                        "cpu": cpu,
                        "engines_cpu": engines_cpu,
                        "gc": clock.seconds - in_gc,
                    }
                )
                if i:
                    engine_s.extend(o["elapsed_s"] for o in report["outcomes"])
    if profiler is not None and profile:
        profiler.disable()
        profiler.dump_stats(profile)
    server.should_exit = True
    await serving
    return summary(rounds, engine_s, idle_cpu_per_s, startup)


def summary(
    rounds: list[dict[str, Any]], engine_s: list[float], idle_cpu_per_s: float, startup: dict[str, float]
) -> dict[str, Any]:
    """The figures of :func:`drive`'s refits (the first, a warm-up, on its own)."""
    warm, counted = rounds[0], rounds[1:]
    return {
        "trainer_call_s": spread([r["wall"] for r in counted]),
        "sidecar_elapsed_s": spread([r["inside"] for r in counted]),
        "target_announced_s": spread([r["announce"] for r in counted]),
        #: the cut-over margin each refit got (max(--cutover-margin, 2 x the last announce round))
        "cutover_margin_s": spread([r["margin"] for r in counted]),
        #: the trainer's call less its margin: what the refit costs after its cut-over (the swaps,
        #: the answers and their digests; for main's code, the whole load round) plus its request
        "after_cutover_s": spread([r["wall"] - r["margin"] for r in counted]),
        "engine_call_s": spread(engine_s),
        #: the sidecar's own CPU (its fan-out, parsing, digest checks, plus the trainer's one call)
        "sidecar_cpu_s": spread([r["cpu"] for r in counted]),
        #: the engines' process's CPU (all N engines answering the announce and the load)
        "engines_cpu_s": spread([r["engines_cpu"] for r in counted]),
        #: seconds of each refit this process (sidecar and trainer) spent in its garbage collector
        "sidecar_gc_s": spread([r["gc"] for r in counted]),
        #: the engines' process's CPU seconds per second while idle: N uvicorn servers in one
        #: process each wake 10 times a second (their main loop), which a refit's seconds also pay
        "engines_idle_cpu_per_s": round(idle_cpu_per_s, 3),
        "warmup": {k: round(v, 3) for k, v in warm.items()},
        #: from the app's start until it serves: its first fleet read and reconcile pass (first contact)
        "sidecar_startup_s": {k: round(v, 3) for k, v in startup.items()},
    }


def start_engines(args: argparse.Namespace, token: str) -> list[subprocess.Popen[str]]:
    """The engines' processes (``--engine-processes``), each serving its share of ``--engines``."""
    return [
        subprocess.Popen(
            [sys.executable, __file__, "--serve", str(len(share)), "--loop", args.loop]
            + (
                ["--profile-engines", _numbered(args.profile_engines, i, args.engine_processes)]
                if args.profile_engines
                else []
            ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, env.CONTROL_TOKEN: token},
            text=True,
        )
        for i, share in enumerate(_split(args.engines, args.engine_processes))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=256)
    parser.add_argument("--refits", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--profile", default=None, help="cProfile the sidecar's counted refits into this file")
    parser.add_argument("--profile-engines", default=None, help="cProfile the engines' process into this file")
    parser.add_argument(
        "--fold-announce",
        action="store_true",
        help="the sidecar's loads carry the target (drs sidecar --fold-announce): one call per engine",
    )
    parser.add_argument(
        "--loop",
        choices=LOOPS,
        default="uvloop",
        help="both processes' event loop: uvloop, as `drs engine` (uvicorn picks it) and `drs sidecar` run; "
        "asyncio: this bench before 2026-12-06",
    )
    parser.add_argument(
        "--engine-processes",
        type=int,
        default=1,
        help="the engines spread over this many processes (1: all in one, as before; the CPU figures sum them)",
    )
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    run = LOOPS[args.loop]
    if args.serve is not None:
        run(serve(args.serve, args.profile_engines))
        return
    token = "refit-scale-token"
    load_before = os.getloadavg()
    started = time.perf_counter()
    children = start_engines(args, token)
    engines_gc: list[Any] = []
    try:
        urls: list[str] = []
        for child in children:
            assert child.stdout is not None
            line = child.stdout.readline()
            if not line:
                raise SystemExit("an engines' process exited before it served")
            urls.extend(json.loads(line))
        engines_up_s = time.perf_counter() - started
        pids = [child.pid for child in children]
        result = run(drive(urls, token, args.refits, args.concurrency, pids, args.profile, args.fold_announce))
    finally:
        for child in children:
            if child.stdin is not None:
                child.stdin.close()
        for child in children:
            if child.stdout is not None:
                engines_gc.append(json.loads(child.stdout.readline() or "null"))
            child.wait(120)
    out = {
        "bench": "refit_scale",
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "engines": len(urls),
        "concurrency": args.concurrency,
        "fold_announce": args.fold_announce,
        "loop": args.loop,
        "engine_processes": len(children),
        "refits": args.refits,
        "engines_up_s": round(engines_up_s, 1),
        **result,
        #: each engines' process's time in its garbage collector over every refit, warm-up included
        "engines_gc": engines_gc[0] if len(engines_gc) == 1 else engines_gc,
        "target_le_0.5s": result["trainer_call_s"]["median"] <= 0.5,
        "loadavg_1m": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
