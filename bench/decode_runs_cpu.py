"""``torch.decodeStepsPerJob`` on the CPU: served decode tokens/s of two engines, one step a job
(today's default) and runs of up to ``RUN`` steps, in the same run, rounds alternating.

Not issue 25's figure (that is a GPU's, ``bench/gpu_disagg.py --decode-only --kv-layout
slots,slots-runs``): on the CPU a ``random:tiny`` float32 step is short, so what this shows is the
per-step host cost a run takes off the path (the event loop's round trip between two steps), on
this machine. Each engine is its own ``drs engine`` process (``tests/gpu/procs.py``). Per stream
count: a warm-up round per engine, then ``PAIRS`` pairs (which engine goes first alternates), each
round :func:`decode_rates.engine_streams`' aggregate tokens/s; the ratio is runs over one step a
job, per pair, median and spread. Prints one JSON line.

``python bench/decode_runs_cpu.py [--pairs N]``
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import decode_rates  # noqa: E402
from tests.gpu import procs  # noqa: E402

RUN = 8
STREAMS = (1, 8)
NEW_TOKENS = 128
PAIRS = 4


async def _round(client: httpx.AsyncClient, url: str, streams: int, salt: int) -> float:
    figures = await decode_rates.engine_streams(client, url, streams, salt=salt, rounds=1, new_tokens=NEW_TOKENS)
    return float(figures["aggregate_tok_s"]["median"])


async def main(pairs: int) -> dict[str, Any]:
    one = procs.engine_config("prefill", "cpu", "random:tiny", "float32", cacheCapacityTokens=0, decodeStepsPerJob=1)
    runs = procs.engine_config("prefill", "cpu", "random:tiny", "float32", cacheCapacityTokens=0, decodeStepsPerJob=RUN)
    out: dict[str, Any] = {}
    async with (
        procs.engine(one) as a,
        procs.engine(runs) as b,
        httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client,
    ):
        for streams in STREAMS:
            rates: dict[str, list[float]] = {"one_step_a_job": [], "runs": []}
            for p in range(pairs):
                order = [("one_step_a_job", a), ("runs", b)]
                for name, url in order if p % 2 == 0 else order[::-1]:
                    rates[name].append(await _round(client, url, streams, salt=100 * streams + p))
                print(f"decode_runs_cpu: {streams} streams, pair {p + 1}/{pairs}", file=sys.stderr, flush=True)
            ratios = [r / o for r, o in zip(rates["runs"], rates["one_step_a_job"], strict=True)]
            out[f"{streams}_streams"] = {
                "one_step_a_job_tok_s": decode_rates.spread(rates["one_step_a_job"]),
                "runs_tok_s": decode_rates.spread(rates["runs"]),
                "runs_over_one_step_a_job": {
                    **decode_rates.spread(ratios, 3),
                    "per_pair": [round(r, 3) for r in ratios],
                },
            }
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return {
        "bench": "decode_runs_cpu",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "commit": commit.stdout.strip(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "model": "random:tiny float32 on the CPU",
        "steps_per_job": RUN,
        "new_tokens": NEW_TOKENS,
        "prompt_tokens": decode_rates.PROMPT_TOKENS,
        "pairs": pairs,
        **out,
    }


if __name__ == "__main__":
    count = int(sys.argv[sys.argv.index("--pairs") + 1]) if "--pairs" in sys.argv else PAIRS
    print(json.dumps(asyncio.run(main(count))), flush=True)
