"""Runs of decode steps on the GPU thread (``decodeStepsPerJob`` > 1): the same tokens as one step
a job, streamed as each step ends; a run ends where the batch changes, a sequence finishes or
another job waits. On the CPU, with a real (tiny) model and real engines, in float32 (greedy
tokens are exact to compare); and on a CUDA GPU, through the pool's CUDA graphs."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from drs_engine.backends.torch.batching import DecodeBatcher, DecodeSeq
from drs_engine.backends.torch.sampling import Choice, Sampling
from drs_engine.backends.torch.worker import GpuWorker
from drs_engine.server.runner import RunningEngine, start_engine

from .conftest import COMPLETIONS, CONTROL_TOKEN, auth, completion_body, prompt_ids, torch_backend, torch_config
from .test_prefix_refit import GATE_S, _jobs_queued, _worker
from .test_torch_engine import tokens

RUN = 8
#: Seconds a stream that left may take to be released by the engine (it is at the next step).
LEAVE_S = 30.0


async def _batching(client: httpx.AsyncClient, url: str) -> dict[str, int]:
    return dict((await client.get(url + "/server_info")).json()["engine"]["decode_batching"])


def _batcher(engine: RunningEngine) -> DecodeBatcher:
    """``engine``'s decode batcher (its counters read from the test)."""
    return torch_backend(engine)._runner.batcher


async def test_runs_of_steps_give_the_tokens_of_one_step_a_job() -> None:
    prompts = [prompt_ids(20 + 9 * i, offset=4000 + 11 * i) for i in range(6)]
    lengths = [3, 17, 9, 30, 1, 24]  # sequences finish at different steps: each ends a run
    async with (
        start_engine(torch_config(decodeStepsPerJob=1), control_token=CONTROL_TOKEN) as one,
        start_engine(torch_config(decodeStepsPerJob=RUN), control_token=CONTROL_TOKEN) as runs,
        httpx.AsyncClient(timeout=120) as client,
    ):
        alone = [await tokens(client, one.url, ids, max_tokens=n) for ids, n in zip(prompts, lengths, strict=True)]
        before = await _batching(client, one.url)
        await tokens(client, one.url, prompts[3], max_tokens=lengths[3])
        one_step_a_job = await _batching(client, one.url)
        steps_alone = one_step_a_job["steps"] - before["steps"]
        single = await tokens(client, runs.url, prompts[3], max_tokens=lengths[3])
        after_single = await _batching(client, runs.url)
        together = await asyncio.gather(
            *(tokens(client, runs.url, ids, max_tokens=n) for ids, n in zip(prompts, lengths, strict=True))
        )
        batching = await _batching(client, runs.url)
    assert single == alone[3]
    assert list(together) == alone
    assert after_single["steps_per_job"] == RUN
    assert one_step_a_job["jobs"] == one_step_a_job["steps"]
    # one stream alone, nothing else submitted: the same steps as one a job, in runs of up to 8
    assert after_single["steps"] == steps_alone, (after_single, steps_alone)
    assert -(-steps_alone // RUN) <= after_single["jobs"] < steps_alone, after_single
    assert batching["tokens"] > batching["steps"]  # steps carried several sequences


async def test_tokens_delivered_after_the_run_went_on_each_carry_their_own_step() -> None:
    """The loop delivers a run's tokens after the GPU thread went on (held busy here until the run's
    last step finished the sequence): every token reaches the stream, and the stream ends after the
    last one, not at the first token delivered after the sequence finished. A step double (logits
    that pick ``length % 8``) stands in for the model: this is the batcher's own ordering."""
    loop = asyncio.get_running_loop()
    worker = GpuWorker(torch.device("cpu"))
    loop_held = threading.Event()
    no_ban = torch.zeros(8, dtype=torch.bool)

    def step(batch: list[DecodeSeq], _leaving: list[DecodeSeq]) -> Any:
        loop_held.wait(10)  # the run goes on only once the loop is busy
        return torch.nn.functional.one_hot(torch.tensor([s.length % 8 for s in batch]), 8).float()

    seq = DecodeSeq(
        kv=None,
        length=3,
        next_token=0,
        sampling=Sampling(temperature=0.0, top_p=1.0, top_k=0, logprobs=False, top_logprobs=0),
        generated=[],
        check=lambda generated: ("length", None) if len(generated) >= 5 else (None, None),
        banned=lambda _n: no_ban,
    )
    batcher = DecodeBatcher(worker, step, max_batch=4, steps_per_job=RUN)

    def hold_the_loop() -> None:  # a blocking callback: the loop does nothing else meanwhile
        loop_held.set()
        deadline = time.monotonic() + 10
        while seq.finish[0] is None and time.monotonic() < deadline:
            time.sleep(0.001)

    batcher.add(seq)
    loop.call_soon(hold_the_loop)  # runs once the batcher's task has handed the run to the thread
    got: list[int] = []
    async with asyncio.timeout(20):
        while (item := await seq.queue.get()) is not None:
            assert isinstance(item, Choice), item
            got.append(item.token_id)
    await asyncio.wait_for(seq.released.wait(), 10)
    assert got == [3, 4, 5, 6, 7], got  # each step's token, the last included
    assert batcher.tokens == 5  # five steps of the sequence (then a job that released it)


async def test_a_stream_that_leaves_mid_run_is_released_and_the_engine_serves_on() -> None:
    ids = prompt_ids(40, offset=9000)
    async with (
        start_engine(torch_config(decodeStepsPerJob=1), control_token=CONTROL_TOKEN) as one,
        start_engine(torch_config(decodeStepsPerJob=RUN), control_token=CONTROL_TOKEN) as runs,
        httpx.AsyncClient(timeout=120) as client,
    ):
        expected = await tokens(client, one.url, ids, max_tokens=12)
        body = completion_body(prompt_ids(50, offset=7000), max_tokens=2000, stream=True)
        seen = 0
        async with client.stream("POST", runs.url + COMPLETIONS, json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    seen += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                if seen >= 20:
                    break  # the client leaves: the connection closes with the stream
        deadline = time.monotonic() + LEAVE_S
        while (await _batching(client, runs.url))["active"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # polling the engine's own figure for the event
        left = await _batching(client, runs.url)
        again = await tokens(client, runs.url, ids, max_tokens=12)
    assert seen >= 20
    assert left["active"] == 0, left
    assert left["steps"] < 2000  # it stopped stepping the stream that left
    assert again == expected


async def test_a_refit_mid_run_waits_one_step_and_the_tokens_after_it_are_the_new_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load arrives while a run of steps decodes a long answer: the run ends after the step in
    flight (another job waits on the GPU thread), the swap runs, and every token after the answer's
    ``weights_boundary`` is what an engine at the new weights decodes after the tokens before it,
    which are the old weights' (float32: equal greedy tokens). The GPU thread is held by a gate of
    the test's own while the load is queued, so the swap lands mid-answer."""
    from drs_engine.backends.torch.model import SIZES, random_state_dict
    from safetensors.torch import save_file

    save_file(
        random_state_dict(SIZES["tiny"], seed=5, device="cpu", dtype=torch.float32), str(tmp_path / "w.safetensors")
    )
    ids = prompt_ids(30, offset=5200)
    total = 200
    async with (
        start_engine(torch_config(decodeStepsPerJob=RUN), control_token=CONTROL_TOKEN) as runs,
        start_engine(torch_config(decodeStepsPerJob=1), control_token=CONTROL_TOKEN) as old,
        start_engine(torch_config(model="random:tiny@5"), control_token=CONTROL_TOKEN) as five,
        httpx.AsyncClient(timeout=GATE_S) as client,
    ):
        worker = _worker(runs)
        batcher = _batcher(runs)
        queued = _jobs_queued(worker, monkeypatch)
        answer = asyncio.create_task(client.post(runs.url + COMPLETIONS, json=completion_body(ids, max_tokens=total)))
        async with asyncio.timeout(GATE_S):
            while batcher.tokens < RUN:  # the answer is decoding in runs
                await asyncio.sleep(0.005)
        gate = threading.Event()
        steps_at: list[int] = []

        def hold() -> None:  # the test's job on the GPU thread: where the steps stood when it started
            steps_at.append(batcher.steps)
            gate.wait(GATE_S)

        try:
            posted_at = batcher.steps
            worker.post(hold)
            load = asyncio.create_task(
                client.post(
                    runs.url + "/control/weights/load",
                    headers=auth(),
                    json={"path": str(tmp_path / "w.safetensors"), "version": "v5"},
                )
            )
            await queued("read_safetensors")
            gate.set()
            loaded = await load
            done = await answer
        finally:
            gate.set()
        assert loaded.status_code == 200, loaded.text
        assert done.status_code == 200, done.text
        body = done.json()
        got = list(body["choices"][0]["token_ids"])
        boundary = body["weights_boundary"]
        on_old = await tokens(client, old.url, ids, max_tokens=total)
        on_five_after = await tokens(client, five.url, ids + got[:boundary], max_tokens=total - boundary)
    assert steps_at and steps_at[0] - posted_at <= 1, (posted_at, steps_at)  # the run let the job in
    assert body["weights_version"] == "v5"
    assert RUN <= boundary < total, boundary
    assert len(got) == total
    assert got[:boundary] == on_old[:boundary]
    assert got[boundary:] == on_five_after
    assert got != on_old  # the two weights decode differently


@pytest.mark.gpu(1)
async def test_runs_of_steps_replay_the_graphs_and_give_the_tokens_of_one_step_a_job_on_the_gpu() -> None:
    """float32 on the GPU, the pool's CUDA graphs replayed: runs of up to 8 steps a job give the
    greedy tokens of one step a job, alone and eight at once, and fewer jobs than steps."""
    prompts = [prompt_ids(30 + 97 * i, offset=4000 + i) for i in range(8)]
    one_config = torch_config(model="random:small", device="cuda:0", decodeStepsPerJob=1)
    runs_config = torch_config(model="random:small", device="cuda:0", decodeStepsPerJob=RUN)
    async with (
        start_engine(one_config, control_token=CONTROL_TOKEN) as one,
        start_engine(runs_config, control_token=CONTROL_TOKEN) as runs,
        httpx.AsyncClient(timeout=120) as client,
    ):
        expected = [await tokens(client, one.url, ids, max_tokens=32) for ids in prompts]
        alone = [await tokens(client, runs.url, ids, max_tokens=32) for ids in prompts]
        together = await asyncio.gather(*(tokens(client, runs.url, ids, max_tokens=32) for ids in prompts))
        batching = await _batching(client, runs.url)
        pool = (await client.get(runs.url + "/server_info")).json()["engine"]["decode_batching"]["pool"]
    assert alone == expected
    assert list(together) == expected
    assert batching["steps_per_job"] == RUN and batching["jobs"] < batching["steps"], batching
    assert pool["cuda_graphs"] and pool["graphs_captured"] >= 3 and pool["eager_rows"] == 0, pool
