"""Benchmark: the frontend relay against fast sim engines, as a ratio to calling the engines directly.

Not a test. Starts sim engines (speed 0: no simulated latency) as ``drs engine`` subprocesses and
measures, for each variant, one frontend process pinned to one core (``taskset``, when present):

* ``direct``: the load generator itself makes the two legs (context, then generation) against
  the same engines, shaping the bodies with the frontend's own pure functions: the baseline;
* ``server+raw`` (the default), ``server+aiohttp``, ``server+httpx``: a frontend process (the
  project's HTTP server, :mod:`drs_frontend.httpserver`) with that upstream client;
* ``uvicorn+raw``: the same app and client behind uvicorn through a plain ASGI adapter (the
  frontend's HTTP surface before its own server), and ``fastapi+raw`` (behind FastAPI routes;
  not run by default).

Figures per variant: ``rps`` (two-leg turns per second at ``--concurrency``, wall clock: on a
shared 2-core machine this is mostly the engines' and load generator's limit),
``frontend_cpu_ms_per_turn`` and ``rps_per_frontend_core`` (= 1000 / that: what one core of
frontend sustains, independent of the engines; measured with the frontend ~15% busy, since the sim
engines cap the rate near 300 turns/s here, so a wake-up per event and its context switch are
counted in every turn: a pessimistic figure), ``p50_ms``/``p99_ms`` at concurrency 1 and
``added_p50_ms`` over ``direct``, each the median over ``--rounds`` interleaved rounds. The last
line is one JSON object with all of them and the ratios. ``python bench/relay.py serve …`` is the
frontend process the benchmark starts.

    .venv/bin/python bench/relay.py [--requests 3000] [--concurrency 32] [--rounds 3]
    .venv/bin/python bench/relay.py --variants server+raw,uvicorn+raw
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
from drs_protocol import routes
from drs_protocol.enums import ROLES
from fastapi import FastAPI, Request, Response

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
DRS = str(Path(PYTHON).parent / "drs")
CHAT = routes.Endpoint.CHAT.value
VARIANTS = (("server", "raw"), ("server", "aiohttp"), ("server", "httpx"), ("uvicorn", "raw"))


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
    from drs_frontend.shaping import build_context_request, build_generation_request
    from drs_protocol.routes import Endpoint

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
        for role in (r.value for r in ROLES):
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
            await wait_ready(session, url + routes.HEALTH, proc)
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
                port = free_port()
                cmd = [PYTHON, __file__, "serve", "--framework", framework, "--upstream", client, "--port", str(port)]
                for url in pre:
                    cmd += ["--prefill", url]
                for url in dec:
                    cmd += ["--decode", url]
                with process(pinned(cmd, 1)) as proc:
                    url = f"http://127.0.0.1:{port}"
                    await wait_ready(session, url + routes.READY, proc)
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
        "raw_over_aiohttp_per_core": ("server+raw", "server+aiohttp"),
        "aiohttp_over_httpx_per_core": ("server+aiohttp", "server+httpx"),
        "server_over_uvicorn_per_core": ("server+raw", "uvicorn+raw"),
        "uvicorn_over_fastapi_per_core": ("uvicorn+raw", "fastapi+raw"),
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
    from drs_frontend.app import FrontendApp
    from drs_frontend.config import FrontendConfig
    from drs_frontend.server import bind_socket, serve_forever

    config = FrontendConfig(
        prefill=args.prefill, decode=args.decode, host="127.0.0.1", port=args.port, upstream_client=args.upstream
    )
    app = FrontendApp(config)
    sock = bind_socket(config.host, config.port)
    if args.framework == "server":
        serve_forever(app, sock)
        return
    import uvicorn

    wrapped = asgi_wrapper(app) if args.framework == "uvicorn" else fastapi_wrapper(app)
    uvicorn.Server(
        uvicorn.Config(
            wrapped,
            lifespan="on",
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            loop="uvloop",
            http="httptools",
        )
    ).run(sockets=[sock])


def asgi_wrapper(app: Any) -> Any:
    """The same routes as a plain ASGI app for uvicorn (the frontend's HTTP surface until the
    project's own server replaced it): the baseline of ``server_over_uvicorn_per_core``."""
    from drs_frontend.httpserver import Request

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await app.startup()
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await app.shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        request = Request(scope["method"], scope["path"], scope["headers"], b"".join(chunks))
        response = await app.handle(request)
        headers = [(b"content-type", response.content_type), (b"content-length", b"%d" % len(response.body))]
        await send({"type": "http.response.start", "status": response.status, "headers": [*headers, *response.headers]})
        await send({"type": "http.response.body", "body": response.body})

    return asgi


def fastapi_wrapper(app: Any) -> Any:
    """The same relay behind FastAPI routes (the first HTTP surface the frontend was measured with)."""
    from drs_protocol.routes import Endpoint

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

    @api.get(routes.READY)
    async def ready() -> Response:
        return Response(status_code=200 if app.prober.ready() else 503)

    return api


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    s = sub.add_parser("serve")
    s.add_argument("--framework", choices=["server", "uvicorn", "fastapi"], default="server")
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
    args = parser.parse_args()
    if args.command == "serve":
        serve(args)
        return
    args.variant_names = [v for v in args.variants.split(",") if v]
    results = asyncio.run(run(args))
    print(json.dumps(summarize(results, args)))


if __name__ == "__main__":
    main()
