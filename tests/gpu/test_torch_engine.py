"""The ``torch`` backend end to end on the CPU: real engines on loopback, a real (tiny) model.

What runs here without a GPU: all three request types, the HTTP KV handoff, the prefix cache,
batched decode, refit from safetensors, sleep/wake and a gloo collective refit through the
sidecar with the example trainer. ``test_gpu.py`` repeats the parts that need GPUs.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_engine.server.runner import start_engine
from drs_protocol.routes import KV_COPY_EVENT_PARAM, KV_PROMPT_DIGEST_PARAM, kv_export_path

from .conftest import (
    COMPLETIONS,
    CONTROL_TOKEN,
    auth,
    completion_body,
    prompt_ids,
    save_random_hf_qwen3,
    torch_config,
    transformers_greedy,
)

ROOT = Path(__file__).resolve().parents[2]


async def tokens(client: httpx.AsyncClient, url: str, ids: list[int], **extra: Any) -> list[int]:
    response = await client.post(url + COMPLETIONS, json=completion_body(ids, **extra))
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


async def disaggregated(
    client: httpx.AsyncClient, prefill: str, decode: str, ids: list[int], **extra: Any
) -> list[int]:
    ctx = await client.post(
        prefill + COMPLETIONS,
        json=completion_body(ids, **extra, disaggregated_params={"request_type": "context_only"}),
    )
    assert ctx.status_code == 200, ctx.text
    dp = ctx.json()["choices"][0]["disaggregated_params"]
    gen = await client.post(
        decode + COMPLETIONS,
        json=completion_body(ids, **extra, disaggregated_params={**dp, "request_type": "generation_only"}),
    )
    assert gen.status_code == 200, gen.text
    return list(gen.json()["choices"][0]["token_ids"])


async def test_the_model_matches_transformers_qwen3() -> None:
    import torch
    import transformers
    from drs_engine.backends.torch.model import SIZES, decode_step, new_kv, prefill, random_state_dict

    shape = SIZES["tiny"]
    hf = {k: v for k, v in shape.to_hf_config().items() if k not in ("architectures", "model_type")}
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**hf)).eval()
    params = random_state_dict(shape, seed=11, device="cpu", dtype=torch.float32)
    model.load_state_dict(params)
    ids = prompt_ids(40)
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0]
    kv = new_kv(shape, 64, device="cpu", dtype=torch.float32)
    prefill(params, shape, ids[:32], kv, 0)  # a cached prefix, then the rest
    last = prefill(params, shape, ids[32:39], kv, 32)
    assert torch.allclose(last, reference[38], atol=1e-4)
    step = decode_step(params, shape, [ids[39]], [kv], [39])
    assert torch.allclose(step[0], reference[39], atol=1e-4)


async def test_context_then_generation_over_http_equals_one_engine() -> None:
    ids = prompt_ids(150)
    async with (
        start_engine(torch_config("prefill"), control_token=CONTROL_TOKEN) as p,
        start_engine(torch_config("decode", kvTransport="auto"), control_token=CONTROL_TOKEN) as d,
        httpx.AsyncClient(timeout=60) as client,
    ):
        single = await tokens(client, p.url, ids, max_tokens=16)
        split = await disaggregated(client, p.url, d.url, ids, max_tokens=16)
        assert split == single and len(single) == 16
        info = (await client.get(d.url + "/server_info")).json()
        assert info["engine"]["kv_transfers"]["http"]["count"] == 1  # auto on the CPU: http
        exported = (await client.get(p.url + "/server_info")).json()["engine"]["kv_exports"]
        steps = exported["http"]["last_steps_ms"]
        assert exported["http"]["count"] == 1 and list(steps) == ["event_opened", "taken", "framed"], exported
        assert 0 <= steps["event_opened"] <= steps["taken"] <= steps["framed"], steps
        again = await client.post(
            d.url + COMPLETIONS,
            json=completion_body(
                ids,
                disaggregated_params={
                    "request_type": "generation_only",
                    "ctx_request_id": 1,
                    "ctx_info_endpoint": p.url,
                },
            ),
        )
        assert again.status_code == 404  # fetched once, then gone


async def test_a_later_turn_reuses_the_prefix_kv_and_decodes_the_same_tokens() -> None:
    first = prompt_ids(200)
    later = first + prompt_ids(70, offset=30000)
    async with (
        start_engine(torch_config(tokensPerBlock=32), control_token=CONTROL_TOKEN) as cached,
        start_engine(torch_config(cacheCapacityTokens=0), control_token=CONTROL_TOKEN) as uncached,
        httpx.AsyncClient(timeout=60) as client,
    ):
        await tokens(client, cached.url, first)
        response = await client.post(cached.url + COMPLETIONS, json=completion_body(later))
        usage = response.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 192  # 6 full blocks of the first turn
        assert response.json()["choices"][0]["token_ids"] == await tokens(client, uncached.url, later)
        metrics = (await client.get(cached.url + "/metrics")).text
        assert "192.0" in next(line for line in metrics.splitlines() if line.startswith("drs_engine_prefix_cache_hit"))


async def test_concurrent_requests_share_decode_steps_and_keep_their_tokens() -> None:
    prompts = [prompt_ids(60 + 10 * i, offset=2000 + i) for i in range(4)]
    async with (
        start_engine(torch_config(), control_token=CONTROL_TOKEN) as e,
        httpx.AsyncClient(timeout=60) as client,
    ):
        alone = [await tokens(client, e.url, ids, max_tokens=20) for ids in prompts]
        together = await asyncio.gather(*(tokens(client, e.url, ids, max_tokens=20) for ids in prompts))
        assert list(together) == alone
        batching = (await client.get(e.url + "/server_info")).json()["engine"]["decode_batching"]
        assert batching["tokens"] > batching["steps"]  # some steps carried several requests


async def test_streaming_logprobs_and_chat() -> None:
    async with (
        start_engine(torch_config(), control_token=CONTROL_TOKEN) as e,
        httpx.AsyncClient(timeout=60) as client,
    ):
        body = completion_body(prompt_ids(30), max_tokens=6, logprobs=2, stream=True)
        chunks = []
        async with client.stream("POST", e.url + COMPLETIONS, json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        streamed = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
        assert streamed == await tokens(client, e.url, prompt_ids(30), max_tokens=6)
        lp = chunks[0]["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] <= 0 and len(lp["top_logprobs"][0]) == 2
        chat = await client.post(
            e.url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
        )
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 1


async def test_load_from_safetensors_serves_those_weights_and_sleep_wake_keeps_them(tmp_path: Path) -> None:
    import torch
    from drs_engine.backends.torch.model import SIZES, random_state_dict
    from safetensors.torch import save_file

    save_file(
        random_state_dict(SIZES["tiny"], seed=5, device="cpu", dtype=torch.float32), str(tmp_path / "w.safetensors")
    )
    ids = prompt_ids(50)
    async with (
        start_engine(torch_config(), control_token=CONTROL_TOKEN) as e,
        start_engine(torch_config(model="random:tiny@5"), control_token=CONTROL_TOKEN) as five,
        httpx.AsyncClient(timeout=60) as client,
    ):
        before = await tokens(client, e.url, ids)
        load = await client.post(
            e.url + "/control/weights/load", headers=auth(), json={"path": str(tmp_path), "version": "v5"}
        )
        assert load.status_code == 200, load.text
        after = await tokens(client, e.url, ids)
        assert after != before and after == await tokens(client, five.url, ids)
        bad = await client.post(
            e.url + "/control/weights/load", headers=auth(), json={"path": str(tmp_path / "no"), "version": "x"}
        )
        assert bad.status_code == 400 and "does not exist" in bad.text
        assert (await client.post(e.url + "/control/memory/release", headers=auth(), json={})).status_code == 200
        assert (await client.post(e.url + COMPLETIONS, json=completion_body(ids))).status_code == 503
        assert (await client.post(e.url + "/control/memory/resume", headers=auth(), json={})).status_code == 200
        assert await tokens(client, e.url, ids) == after


def test_a_wider_torch_engine_is_refused_with_the_reason() -> None:
    from drs_engine.config import build_config
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="tensorParallelSize: the torch backend runs one GPU per engine"):
        build_config({"backend": "torch", "model": {"path": "random:tiny"}, "tensorParallelSize": 2})


async def test_a_gloo_collective_refit_through_the_sidecar_serves_the_trainers_weights(tmp_path: Path) -> None:
    import uvicorn
    from drs_sidecar.app import build_app
    from drs_sidecar.control import ControlClient
    from drs_sidecar.fleet import StaticFleet
    from drs_sidecar.metrics import SidecarMetrics
    from drs_sidecar.refit import Refitter

    ids = prompt_ids(40)
    async with (
        start_engine(torch_config("prefill"), control_token=CONTROL_TOKEN) as a,
        start_engine(torch_config("decode"), control_token=CONTROL_TOKEN) as b,
        httpx.AsyncClient(timeout=120) as client,
    ):
        before = await tokens(client, a.url, ids)
        refitter = Refitter(
            StaticFleet([a.url, b.url]), ControlClient(CONTROL_TOKEN, call_s=30, load_s=120), SidecarMetrics()
        )
        server = uvicorn.Server(uvicorn.Config(build_app(refitter, reconcile_s=3600), port=0, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        async with asyncio.timeout(30):
            while not server.started:
                await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        trainer = await asyncio.create_subprocess_exec(
            sys.executable,
            str(ROOT / "examples/trainer/trainer.py"),
            "--sidecar",
            f"http://127.0.0.1:{port}",
            "--model",
            "random:tiny",
            "--seed",
            "9",
            "--precision",
            "float32",
            "--device",
            "cpu",
            "--backend",
            "gloo",
            "--target-bytes",
            str(1 << 20),
            "--save",
            str(tmp_path / "step-9"),
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(trainer.communicate(), 120)
        server.should_exit = True
        await serving
        assert trainer.returncode == 0
        report = json.loads(out.decode().strip().splitlines()[-1])
        assert report["world_size"] == 3 and report["engines_ok"] == 2 and report["buckets"] > 1
        refit = await tokens(client, a.url, ids)
        assert refit != before and refit == await tokens(client, b.url, ids)
        for engine in (a, b):  # each measured its own bytes: the trainer's digest over what it sent
            held = (await client.get(engine.url + "/control/weights", headers=auth())).json()
            assert held["weights_digest"] == report["digest"]
        # under the refit's own version: the collective refit announced step-9 as the fleet's target
        # (drs_protocol.cutover), so a load naming another version would leave the engine refusing legs
        load = await client.post(
            b.url + "/control/weights/load",
            headers=auth(),
            json={"path": str(tmp_path / "step-9"), "version": "step-9"},
        )
        assert load.status_code == 200 and await tokens(client, b.url, ids) == refit
        assert load.json()["weights_digest"] == report["digest"], "the same bytes from the checkpoint"


def test_the_handoff_arena_hands_out_disjoint_regions_and_merges_freed_ones() -> None:
    from drs_engine.backends.torch.kv.arena import REGION_ALIGN, KvArena

    unit = REGION_ALIGN
    arena = KvArena("cpu", 10 * unit)
    assert [arena.alloc(1), arena.alloc(3 * unit), arena.alloc(unit + 1)] == [0, unit, 4 * unit]
    assert arena.alloc(7 * unit) is None  # 4 units are free
    arena.free(unit)
    assert arena.alloc(4 * unit) == 6 * unit and arena.alloc(3 * unit) == unit  # first fit
    for offset in (0, unit, 4 * unit, 6 * unit):
        arena.free(offset)
    assert arena.regions == 0 and arena.alloc(10 * unit) == 0  # the freed runs merged back into one


@pytest.mark.gpu(1)
def test_a_taken_arena_region_is_reused_only_once_the_copy_out_of_it_is_done() -> None:
    import torch
    from drs_engine.backends.torch.kv.arena import REGION_ALIGN, KvArena

    unit = REGION_ALIGN
    arena = KvArena(torch.device("cuda:0"), 3 * unit)
    assert [arena.alloc(unit) for _ in range(3)] == [0, unit, 2 * unit]
    copying = torch.cuda.Stream()
    with torch.cuda.stream(copying):
        torch.cuda._sleep(200_000_000)  # a copy out of region 0 still running (~0.1 s of GPU cycles)
        done = torch.cuda.Event(interprocess=True)
        done.record(copying)
    arena.free_after(0, done)
    arena.free(2 * unit)
    assert arena.alloc(unit) == 2 * unit and not done.query()  # a free region first, no wait
    assert arena.alloc(unit) == 0 and done.query()  # region 0 only once its copy has completed
    arena.free_after(unit, done)
    arena.free(0)
    arena.free(2 * unit)
    assert arena.regions == 1 and arena.release() and arena.regions == 0  # sleep drains it too


async def test_a_copy_event_off_the_arena_take_or_a_digest_flag_not_a_bool_is_refused_by_name() -> None:
    ids = prompt_ids(40)
    async with (
        start_engine(torch_config("prefill"), control_token=CONTROL_TOKEN) as p,
        httpx.AsyncClient(timeout=60) as client,
    ):
        ctx = await client.post(
            p.url + COMPLETIONS, json=completion_body(ids, disaggregated_params={"request_type": "context_only"})
        )
        assert ctx.status_code == 200, ctx.text
        ctx_id = ctx.json()["choices"][0]["disaggregated_params"]["ctx_request_id"]
        url = p.url + kv_export_path(ctx_id)
        refused = await client.get(url, params={"transport": "http", KV_COPY_EVENT_PARAM: "AAAA"})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == KV_COPY_EVENT_PARAM, refused.text
        not_bool = await client.get(url, params={"transport": "http", KV_PROMPT_DIGEST_PARAM: "maybe"})
        assert not_bool.status_code == 400, not_bool.text
        assert not_bool.json()["error"]["param"] == KV_PROMPT_DIGEST_PARAM, not_bool.text
        assert (await client.get(url, params={"transport": "http"})).status_code == 200  # still there


async def test_a_kv_frame_names_the_prompt_by_its_digest_where_asked_and_a_wrong_prompt_is_refused() -> None:
    """The decode engine asks for the prompt's digest (it has the ids in its own leg); a frame not
    asked so carries the ids and no digest key (what a decode engine from before the digest reads)."""
    from drs_engine.backends.handoff import prompt_digest
    from drs_engine.backends.torch.handoff.frame import HEADER_LEN
    from drs_protocol.token_ids import decode_token_ids_b64

    ids, other = prompt_ids(40), prompt_ids(41)[1:]
    context_only = {"request_type": "context_only"}
    async with (
        start_engine(torch_config("prefill"), control_token=CONTROL_TOKEN) as p,
        start_engine(torch_config("decode", kvTransport="http"), control_token=CONTROL_TOKEN) as d,
        httpx.AsyncClient(timeout=60) as client,
    ):

        async def header(**params: str) -> dict[str, Any]:
            ctx = await client.post(p.url + COMPLETIONS, json=completion_body(ids, disaggregated_params=context_only))
            assert ctx.status_code == 200, ctx.text
            ctx_id = ctx.json()["choices"][0]["disaggregated_params"]["ctx_request_id"]
            frame = await client.get(p.url + kv_export_path(ctx_id), params={"transport": "http", **params})
            assert frame.status_code == 200, frame.text
            (size,) = HEADER_LEN.unpack_from(frame.content)
            return dict(json.loads(frame.content[HEADER_LEN.size : HEADER_LEN.size + size]))

        plain, digested = await header(), await header(**{KV_PROMPT_DIGEST_PARAM: "1"})
        assert decode_token_ids_b64(plain["prompt_token_ids_b64"]) == ids and "prompt_digest" not in plain
        assert digested["prompt_digest"] == prompt_digest(ids) != prompt_digest(other)
        assert digested["prompt_token_ids_b64"] == ""

        ctx = await client.post(p.url + COMPLETIONS, json=completion_body(ids, disaggregated_params=context_only))
        dp = ctx.json()["choices"][0]["disaggregated_params"]
        wrong = await client.post(
            d.url + COMPLETIONS,
            json=completion_body(other, disaggregated_params={**dp, "request_type": "generation_only"}),
        )
        assert wrong.status_code == 400, wrong.text
        assert wrong.json()["error"]["param"] == "prompt_token_ids", wrong.text
        assert "different prompt" in wrong.json()["error"]["message"], wrong.text


def test_a_kv_header_from_a_newer_prefill_engine_reads_and_a_malformed_one_is_refused() -> None:
    from drs_engine.backends.torch.handoff.frame import HEADER_LEN, KvHeader
    from drs_engine.errors import KvTransferError

    header = KvHeader(7, "", 3, -0.5, [[3, -0.5]], "v1", 0, "cuda_ipc_arena", [2, 2, 1, 4, 8], "float32", 0, {}, "ab")
    raw = json.loads(header.encode()[HEADER_LEN.size :])
    assert KvHeader.decode(json.dumps({**raw, "from_a_later_version": 1}).encode()) == header
    with pytest.raises(KvTransferError, match="malformed KV frame header"):
        KvHeader.decode(json.dumps({k: v for k, v in raw.items() if k != "first_token"}).encode())
    with pytest.raises(KvTransferError, match="malformed KV frame header"):
        KvHeader.decode(b"[1, 2]")


def test_ignore_eos_bans_nothing_and_eos_is_banned_only_before_min_tokens() -> None:
    """TensorRT-LLM's ``ignore_eos``: EOS may be picked (it only does not end the leg); ids outside a
    random model's tokenizer stay banned, EOS among them allowed."""
    from drs_engine.backends.torch.sampling import BanMasks

    masks = BanMasks(10, vocab_limit=8, eos_token_id=9, device="cpu")
    after = masks.mask(produced=3, min_tokens=2).tolist()
    before = masks.mask(produced=1, min_tokens=2).tolist()
    assert after == [False] * 8 + [True, False]
    assert before == [False] * 8 + [True, True]


async def test_float32_greedy_equals_transformers_generate_token_for_token(tmp_path: Path) -> None:
    """A transformers checkpoint served by the engine decodes exactly transformers' greedy tokens
    (float32; EOS not stopping either side). ``test_gpu.py`` repeats it on a GPU at the 0.6B shape."""
    model = save_random_hf_qwen3("tiny", tmp_path)
    async with (
        start_engine(torch_config(model=str(tmp_path)), control_token=CONTROL_TOKEN) as e,
        httpx.AsyncClient(timeout=60) as client,
    ):
        for n in (16, 70):
            ids = prompt_ids(n)
            assert await tokens(client, e.url, ids, max_tokens=24) == transformers_greedy(model, ids, 24, "cpu")


def test_a_batched_decode_step_equals_each_sequence_stepped_alone() -> None:
    """Sequences of different lengths in one step (packed K/V, attention masked per sequence) give
    each sequence's logits and KV as a step of its own would."""
    import torch
    from drs_engine.backends.torch.model import SIZES, decode_step, new_kv, prefill, random_state_dict

    shape = SIZES["tiny"]
    params = random_state_dict(shape, seed=3, device="cpu", dtype=torch.float32)
    prompts = [prompt_ids(n, offset=100 * n) for n in (5, 33, 17)]
    alone: list[Any] = []  # KV tensors
    together: list[Any] = []
    for ids in prompts:
        for out in (alone, together):
            kv = new_kv(shape, 40, device="cpu", dtype=torch.float32)
            prefill(params, shape, ids, kv, 0)
            out.append(kv)
    singles = [decode_step(params, shape, [7], [kv], [len(ids)])[0] for kv, ids in zip(alone, prompts, strict=True)]
    batched = decode_step(params, shape, [7, 7, 7], together, [len(ids) for ids in prompts])
    for j, ids in enumerate(prompts):
        assert torch.allclose(batched[j], singles[j], atol=1e-5)
        assert torch.allclose(together[j][:, :, :, : len(ids) + 1], alone[j][:, :, :, : len(ids) + 1], atol=1e-6)
