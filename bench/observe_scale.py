"""The operator's look at its engines at fleet scale: one pass of ``EngineClient.observe``
(``GET /control/weights`` on every engine, ``operator/drs_operator/kube/engines.py``) over N real
sim engines, against the pass's budget (prints one JSON line).

The engines run in one child process (``bench/refit_scale.py --serve``), the operator's
client in this one. For each N of ``--sizes`` (the first N engines): one warm-up pass, then
``--rounds`` passes; each pass's wall time, this process's CPU time per pass (the operator's own
cost wherever the engines run) and how many engines were unknown (a pass past the budget leaves
engines unknown: ``WeightsPending`` would flap). ``per_engine_ratio``: the median pass time per
engine at N over the same at the smallest N, in this run (1.0: linear). On a small machine the
wall time is mostly the engines' process answering N calls at once.

    python bench/observe_scale.py [--engines 256] [--sizes 16,64,256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

from drs_protocol import env


async def drive(urls: list[str], token: str, sizes: list[int], rounds: int) -> dict[str, Any]:
    from drs_operator.engine_observation import Target
    from drs_operator.kube.engines import OBSERVE_BUDGET_S, EngineClient

    client = EngineClient()
    out: dict[str, Any] = {"budget_s": OBSERVE_BUDGET_S, "call_s": client.call_s, "concurrency": client.concurrency}
    try:
        for n in sizes:
            targets = [Target(f"e{i}", url) for i, url in enumerate(urls[:n])]
            walls, cpus, unknown = [], [], 0
            for i in range(rounds + 1):  # the first warms connections up and is not counted
                started, cpu = time.perf_counter(), time.process_time()
                seen = await client.observe(targets, token)
                wall, cpu = time.perf_counter() - started, time.process_time() - cpu
                if i:
                    walls.append(wall)
                    cpus.append(cpu)
                    unknown += sum(o.held is None for o in seen)
            out[str(n)] = {
                "pass_s": {"median": round(statistics.median(walls), 4), "max": round(max(walls), 4)},
                "cpu_s": {"median": round(statistics.median(cpus), 4), "max": round(max(cpus), 4)},
                "unknown": unknown,
            }
    finally:
        await client.close()
    base = sizes[0]
    for n in sizes:
        per = out[str(n)]["pass_s"]["median"] / n
        out[str(n)]["per_engine_ratio"] = round(per / (out[str(base)]["pass_s"]["median"] / base), 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=256)
    parser.add_argument("--sizes", default="16,64,256")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if sizes[-1] > args.engines:
        raise SystemExit(f"--sizes: {sizes[-1]} is more than --engines {args.engines}")
    token = "observe-scale-token"
    started = time.perf_counter()
    here = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.Popen(
        [sys.executable, os.path.join(here, "refit_scale.py"), "--serve", str(args.engines)],
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
        result = asyncio.run(drive(urls, token, sizes, args.rounds))
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(120)
    print(
        json.dumps(
            {
                "bench": "observe_scale",
                "machine": f"{platform.machine()} {os.cpu_count()} cores",
                "engines": len(urls),
                "rounds": args.rounds,
                "engines_up_s": round(engines_up_s, 1),
                **result,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
