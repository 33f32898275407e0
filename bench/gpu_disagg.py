"""Disaggregated serving on two GPUs with the ``torch`` backend: KV handoff, refit, TTFT, decode.

Prints one JSON line. Everything is measured in this run, on this machine:

- ``peer_copy_gbps``: a warm GPU 0 → GPU 1 tensor copy (the link's practical limit), the
  baseline of every ratio;
- ``kv_handoff``: per transport, the decode engine's KV fetch of a 16k-token context (request,
  transfer, and the KV placed on its GPU), GB/s and the ratio to the peer copy;
- ``refit``: the example trainer's packed NCCL broadcast of the whole model (GPU 0) into an engine
  (GPU 1) through ``drs sidecar``, GB/s (pack + broadcast) and the ratio to the peer copy;
- ``ttft_ms`` / ``decode_tok_s`` at 2k and 16k-token prompts: one engine (context and generation
  on GPU 0) against disaggregated (context on GPU 0, generation on GPU 1) per transport; the
  median of ``REPEATS`` runs, each on a fresh prompt (prefix caches off), prompts sent as base64
  ids as the frontend relays them; disaggregated TTFT runs from sending the context leg to the
  generation leg's first streamed token;
- ``decode_batching``: one engine's decode tokens/s with 1 and 8 concurrent requests.

Needs two CUDA GPUs and PyTorch; engines are ``drs engine`` processes (``tests/gpu/procs.py``).
``make gpu`` runs it after the GPU tests.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from drs_protocol import routes
from drs_protocol.token_ids import encode_token_ids_b64

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.gpu import procs  # noqa: E402

MODEL = "random:0.6b"
SIZES = (2048, 16384)
REPEATS = 3
DECODE_TOKENS = 64
COMPLETIONS = routes.Endpoint.COMPLETIONS


#: Two GPUs: the decode engine and the refit's engine are on GPU 1 (KV and weights cross NVLink).
#: One GPU: everything on GPU 0, the baseline a device-to-device copy, the refit over gloo (NCCL
#: refuses two ranks on one GPU); the JSON line says which.
TWO_GPUS = torch.cuda.device_count() >= 2
DECODE = "cuda:1" if TWO_GPUS else "cuda:0"
REFIT_BACKEND = "nccl" if TWO_GPUS else "gloo"


def peer_copy_gbps(nbytes: int, repeats: int = 20) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DECODE)
    times = []
    for i in range(repeats + 3):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(DECODE)
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(DECODE)
        if i >= 3:
            times.append(time.perf_counter() - started)
    assert torch.equal(dst[:1024].cpu(), src[:1024].cpu())
    return nbytes / statistics.median(times) / 1e9


def prompt(n: int, salt: int) -> list[int]:
    return [1000 + (i * 7919 + salt * 104729) % 140000 for i in range(n)]


def body(ids: list[int], **extra: Any) -> dict[str, Any]:
    """A completion request with the prompt as base64 int32 ids, as the frontend relays it."""
    return {
        "model": "m",
        "prompt_token_ids_b64": encode_token_ids_b64(ids),
        "max_tokens": DECODE_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


async def stream(client: httpx.AsyncClient, url: str, payload: dict[str, Any], t0: float) -> tuple[float, float]:
    """(seconds from ``t0`` to the first token, decode tokens/s after it)."""
    first = last = 0.0
    count = 0
    async with client.stream("POST", url + COMPLETIONS, json={**payload, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            got = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
            if got:
                now = time.perf_counter()
                first = first or now
                last = now
                count += got
    return first - t0, (count - 1) / (last - first) if last > first else 0.0


async def one_engine(client: httpx.AsyncClient, url: str, ids: list[int]) -> tuple[float, float]:
    return await stream(client, url, body(ids), time.perf_counter())


async def disaggregated(client: httpx.AsyncClient, prefill: str, decode: str, ids: list[int]) -> tuple[float, float]:
    t0 = time.perf_counter()
    ctx = await client.post(
        prefill + COMPLETIONS, json=body(ids, disaggregated_params={"request_type": "context_only"})
    )
    assert ctx.status_code == 200, ctx.text
    dp = ctx.json()["choices"][0]["disaggregated_params"]
    return await stream(client, decode, body(ids, disaggregated_params={**dp, "request_type": "generation_only"}), t0)


async def transfer_gbps(client: httpx.AsyncClient, decode: str, transport: str) -> float:
    info = (await client.get(decode + routes.SERVER_INFO)).json()["engine"]["kv_transfers"]
    return float(info[transport]["last_gb_per_s"])


async def serving(client: httpx.AsyncClient, p: str, d_ipc: str, d_http: str) -> dict[str, Any]:
    ttft: dict[str, Any] = {}
    rate: dict[str, Any] = {}
    handoff: dict[str, Any] = {}
    salt = 0
    for n in (256, *SIZES):  # 256: warm-up (kernels, IPC handles, pinned buffers), not reported
        runs: dict[str, list[tuple[float, float]]] = {"one_engine": [], "cuda_ipc": [], "http": []}
        for _ in range(REPEATS):
            for name, target in (("one_engine", None), ("cuda_ipc", d_ipc), ("http", d_http)):
                salt += 1
                ids = prompt(n, salt)
                result = await (one_engine(client, p, ids) if target is None else disaggregated(client, p, target, ids))
                runs[name].append(result)
        if n == 256:
            continue
        med = {k: (statistics.median(t for t, _ in v), statistics.median(r for _, r in v)) for k, v in runs.items()}
        ttft[str(n)] = {k: round(v[0] * 1000, 2) for k, v in med.items()}
        ttft[str(n)].update({f"ratio_{k}": round(med[k][0] / med["one_engine"][0], 3) for k in ("cuda_ipc", "http")})
        rate[str(n)] = {k: round(v[1], 1) for k, v in med.items()}
        if n == SIZES[-1]:
            handoff = {t: await transfer_gbps(client, d, t) for t, d in (("cuda_ipc", d_ipc), ("http", d_http))}
    return {"ttft_ms": ttft, "decode_tok_s": rate, "handoff_gbps": handoff}


async def batching(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for concurrency in (1, 8):
        ids = [prompt(512, 9000 + concurrency * 10 + i) for i in range(concurrency)]
        started = time.perf_counter()
        await asyncio.gather(*(client.post(url + COMPLETIONS, json=body(x, max_tokens=128)) for x in ids))
        out[str(concurrency)] = round(concurrency * 128 / (time.perf_counter() - started), 1)
    return out


async def refit(client: httpx.AsyncClient, engine_url: str) -> dict[str, Any]:
    async with procs.sidecar(engine_url) as sidecar:
        report = await procs.run_trainer(
            sidecar, "--model", MODEL, "--seed", "5", "--device", "cuda:0", "--backend", REFIT_BACKEND, "--updates", "3"
        )
    info = (await client.get(engine_url + routes.SERVER_INFO)).json()["engine"]["last_refit"]
    return {"trainer": report, "engine": info}


async def main() -> dict[str, Any]:
    peer = {"256MiB": round(peer_copy_gbps(256 << 20), 1), "1GiB": round(peer_copy_gbps(1 << 30), 1)}
    base = peer["1GiB"]
    no_cache: dict[str, Any] = {"cacheCapacityTokens": 0}
    async with (
        procs.engine(procs.engine_config("prefill", "cuda:0", MODEL, **no_cache)) as p,
        procs.engine(procs.engine_config("decode", DECODE, MODEL, kvTransport="cuda_ipc", **no_cache)) as d_ipc,
        procs.engine(procs.engine_config("decode", DECODE, MODEL, kvTransport="http", **no_cache)) as d_http,
        httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client,
    ):
        served = await serving(client, p, d_ipc, d_http)
        batch = await batching(client, p)
        refitted = await refit(client, d_ipc)
    refit_gbps = float(refitted["trainer"]["broadcast_gb_per_s"])
    big = served["ttft_ms"][str(SIZES[-1])]
    return {
        "bench": "gpu_disagg",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "model": f"{MODEL} bfloat16",
        "baseline_copy": "GPU0->GPU1 peer copy" if TWO_GPUS else "GPU0 device-to-device copy (one GPU)",
        "peer_copy_gbps": peer,
        "kv_handoff": {
            t: {"gbps": g, "ratio_to_peer_copy": round(g / base, 3), "tokens": SIZES[-1]}
            for t, g in served["handoff_gbps"].items()
        },
        "refit": {
            "gbps": refit_gbps,
            "ratio_to_peer_copy": round(refit_gbps / base, 3),
            "backend": REFIT_BACKEND,
            "bytes": refitted["trainer"]["bytes"],
            "buckets": refitted["trainer"]["buckets"],
            "engine_receive_gbps": refitted["engine"].get("gb_per_s") if refitted["engine"] else None,
        },
        "ttft_ms": served["ttft_ms"],
        "decode_tok_s": served["decode_tok_s"],
        "decode_batching_tok_s": batch,
        "targets": {
            "kv_handoff_cuda_ipc_ge_0.7x": served["handoff_gbps"]["cuda_ipc"] >= 0.7 * base,
            "refit_ge_0.7x": refit_gbps >= 0.7 * base,
            "disagg_ttft_16k_le_1.1x": big["ratio_cuda_ipc"] <= 1.1,
        },
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())), flush=True)
