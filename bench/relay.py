"""Benchmark: the frontend relay against fast sim engines, as a ratio to calling the engines directly.

Not a test. Starts sim engines (speed 0: no simulated latency) as ``drs engine`` subprocesses and
measures, for each variant, one frontend process pinned to one core (``taskset``, when present):

* ``direct``: the load generator itself makes the two legs (context, then generation) against
  the same engines, shaping the bodies with the frontend's own pure functions: the baseline;
* ``asgi+raw`` (the default), ``asgi+aiohttp``, ``asgi+httpx``, ``fastapi+raw``: a frontend
  process with that HTTP surface and upstream client.

Figures per variant: ``rps`` (two-leg turns per second at ``--concurrency``, wall clock: on a
shared 2-core machine this is mostly the engines' and load generator's limit),
``frontend_cpu_ms_per_turn`` and ``rps_per_frontend_core`` (= 1000 / that: what one core of
frontend sustains, independent of the engines; measured with the frontend ~15% busy, since the sim
engines cap the rate near 300 turns/s here, so a wake-up per event and its context switch, ~25%
of the frontend's CPU in ``perf``, are counted in it), ``p50_ms``/``p99_ms`` at concurrency 1 and
``added_p50_ms`` over ``direct``, each the median over ``--rounds`` interleaved rounds. The last
line is one JSON object with all of them and the ratios. ``python bench/relay.py serve …`` is the frontend process the benchmark starts.

``--variants`` picks some of them; ``--baseline DIR`` adds ``before+<client>`` variants that run
the frontend from another source tree (e.g. ``git archive HEAD~3 frontend protocol | tar -x -C
DIR``), interleaved with the others, for before/after comparisons in one run.

    .venv/bin/python bench/relay.py [--requests 3000] [--concurrency 32] [--rounds 3]
    .venv/bin/python bench/relay.py --variants asgi+aiohttp,asgi+raw --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
from fastapi import FastAPI, Request, Response

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
DRS = str(Path(PYTHON).parent / "drs")
CHAT = "/v1/chat/completions"
VARIANTS = (("asgi", "raw"), ("asgi", "aiohttp"), ("asgi", "httpx"), ("fastapi", "raw"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pinned(cmd: list[str], core: int | None) -> list[str]:
    if core is None or shutil.which("taskset") is None:
        return cmd
    return ["taskset", "-c", str(core), *cmd]


@contextlib.contextmanager
def process(cmd: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


async def wait_ready(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(url) as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not ready")


def body(i: int) -> dict[str, Any]:
    return {
        "model": "sim-qwen3",
        "messages": [{"role": "user", "content": f"Request {i % 64}: say something short."}],
        "max_tokens": 4,
        "conversation_params": {"conversation_id": f"conv-{i % 64}"},
    }


async def direct_turn(session: aiohttp.ClientSession, prefill: str, decode: str, i: int) -> None:
    """The two legs made by the client itself (the baseline), with the frontend's shaping."""
    from drs_frontend.shaping import Endpoint, build_context_request, build_generation_request

    request = body(i)
    ctx_body = build_context_request(
        request, disagg_request_id=2**41 + i, conversation_id=f"conv-{i % 64}", tokids_ctxbytes=True
    )
    async with session.post(prefill + CHAT, json=ctx_body) as resp:
        ctx = await resp.json()
        assert resp.status == 200, ctx
    gen_body = build_generation_request(request, ctx, endpoint=Endpoint.CHAT, strip_history=True)
    async with session.post(decode + CHAT, json=gen_body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def frontend_turn(session: aiohttp.ClientSession, url: str, i: int) -> None:
    async with session.post(url + CHAT, json=body(i)) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def measure(
    turn: Any, requests: int, concurrency: int, latency_requests: int, pid: int | None
) -> dict[str, float]:
    for i in range(100):  # warm-up: connections, caches
        await turn(i)
    latencies = []
    for i in range(latency_requests):
        start = time.perf_counter()
        await turn(i)
        latencies.append(time.perf_counter() - start)
    latencies.sort()
    counter = iter(range(requests))

    async def worker() -> None:
        for i in counter:
            await turn(i)

    cpu_before = cpu_seconds(pid) if pid else 0.0
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    out = {
        "rps": round(requests / wall, 1),
        "p50_ms": round(statistics.median(latencies) * 1e3, 3),
        "p99_ms": round(latencies[int(len(latencies) * 0.99) - 1] * 1e3, 3),
    }
    if pid:
        cpu = cpu_seconds(pid) - cpu_before
        out["frontend_cpu_ms_per_turn"] = round(cpu / requests * 1e3, 4)
        out["rps_per_frontend_core"] = round(requests / cpu, 1) if cpu > 0 else float("inf")
    return out


@contextlib.asynccontextmanager
async def engines(
    session: aiohttp.ClientSession, count: int, core: int | None
) -> AsyncIterator[tuple[list[str], list[str]]]:
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        config = Path(tmp) / "sim.yaml"
        config.write_text("backend: sim\nmodel: {path: sim-qwen3}\nsim: {speed: 0, eosProbability: 0.0}\n")
        urls: dict[str, list[str]] = {"prefill": [], "decode": []}
        procs = []
        for role in ("prefill", "decode"):
            for _ in range(count):
                port = free_port()
                cmd = [
                    DRS,
                    "engine",
                    "--config",
                    str(config),
                    "--role",
                    role,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ]
                proc = stack.enter_context(process(pinned([*cmd, "--log-level", "warning"], core)))
                urls[role].append(f"http://127.0.0.1:{port}")
                procs.append((proc, urls[role][-1]))
        for proc, url in procs:
            await wait_ready(session, url + "/health", proc)
        yield urls["prefill"], urls["decode"]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every variant once per round, rounds interleaved (machine noise hits all alike); the
    figures of a variant are the medians over rounds."""
    connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
    rounds: dict[str, list[dict[str, float]]] = {}
    async with aiohttp.ClientSession(connector=connector) as session, engines(session, args.engines, 0) as (pre, dec):
        for number in range(args.rounds):
            print(f"round {number + 1}/{args.rounds}: direct", file=sys.stderr)
            rounds.setdefault("direct", []).append(
                await measure(
                    lambda i: direct_turn(session, pre[i % len(pre)], dec[i % len(dec)], i),
                    args.requests,
                    args.concurrency,
                    args.latency_requests,
                    None,
                )
            )
            for name in args.variant_names:
                framework, client = name.split("+")
                env = None
                if framework == "before":
                    framework = "asgi"
                    tree = Path(args.baseline)
                    env = {**os.environ, "PYTHONPATH": f"{tree / 'frontend'}:{tree / 'protocol'}"}
                port = free_port()
                cmd = [PYTHON, __file__, "serve", "--framework", framework, "--upstream", client, "--port", str(port)]
                for url in pre:
                    cmd += ["--prefill", url]
                for url in dec:
                    cmd += ["--decode", url]
                with process(pinned(cmd, 1), env) as proc:
                    url = f"http://127.0.0.1:{port}"
                    await wait_ready(session, url + "/ready", proc)
                    figures = await measure(
                        lambda i, u=url: frontend_turn(session, u, i),
                        args.requests,
                        args.concurrency,
                        args.latency_requests,
                        proc.pid,
                    )
                rounds.setdefault(name, []).append(figures)
                print(f"  {name}: {figures}", file=sys.stderr)
    return {
        name: {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]} for name, runs in rounds.items()
    }


def summarize(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    direct = results["direct"]
    for name, figures in results.items():
        if name == "direct":
            continue
        figures["rps_over_direct"] = round(figures["rps"] / direct["rps"], 3)
        figures["added_p50_ms"] = round(figures["p50_ms"] - direct["p50_ms"], 3)
    out: dict[str, Any] = {
        "bench": "relay",
        "cpu": _cpu_model(),
        "nproc": os.cpu_count(),
        "engines_per_role": args.engines,
        "concurrency": args.concurrency,
        "requests": args.requests,
        "rounds": args.rounds,
        "results": results,
    }
    ratios = {
        "raw_over_aiohttp_per_core": ("asgi+raw", "asgi+aiohttp"),
        "aiohttp_over_httpx_per_core": ("asgi+aiohttp", "asgi+httpx"),
        "asgi_over_fastapi_per_core": ("asgi+raw", "fastapi+raw"),
        "after_over_before_aiohttp_per_core": ("asgi+aiohttp", "before+aiohttp"),
        "after_over_before_raw_per_core": ("asgi+raw", "before+raw"),
    }
    for key, (a, b) in ratios.items():
        if a in results and b in results:
            out[key] = round(results[a]["rps_per_frontend_core"] / results[b]["rps_per_frontend_core"], 2)
    return out


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


# -- the frontend process under test ---------------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    from drs_frontend.asgi import FrontendApp
    from drs_frontend.config import FrontendConfig
    from drs_frontend.server import bind_socket, uvicorn_server

    config = FrontendConfig(
        prefill=args.prefill, decode=args.decode, host="127.0.0.1", port=args.port, upstream_client=args.upstream
    )
    app = FrontendApp(config)
    sock = bind_socket(config.host, config.port)
    if args.framework == "asgi":
        uvicorn_server(app, log_level="warning").run(sockets=[sock])
        return
    uvicorn_server(fastapi_wrapper(app), log_level="warning").run(sockets=[sock])


def fastapi_wrapper(app: Any) -> Any:
    """The same relay behind FastAPI routes (the alternative the raw ASGI app was measured against)."""
    from drs_frontend.shaping import Endpoint

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await app.startup()
        yield
        await app.shutdown()

    api = FastAPI(lifespan=lifespan)

    @api.post(CHAT)
    async def chat(request: Request) -> Response:
        raw = await request.body()
        reply = await app.relay.handle(Endpoint.CHAT, raw, request.headers)
        headers = {k.decode(): v.decode() for k, v in reply.engine_headers()}
        return Response(reply.body, status_code=reply.status, media_type=reply.content_type, headers=headers)

    @api.get("/ready")
    async def ready() -> Response:
        return Response(status_code=200 if app.prober.ready() else 503)

    return api


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    s = sub.add_parser("serve")
    s.add_argument("--framework", choices=["asgi", "fastapi"], default="asgi")
    s.add_argument("--upstream", choices=["raw", "aiohttp", "httpx"], default="raw")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--prefill", action="append", required=True)
    s.add_argument("--decode", action="append", required=True)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--latency-requests", type=int, default=300)
    parser.add_argument("--engines", type=int, default=2, help="sim engines per role")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each variant (medians reported)")
    parser.add_argument(
        "--variants", default=",".join(f"{f}+{c}" for f, c in VARIANTS), help="comma-separated framework+client"
    )
    parser.add_argument("--baseline", help="source tree (frontend/, protocol/) for before+<client> variants")
    args = parser.parse_args()
    if args.command == "serve":
        serve(args)
        return
    args.variant_names = [v for v in args.variants.split(",") if v]
    if args.baseline:
        clients = dict.fromkeys(v.split("+")[1] for v in args.variant_names if not v.startswith("before+"))
        args.variant_names += [f"before+{c}" for c in clients if f"before+{c}" not in args.variant_names]
    results = asyncio.run(run(args))
    print(json.dumps(summarize(results, args)))


if __name__ == "__main__":
    main()
