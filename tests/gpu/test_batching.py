"""Prompts that arrive together prefill as one batch, and a stream that falls behind catches up in
one chunk; on the CPU, with a real (tiny) model and a real engine.

- :func:`~drs_engine.backends.torch.batching.take_within` (how many waiting prompts one batched
  pass takes) is pure, so hypothesis drives it against its rule;
- :func:`~drs_engine.backends.torch.model.prefill_batch` (prompts of different lengths, right-
  padded, one causal pass) gives each prompt the logits and K/V of its own prefill, in float32;
- an engine sent prompts at once prefills some of them together and answers each with the tokens
  it gives that prompt alone;
- :class:`~drs_engine.server.readahead.ReadAhead` hands a stream every event that arrived, in order,
  an error after the tokens before it;
- ``bench/decode_rates.event_tokens`` names an engine's error event instead of failing on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import httpx
import pytest
from drs_engine.backends.base import LegEvent, LegFinished, TokenStep
from drs_engine.server.runner import start_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import CONTROL_TOKEN, prompt_ids, torch_config
from .test_torch_engine import tokens


@settings(deadline=None)  # the first example pays for importing torch
@given(tokens=st.lists(st.integers(1, 5000), min_size=1, max_size=40), budget=st.integers(1, 20_000))
def test_a_batched_prefill_takes_the_longest_run_of_waiting_prompts_within_the_token_budget(
    tokens: list[int], budget: int
) -> None:
    from drs_engine.backends.torch.batching import take_within

    count = take_within(tokens, budget)
    assert 1 <= count <= len(tokens)
    assert count == 1 or count * max(tokens[:count]) <= budget  # padded to the longest
    if count < len(tokens):  # one more would not fit
        assert (count + 1) * max(tokens[: count + 1]) > budget


def test_prompts_prefilled_in_one_batch_get_the_logits_and_kv_of_each_alone() -> None:
    import torch
    from drs_engine.backends.torch.model import SIZES, new_kv, prefill, prefill_batch, random_state_dict

    shape = SIZES["tiny"]
    params = random_state_dict(shape, seed=3, device="cpu", dtype=torch.float32)
    prompts = [prompt_ids(n, offset=30 * n) for n in (7, 40, 1, 23)]
    alone = [new_kv(shape, 48, device="cpu", dtype=torch.float32) for _ in prompts]
    together = [new_kv(shape, 48, device="cpu", dtype=torch.float32) for _ in prompts]
    expected = torch.stack([prefill(params, shape, ids, kv, 0) for ids, kv in zip(prompts, alone, strict=True)])
    logits = prefill_batch(params, shape, prompts, together)
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    for ids, a, b in zip(prompts, alone, together, strict=True):
        torch.testing.assert_close(b[:, :, :, : len(ids)], a[:, :, :, : len(ids)], rtol=1e-4, atol=1e-4)


async def test_prompts_sent_together_prefill_in_batches_and_keep_their_tokens() -> None:
    prompts = [prompt_ids(20 + 13 * i, offset=3000 + 7 * i) for i in range(8)]
    async with (
        start_engine(torch_config(cacheCapacityTokens=0), control_token=CONTROL_TOKEN) as e,
        httpx.AsyncClient(timeout=60) as client,
    ):
        alone = [await tokens(client, e.url, ids, max_tokens=6) for ids in prompts]
        before = (await client.get(e.url + "/server_info")).json()["engine"]["prefill_batching"]
        assert before["prompts"] == before["batches"] == len(prompts)  # one at a time: alone
        together = await asyncio.gather(*(tokens(client, e.url, ids, max_tokens=6) for ids in prompts))
        assert list(together) == alone
        after = (await client.get(e.url + "/server_info")).json()["engine"]["prefill_batching"]
        assert after["prompts"] - before["prompts"] == len(prompts)
        assert after["batches"] - before["batches"] < len(prompts)  # some prompts shared a pass


async def _events(
    items: list[LegEvent | Exception], gate: asyncio.Event, reached: asyncio.Event
) -> AsyncGenerator[LegEvent, None]:
    for i, item in enumerate(items):
        if i == 2:  # the first two arrive before the stream asks; the rest once the gate opens
            reached.set()
            await gate.wait()
        if isinstance(item, Exception):
            raise item
        yield item


async def test_a_stream_takes_every_event_that_arrived_in_one_run_and_an_error_after_the_tokens_before_it() -> None:
    from drs_engine.server.readahead import ReadAhead

    done = LegFinished(finish_reason="length", prompt_tokens=3, cached_tokens=0, prefix_query_tokens=0)
    gate, reached = asyncio.Event(), asyncio.Event()
    ahead = ReadAhead(_events([TokenStep(5), TokenStep(6), TokenStep(7), done], gate, reached))
    await reached.wait()  # the reader queued two events and waits at the gate
    assert await ahead.next_run() == [TokenStep(5), TokenStep(6)]
    gate.set()
    rest = await ahead.next_run()
    rest += [] if isinstance(rest[-1], LegFinished) else await ahead.next_run()
    assert rest == [TokenStep(7), done]
    await ahead.close()

    gate = asyncio.Event()
    gate.set()
    failing = ReadAhead(_events([TokenStep(1), TokenStep(2), RuntimeError("decode step failed")], gate, reached))
    got: list[LegEvent] = []
    with pytest.raises(RuntimeError, match="decode step failed"):
        while True:
            got += await failing.next_run()
    assert got == [TokenStep(1), TokenStep(2)]  # the tokens before the error, then the error
    await failing.close()


def test_the_bench_names_an_engines_error_event_instead_of_failing_on_it() -> None:
    import json

    from drs_engine.errors import EngineError

    from bench.decode_rates import StreamError, event_tokens

    chunk = {"choices": [{"index": 0, "text": "", "token_ids": [4, 5]}]}
    assert event_tokens("http://d", "data: " + json.dumps(chunk)) == 2
    assert event_tokens("http://d", "data: [DONE]") == 0
    body = EngineError("decode step failed: OutOfMemoryError: CUDA out of memory").to_body()
    with pytest.raises(StreamError, match=r"http://d: .*decode step failed: OutOfMemoryError"):
        event_tokens("http://d", "data: " + json.dumps(body))
