"""Disaggregated serving with the ``torch`` backend on one or more GPUs: KV handoff, refit, TTFT, decode.

Prints one JSON line. Everything is measured in this run, on this machine:

- ``baseline``: the link's practical limit, the denominator of every ratio, named in the line: on
  two or more GPUs a warm GPU 0 → GPU 1 peer copy; on one GPU a warm copy within it (both
  engines share that GPU, so their KV and weights move through its memory). Bytes moved over
  seconds, at 256 MiB and 1 GiB; the ratios use 1 GiB;
- ``kv_handoff``: per transport, the decode engine's KV fetch of a 16k-token context: ``gbps``
  the whole fetch (CUDA IPC: the copy out of the prefill engine's handoff arena, then the take
  request; HTTP: the bytes), ``steps_ms`` its steps, and for CUDA IPC ``copy_gbps`` the GPU copy
  alone (CUDA events around the one bulk copy);
- ``refit``: the example trainer (GPU 0, weights packed in one buffer) into an engine through
  ``drs sidecar``: ``cuda_ipc`` (colocated: the engine copies the trainer's shared buffer into
  its packed weights) on any GPU count, and ``nccl`` (packed broadcast, into the engine's
  weights in place) on two or more; ``gbps`` the engine's receive, ``trainer_gbps`` the
  trainer's side (NCCL: its broadcast; IPC: the whole call through the sidecar);
- ``ttft_ms`` / ``decode_tok_s`` at 2k and 16k-token prompts: one engine (context and generation
  on GPU 0) against disaggregated (context on GPU 0, generation on the decode GPU) per transport;
  the median of ``REPEATS`` runs, each on a fresh prompt (prefix caches off), prompts sent as
  base64 ids as the frontend relays them; disaggregated TTFT runs from sending the context leg to
  the generation leg's first streamed token;
- ``decode_batching``: one engine's decode tokens/s with 1 and 8 concurrent requests.

Needs a CUDA GPU and PyTorch; engines are ``drs engine`` processes (``tests/gpu/procs.py``).
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


#: Two or more GPUs: the decode engine and the refit's engine are on GPU 1 (KV and weights cross the
#: link). One GPU: everything shares GPU 0. The JSON line names the baseline either way.
TWO_GPUS = torch.cuda.device_count() >= 2
DECODE = "cuda:1" if TWO_GPUS else "cuda:0"
BASELINE = "peer copy GPU0->GPU1" if TWO_GPUS else "same-device copy on GPU0 (one GPU)"


def baseline_gbps(nbytes: int, repeats: int = 20) -> float:
    """A warm copy of ``nbytes`` from GPU 0 to the decode GPU (the same GPU when there is one)."""
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


async def transfer_gbps(client: httpx.AsyncClient, decode: str, transport: str) -> dict[str, float]:
    info = (await client.get(decode + routes.SERVER_INFO)).json()["engine"]["kv_transfers"][transport]
    out = {"gbps": float(info["last_gb_per_s"]), "ms": round(1000 * float(info["last_seconds"]), 3)}
    if "last_phases_ms" in info:
        out["steps_ms"] = info["last_phases_ms"]
    if "last_copy_gb_per_s" in info:
        out.update(
            copy_gbps=float(info["last_copy_gb_per_s"]), copy_ms=round(1000 * float(info["last_copy_seconds"]), 3)
        )
    return out


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


async def refit(client: httpx.AsyncClient, engine_url: str, backend: str) -> dict[str, Any]:
    async with procs.sidecar(engine_url) as sidecar:
        report = await procs.run_trainer(
            sidecar, "--model", MODEL, "--seed", "5", "--device", "cuda:0", "--backend", backend, "--updates", "3"
        )
    info = (await client.get(engine_url + routes.SERVER_INFO)).json()["engine"]["last_refit"]
    return {
        "gbps": info["gb_per_s"],
        "trainer_gbps": report["broadcast_gb_per_s"],
        "bytes": report["bytes"],
        "buckets": report["buckets"],
        "buckets_in_place": info["buckets_in_place"],
        "copy_gbps": info.get("copy_gb_per_s"),
    }


def ratios(values: dict[str, Any], base: float, keys: tuple[str, ...]) -> dict[str, Any]:
    return {**values, **{f"{k}_ratio": round(values[k] / base, 3) for k in keys if values.get(k) is not None}}


async def main() -> dict[str, Any]:
    copy = {"256MiB": round(baseline_gbps(256 << 20), 1), "1GiB": round(baseline_gbps(1 << 30), 1)}
    base = copy["1GiB"]
    no_cache: dict[str, Any] = {"cacheCapacityTokens": 0}
    async with (
        procs.engine(procs.engine_config("prefill", "cuda:0", MODEL, **no_cache)) as p,
        procs.engine(procs.engine_config("decode", DECODE, MODEL, kvTransport="cuda_ipc", **no_cache)) as d_ipc,
        procs.engine(procs.engine_config("decode", DECODE, MODEL, kvTransport="http", **no_cache)) as d_http,
        httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client,
    ):
        served = await serving(client, p, d_ipc, d_http)
        batch = await batching(client, p)
        refits = {"cuda_ipc": await refit(client, d_ipc, "ipc")}
        if TWO_GPUS:
            refits["nccl"] = await refit(client, d_ipc, "nccl")
    handoff = {t: ratios(v, base, ("gbps", "copy_gbps")) for t, v in served["handoff_gbps"].items()}
    big = served["ttft_ms"][str(SIZES[-1])]
    return {
        "bench": "gpu_disagg",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "model": f"{MODEL} bfloat16",
        "baseline": {"copy": BASELINE, "gbps": copy, "ratios_against": "1GiB"},
        "kv_handoff": {"tokens": SIZES[-1], **handoff},
        "refit": {k: ratios(v, base, ("gbps", "copy_gbps", "trainer_gbps")) for k, v in refits.items()},
        "ttft_ms": served["ttft_ms"],
        "decode_tok_s": served["decode_tok_s"],
        "decode_batching_tok_s": batch,
        "targets": {
            "kv_handoff_cuda_ipc_copy_ge_0.7x": handoff["cuda_ipc"].get("copy_gbps", 0) >= 0.7 * base,
            "kv_handoff_cuda_ipc_whole_fetch_ge_0.7x": handoff["cuda_ipc"]["gbps"] >= 0.7 * base,
            "refit_ge_0.7x": {k: (v["gbps"] or 0) >= 0.7 * base for k, v in refits.items()},
            "disagg_ttft_16k_le_1.1x": big["ratio_cuda_ipc"] <= 1.1,
        },
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())), flush=True)
