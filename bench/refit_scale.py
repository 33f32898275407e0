"""The refit's own overhead at fleet scale: the trainer's ``POST /v1/refit`` to ``drs sidecar``
until every engine's digest is verified, over N real sim engines (prints one JSON line).

The engines (``sim``, ``weightsLoadSeconds: 0``: the transfer itself is excluded, as the issue's
target says) run in one child process, the sidecar's app in this one with a static fleet of their
URLs (``--concurrency`` loads at once, 256 by default), and a trainer client posts the refits over
loopback HTTP. Every refit carries the checkpoint's digest, so each of the N answers is checked.
Reports each refit's wall time as the trainer saw it and the sidecar's own ``elapsed_s``; the target
is <= 0.5 s at 256 engines. Both processes share this machine's cores with the engines' work, so on
a small machine the wall time is mostly the engines' process answering N calls at once;
``sidecar_cpu_s`` is this process's CPU time per refit (the sidecar's fan-out, parsing and digest
checks, plus the trainer's one call): the orchestration's own cost wherever the engines run.

    python bench/refit_scale.py [--engines 256] [--refits 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from drs_protocol import env

#: Seconds the child may take to start its engines.
START_TIMEOUT_S = 900.0


async def serve(count: int) -> None:
    """The child: ``count`` sim engines; prints their URLs as one JSON line, then waits for EOF."""
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
        print(json.dumps(urls), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def drive(urls: list[str], token: str, refits: int, concurrency: int) -> dict[str, Any]:
    import httpx
    import uvicorn
    from drs_protocol.routes import TrainerRoute
    from drs_protocol.weights_digest import digest_files
    from drs_sidecar.app import build_app
    from drs_sidecar.control import ControlClient
    from drs_sidecar.fleet import StaticFleet
    from drs_sidecar.metrics import SidecarMetrics
    from drs_sidecar.refit import Refitter

    refitter = Refitter(StaticFleet(urls), ControlClient(token), SidecarMetrics(), concurrency=concurrency)
    server = uvicorn.Server(uvicorn.Config(build_app(refitter, reconcile_s=3600), port=0, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    sidecar = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    walls: list[float] = []
    inside: list[float] = []
    engine_s: list[float] = []  #: each engine's call, as the sidecar timed it
    cpus: list[float] = []  #: CPU seconds of this process (the sidecar and the trainer's client) per refit
    with tempfile.TemporaryDirectory() as tmp:
        async with httpx.AsyncClient(timeout=600) as client:
            for i in range(refits + 1):  # the first warms connections up and is not counted
                checkpoint = Path(tmp) / f"step-{i}"
                checkpoint.mkdir()
                (checkpoint / "model.safetensors").write_bytes(os.urandom(64))
                body = {"path": str(checkpoint), "version": f"step-{i}", "digest": digest_files(checkpoint)}
                started, cpu = time.perf_counter(), time.process_time()
                response = await client.post(sidecar + TrainerRoute.REFIT, json=body)
                wall, cpu = time.perf_counter() - started, time.process_time() - cpu
                report = response.json()
                if response.status_code != 200 or report["ok"] != len(urls):
                    raise SystemExit(f"refit {i} incomplete: {response.status_code} {json.dumps(report)[:2000]}")
                if i:
                    walls.append(wall)
                    inside.append(report["elapsed_s"])
                    engine_s.extend(o["elapsed_s"] for o in report["outcomes"])
                    cpus.append(cpu)
    server.should_exit = True
    await serving
    return {
        "trainer_call_s": {"median": round(statistics.median(walls), 3), "max": round(max(walls), 3)},
        "sidecar_elapsed_s": {"median": round(statistics.median(inside), 3), "max": round(max(inside), 3)},
        "engine_call_s": {"median": round(statistics.median(engine_s), 3), "max": round(max(engine_s), 3)},
        "sidecar_cpu_s": {"median": round(statistics.median(cpus), 3), "max": round(max(cpus), 3)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=256)
    parser.add_argument("--refits", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        asyncio.run(serve(args.serve))
        return
    token = "refit-scale-token"
    started = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(args.engines)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, env.CONTROL_TOKEN: token},
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        if not line:
            raise SystemExit("the engines' process exited before it served")
        urls = json.loads(line)
        engines_up_s = time.perf_counter() - started
        result = asyncio.run(drive(urls, token, args.refits, args.concurrency))
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(120)
    out = {
        "bench": "refit_scale",
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "engines": len(urls),
        "concurrency": args.concurrency,
        "refits": args.refits,
        "engines_up_s": round(engines_up_s, 1),
        **result,
        "target_le_0.5s": result["trainer_call_s"]["median"] <= 0.5,
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
