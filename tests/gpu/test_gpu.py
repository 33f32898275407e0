"""The ``torch`` backend on CUDA GPUs: engines as ``drs engine`` processes.

Run by ``make gpu``; on one GPU every engine shares it (CUDA IPC maps memory between processes on
one device as well as across devices), on two the decode engine takes the second. What they prove:
decoding from handed-off KV gives exactly one engine's tokens over both transports (CUDA IPC and
HTTP bytes); a later turn reuses its prefix's KV; a refit driven by ``drs sidecar`` with the
example trainer serves exactly the trainer's weights: colocated by CUDA IPC (a two-engine fleet
sharing the trainer's GPU), by NCCL (the trainer on GPU 0, an engine on GPU 1: needs two GPUs, since
NCCL refuses two ranks on one GPU) and by gloo (a two-engine fleet, host memory); sleep frees the
GPU memory and wake gives the same tokens.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from . import procs
from .conftest import COMPLETIONS, completion_body, decode_gpu, prompt_ids, save_random_hf_qwen3, transformers_greedy

MODEL = "random:0.6b"


async def tokens(client: httpx.AsyncClient, url: str, ids: list[int], **extra: Any) -> list[int]:
    response = await client.post(url + COMPLETIONS, json=completion_body(ids, **extra))
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


async def disaggregated(
    client: httpx.AsyncClient, prefill: str, decode: str, ids: list[int], **extra: Any
) -> list[int]:
    ctx = await client.post(
        prefill + COMPLETIONS, json=completion_body(ids, **extra, disaggregated_params={"request_type": "context_only"})
    )
    assert ctx.status_code == 200, ctx.text
    dp = ctx.json()["choices"][0]["disaggregated_params"]
    gen = await client.post(
        decode + COMPLETIONS,
        json=completion_body(ids, **extra, disaggregated_params={**dp, "request_type": "generation_only"}),
    )
    assert gen.status_code == 200, gen.text
    return list(gen.json()["choices"][0]["token_ids"])


@pytest.mark.gpu(1)
@pytest.mark.parametrize("transport", ["auto", "http"])
async def test_decoding_from_handed_off_kv_equals_one_engine(transport: str) -> None:
    ids = prompt_ids(2048)
    async with (
        # no prefix cache on the prefill engine: the context leg would reuse the first run's KV
        # blocks and compute only the last token (a different kernel path, other bf16 rounding)
        procs.engine(procs.engine_config("prefill", "cuda:0", MODEL, cacheCapacityTokens=0)) as p,
        procs.engine(procs.engine_config("decode", f"cuda:{decode_gpu()}", MODEL, kvTransport=transport)) as d,
        httpx.AsyncClient(timeout=300) as client,
    ):
        single = await tokens(client, p, ids, max_tokens=48)
        split = await disaggregated(client, p, d, ids, max_tokens=48)
        assert split == single and len(set(single)) > 1
        # again: the arena region the first context left is reused only after the first copy is done
        assert await disaggregated(client, p, d, ids, max_tokens=48) == single
        info = (await client.get(d + "/server_info")).json()["engine"]
        used = "cuda_ipc" if transport == "auto" else "http"
        assert info["kv_transfers"][used]["count"] == 2, info["kv_transfers"]
        if transport == "auto":  # the take went out while the copy ran (copy_event), not after it
            phases = info["kv_transfers"][used]["last_phases_ms"]
            assert phases["arena_copy_enqueued"] < phases["response_head"] < phases["arena_copy"], phases


@pytest.mark.gpu(1)
async def test_a_later_turn_reuses_its_prefix_kv_on_the_gpu() -> None:
    first = prompt_ids(1000)
    later = first + prompt_ids(300, offset=40000)
    config = procs.engine_config("prefill", "cuda:0", "random:small", precision="float32", tokensPerBlock=64)
    async with (
        procs.engine(config) as cached,
        procs.engine({**config, "torch": {**config["torch"], "cacheCapacityTokens": 0}}) as uncached,
        httpx.AsyncClient(timeout=300) as client,
    ):
        await tokens(client, cached, first)
        response = await client.post(cached + COMPLETIONS, json=completion_body(later))
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 960  # 15 blocks of 64
        assert response.json()["choices"][0]["token_ids"] == await tokens(client, uncached, later)


async def _refit_through_sidecar(engines: list[str], backend: str, tmp_path: Path, client: httpx.AsyncClient) -> None:
    ids = prompt_ids(300)
    before = [await tokens(client, url, ids) for url in engines]
    async with procs.sidecar(*engines) as sidecar:
        report = await procs.run_trainer(
            sidecar, "--model", MODEL, "--seed", "77", "--device", "cuda:0", "--backend", backend,
            "--save", str(tmp_path / "step-77"),
        )  # fmt: skip
    assert report["engines_ok"] == len(engines), report
    if backend != "ipc":
        assert report["world_size"] == 1 + len(engines), report
    after = [await tokens(client, url, ids) for url in engines]
    for url in engines:
        refit = (await client.get(url + "/server_info")).json()["engine"]["last_refit"]
        assert refit["version"] == "step-77" and refit["bytes"] == report["bytes"], refit
        if backend != "gloo":  # NCCL lands in the packed weights, IPC copies each batch in one piece
            assert refit["buckets_in_place"] == refit["buckets"], refit
    assert all(a != b for a, b in zip(after, before, strict=True))
    # under the refit's own version: the refit announced step-77 as the fleet's target
    # (drs_protocol.cutover), so a load naming another version would leave the engine refusing legs
    load = await client.post(
        engines[0] + "/control/weights/load",
        headers=procs.auth(),
        json={"path": str(tmp_path / "step-77"), "version": "step-77"},
    )
    assert load.status_code == 200, load.text
    assert await tokens(client, engines[0], ids) == after[0]  # the broadcast weights are the checkpoint's
    assert len({tuple(t) for t in after}) == 1  # every engine serves the same new weights


@pytest.mark.gpu(2)
async def test_an_nccl_refit_through_drs_sidecar_serves_the_trainers_weights(tmp_path: Path) -> None:
    async with (
        procs.engine(procs.engine_config("decode", "cuda:1", MODEL)) as e,
        httpx.AsyncClient(timeout=600) as client,
    ):
        await _refit_through_sidecar([e], "nccl", tmp_path, client)


@pytest.mark.gpu(1)
async def test_a_colocated_cuda_ipc_refit_through_drs_sidecar_serves_the_trainers_weights(tmp_path: Path) -> None:
    async with (
        procs.engine(procs.engine_config("prefill", "cuda:0", MODEL)) as a,
        procs.engine(procs.engine_config("decode", f"cuda:{decode_gpu()}", MODEL)) as b,
        httpx.AsyncClient(timeout=600) as client,
    ):
        await _refit_through_sidecar([a, b], "ipc", tmp_path, client)


@pytest.mark.gpu(1)
async def test_a_two_engine_fleet_refits_through_drs_sidecar(tmp_path: Path) -> None:
    async with (
        procs.engine(procs.engine_config("prefill", "cuda:0", MODEL)) as a,
        procs.engine(procs.engine_config("decode", f"cuda:{decode_gpu()}", MODEL)) as b,
        httpx.AsyncClient(timeout=600) as client,
    ):
        await _refit_through_sidecar([a, b], "gloo", tmp_path, client)


@pytest.mark.gpu(1)
async def test_sleep_frees_the_gpu_memory_and_wake_gives_the_same_tokens() -> None:
    import torch
    from drs_engine.backends.torch.model import SIZES, expected_shapes

    ids = prompt_ids(500)
    gpu = decode_gpu()
    async with (
        procs.engine(procs.engine_config("decode", f"cuda:{gpu}", MODEL)) as e,
        httpx.AsyncClient(timeout=300) as client,
    ):
        before = await tokens(client, e, ids)
        free_awake = torch.cuda.mem_get_info(gpu)[0]
        sleep = await client.post(e + "/control/memory/release", headers=procs.auth(), json={})
        assert sleep.status_code == 200, sleep.text
        free_asleep = torch.cuda.mem_get_info(gpu)[0]
        weights = 2 * sum(math.prod(shape) for shape in expected_shapes(SIZES["0.6b"]).values())  # bfloat16
        assert free_asleep - free_awake >= 0.9 * weights, (free_awake, free_asleep, sleep.json())
        assert sleep.json()["result"]["gpu_allocated_bytes"] < 0.1 * weights  # the engine holds ~nothing
        wake = await client.post(e + "/control/memory/resume", headers=procs.auth(), json={})
        assert wake.status_code == 200
        assert wake.json()["result"]["gpu_allocated_bytes"] >= weights  # the weights are back on the GPU
        assert await tokens(client, e, ids) == before


@pytest.mark.gpu(1)
async def test_float32_greedy_equals_transformers_generate_at_the_0_6b_shape(tmp_path: Path) -> None:
    """A random Qwen3 model of Qwen3-0.6B's shapes, saved with ``save_pretrained`` and served by
    ``drs engine --backend torch`` in float32: exactly transformers' greedy tokens (64 of 64) at
    16, 512 and 2,048-token prompts, and again through the prefix cache (a later turn)."""
    model = save_random_hf_qwen3("0.6b", tmp_path)
    config = procs.engine_config("prefill", "cuda:0", str(tmp_path), precision="float32")
    async with procs.engine(config) as e, httpx.AsyncClient(timeout=300) as client:
        for n in (16, 512, 2048):
            ids = prompt_ids(n)
            expected = transformers_greedy(model, ids, 64, "cuda:0")
            assert await tokens(client, e, ids, max_tokens=64) == expected, n
        assert await tokens(client, e, ids, max_tokens=64) == expected  # its blocks cached now
