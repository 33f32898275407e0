"""Decode rates for ``bench/gpu_disagg.py``: ours over HTTP streams, and the same-run anchors.

- :func:`engine_streams`: ``n`` concurrent streaming requests (512-token prompts, ``NEW_TOKENS``
  each) to one engine; a round gives the aggregate decode tokens/s (tokens after each stream's
  first, over the span from the first stream's first token to the last stream's last), the median
  per-stream rate and the median TTFT. ``arrival_s`` spreads the requests' start uniformly at
  random over that many seconds (continuous batching: requests join and leave a running batch).
- :func:`transformers_anchor`: transformers' ``generate`` with a static cache (compiled by
  transformers itself on CUDA) on the same weights (``random:0.6b``'s seeded tensors loaded
  into ``Qwen3ForCausalLM``), at the same stream counts: decode tokens/s =
  ``streams * (NEW_TOKENS - 1) / (t(NEW_TOKENS) - t(1))``, the prefill timed apart.
- :func:`memory_floor`: the memory-bound limit of one stream: every decode step reads every
  weight once, so a step takes at least weight bytes / the measured device-copy rate.

Every figure is the median of ``ROUNDS`` rounds after a warm-up round, with its min and max.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx
import torch
from drs_protocol import routes
from drs_protocol.token_ids import encode_token_ids_b64

PROMPT_TOKENS = 512
NEW_TOKENS = 128
ROUNDS = 3
COMPLETIONS = routes.Endpoint.COMPLETIONS


def prompt(n: int, salt: int) -> list[int]:
    return [1000 + (i * 7919 + salt * 104729) % 140000 for i in range(n)]


class StreamError(RuntimeError):
    """An engine's error event in a completion stream: which engine, the error's type and message."""


def event_tokens(url: str, line: str) -> int:
    """How many token ids one SSE line of ``url``'s completion stream carries (0: not a data chunk,
    or a chunk without ids). An error event (``{"error": {...}}``, no ``choices``) raises
    :class:`StreamError` naming the engine, the error's type and its message."""
    if not line.startswith("data: {"):
        return 0
    event = json.loads(line[6:])
    if "choices" not in event:
        error = event.get("error")
        if isinstance(error, dict):
            raise StreamError(f"{url}: {error.get('type', 'error')}: {error.get('message', '')}"[:600])
        raise StreamError(f"{url}: an event without choices: {line[:600]}")
    return len(event["choices"][0].get("token_ids") or [])


def spread(values: list[float], digits: int = 1) -> dict[str, float]:
    """Median, min and max of ``values`` (the rounds of one figure)."""
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


async def _timed_stream(
    client: httpx.AsyncClient, url: str, ids: list[int], delay: float
) -> tuple[float, float, float, int]:
    """(sent, first token, last token, tokens) of one streaming request, ``perf_counter`` clock."""
    await asyncio.sleep(delay)
    payload = {
        "model": "m",
        "prompt_token_ids_b64": encode_token_ids_b64(ids),
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.perf_counter()
    first = last = 0.0
    count = 0
    async with client.stream("POST", url + COMPLETIONS, json=payload) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if got := event_tokens(url, line):
                last = time.perf_counter()
                first = first or last
                count += got
    return sent, first, last, count


async def _streams_round(
    client: httpx.AsyncClient, url: str, streams: int, salt: int, arrival_s: float
) -> tuple[float, float, float]:
    rng = random.Random(salt)
    delays = [rng.uniform(0, arrival_s) if arrival_s else 0.0 for _ in range(streams)]
    runs = await asyncio.gather(
        *(_timed_stream(client, url, prompt(PROMPT_TOKENS, salt * 1000 + i), d) for i, d in enumerate(delays))
    )
    tokens = sum(c - 1 for _, _, _, c in runs)
    span = max(last for _, _, last, _ in runs) - min(first for _, first, _, _ in runs)
    per_stream = statistics.median((c - 1) / (last - first) for _, first, last, c in runs if last > first)
    ttft = statistics.median(first - sent for sent, first, _, _ in runs)
    return tokens / span, per_stream, ttft


async def engine_streams(
    client: httpx.AsyncClient, url: str, streams: int, *, salt: int, arrival_s: float = 0.0, rounds: int = ROUNDS
) -> dict[str, Any]:
    """Our engine's decode rate with ``streams`` concurrent requests (a warm-up round first)."""
    await _streams_round(client, url, streams, salt, arrival_s)
    results = [await _streams_round(client, url, streams, salt + 1 + r, arrival_s) for r in range(rounds)]
    out: dict[str, Any] = {
        "aggregate_tok_s": spread([a for a, _, _ in results]),
        "per_stream_tok_s": spread([p for _, p, _ in results]),
        "ttft_ms": spread([1000 * t for _, _, t in results]),
    }
    if arrival_s:
        out["arrival_s"] = arrival_s
    return out


def _seconds(fn: Callable[[], Any]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def transformers_anchor(
    model_name: str, streams: tuple[int, ...], *, seed: int = 0, rounds: int = ROUNDS, device: str = "cuda:0"
) -> dict[str, Any]:
    """transformers' ``generate`` with a static cache on ``random:<size>@seed``'s weights (bf16)."""
    import transformers
    from drs_engine.backends.torch.model import SIZES, random_state_dict

    shape = SIZES[model_name.removeprefix("random:")]
    hf = {k: v for k, v in shape.to_hf_config().items() if k not in ("architectures", "model_type")}
    params = random_state_dict(shape, seed=seed, device=device, dtype=torch.bfloat16)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**hf))
    model = model.to(torch.bfloat16).eval()
    model.load_state_dict(params)
    del params
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out: dict[str, Any] = {"transformers": transformers.__version__, "cache": "static (compiled by transformers)"}
    for n in streams:
        ids = torch.tensor([prompt(PROMPT_TOKENS, 7000 + 100 * n + i) for i in range(n)], device=device)

        def generate(new: int, ids: Any = ids) -> None:
            with torch.no_grad():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new,
                    do_sample=False,
                    cache_implementation="static",
                )

        started = time.perf_counter()
        generate(NEW_TOKENS)  # compiles the decode step for this batch size
        generate(1)
        warm_s = time.perf_counter() - started
        full = [_seconds(lambda: generate(NEW_TOKENS)) for _ in range(rounds)]
        prefill = [_seconds(lambda: generate(1)) for _ in range(rounds)]
        rates = [n * (NEW_TOKENS - 1) / (f - statistics.median(prefill)) for f in full]
        out[str(n)] = {"tok_s": spread(rates), "warm_up_s": round(warm_s, 1)}
    return out


def memory_floor(weight_bytes: int, copy_gbps: float) -> dict[str, Any]:
    """One stream's memory-bound limit: a step reads every weight once, at best at the device-copy rate."""
    step_s = weight_bytes / (copy_gbps * 1e9)
    return {
        "weight_bytes": weight_bytes,
        "copy_gbps": copy_gbps,
        "ms_per_step": round(1000 * step_s, 3),
        "tok_s": round(1 / step_s, 1),
    }
