"""Where a disaggregated 16k-token turn's time goes, on this machine's GPU(s): one JSON line.

A prefill engine (GPU 0) and a CUDA IPC decode engine (the second GPU where there are two), prefix
caches off; after a warm-up, ``RUNS`` turns on fresh prompts. Per turn, from the client: the
context leg's round trip, and the generation leg's first token after sending it; from the decode
engine's ``/server_info``: its KV fetch's steps (ms from the fetch's start: the arena copy, the
take request's response head, the frame read, the KV placed), and from the prefill engine's: its
export handler's steps (the copy event opened, the context taken, the frame made). Beside it, one engine's TTFT on the
same prompt length. A profile for ``bench/gpu_disagg.py``'s TTFT ratio, not a benchmark of its own.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from drs_protocol import routes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_disagg import DECODE, MODEL, body, prompt, stream  # noqa: E402
from tests.gpu import procs  # noqa: E402

RUNS = 4
TOKENS = 16384
COMPLETIONS = routes.Endpoint.COMPLETIONS


async def turn(client: httpx.AsyncClient, p: str, d: str, ids: list[int]) -> dict[str, Any]:
    t0 = time.perf_counter()
    ctx = await client.post(p + COMPLETIONS, json=body(ids, disaggregated_params={"request_type": "context_only"}))
    t_ctx = time.perf_counter()
    dp = ctx.json()["choices"][0]["disaggregated_params"]
    gen = body(ids, max_tokens=2, disaggregated_params={**dp, "request_type": "generation_only"})
    ttft, _ = await stream(client, d, gen, t_ctx)
    info = (await client.get(d + routes.SERVER_INFO)).json()["engine"]["kv_transfers"]["cuda_ipc"]
    exports = (await client.get(p + routes.SERVER_INFO)).json()["engine"].get("kv_exports", {})
    return {
        "context_leg_ms": round(1000 * (t_ctx - t0), 2),
        "generation_first_token_ms": round(1000 * ttft, 2),
        "fetch_steps_ms": info.get("last_phases_ms"),
        # the prefill engine's export handler (the take: its event opened, the context taken, the frame)
        "take_steps_ms": {t: e.get("last_steps_ms") for t, e in exports.items()},
        "copy_ms": round(1000 * float(info.get("last_copy_seconds", 0)), 3),
    }


async def main() -> dict[str, Any]:
    off: dict[str, Any] = {"cacheCapacityTokens": 0}
    async with (
        procs.engine(procs.engine_config("prefill", "cuda:0", MODEL, **off)) as p,
        procs.engine(procs.engine_config("decode", DECODE, MODEL, kvTransport="cuda_ipc", **off)) as d,
        httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client,
    ):
        await turn(client, p, d, prompt(256, 1))  # warm-up: kernels, the arena and its mapping
        turns = [await turn(client, p, d, prompt(TOKENS, 100 + i)) for i in range(RUNS)]
        alone = [
            (await stream(client, p, body(prompt(TOKENS, 200 + i), max_tokens=2), time.perf_counter()))[0]
            for i in range(RUNS)
        ]
    return {
        "bench": "gpu_handoff_profile",
        "tokens": TOKENS,
        "one_engine_ttft_ms": round(1000 * statistics.median(alone), 2),
        "turns": turns,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())), flush=True)
