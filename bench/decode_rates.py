"""Decode rates for ``bench/gpu_disagg.py``: ours over HTTP streams, and the same-run anchors.

- :func:`engine_streams`: ``n`` concurrent streaming requests (512-token prompts, ``NEW_TOKENS``
  each) to one engine; a round gives the aggregate decode tokens/s (tokens after each stream's
  first, over the span from the first stream's first token to the last stream's last), the median
  per-stream rate and the median TTFT. ``arrival_s`` spreads the requests' start uniformly at
  random over that many seconds (continuous batching: requests join and leave a running batch);
  such a round also gives the rate while every stream runs (``all_running_tok_s``: the tokens that
  arrived between the last stream's first token and the first stream's last, over that window), since
  the whole span's rate is bounded by the arrival window itself when streams are short.
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
from typing import Any, NamedTuple

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


class Stream(NamedTuple):
    """One streaming request's timings (``perf_counter`` clock): when it was sent, its first and last
    token's arrival, its token count (``tokens``), and every chunk's (arrival, tokens)."""

    sent: float
    first: float
    last: float
    tokens: int
    chunks: list[tuple[float, int]]


async def _timed_stream(
    client: httpx.AsyncClient, url: str, ids: list[int], delay: float, new_tokens: int = NEW_TOKENS
) -> Stream:
    await asyncio.sleep(delay)
    payload = {
        "model": "m",
        "prompt_token_ids_b64": encode_token_ids_b64(ids),
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.perf_counter()
    chunks: list[tuple[float, int]] = []
    async with client.stream("POST", url + COMPLETIONS, json=payload) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if got := event_tokens(url, line):
                chunks.append((time.perf_counter(), got))
    first, last = (chunks[0][0], chunks[-1][0]) if chunks else (0.0, 0.0)
    return Stream(sent, first, last, sum(n for _, n in chunks), chunks)


class Round(NamedTuple):
    """One round's figures: decode tokens/s over the whole span, the median stream's rate, the
    median TTFT (s), the rate while every stream ran with that window's length (s; both ``None``
    when no moment had them all running), and the spread of the streams' sends (s)."""

    aggregate: float
    per_stream: float
    ttft: float
    all_running: float | None
    all_running_s: float | None
    sent_spread_s: float


def round_figures(runs: list[Stream]) -> Round:
    """A round's figures from its streams (pure: tested on made-up timings)."""
    tokens = sum(r.tokens - 1 for r in runs)
    span = max(r.last for r in runs) - min(r.first for r in runs)
    per_stream = statistics.median((r.tokens - 1) / (r.last - r.first) for r in runs if r.last > r.first)
    ttft = statistics.median(r.first - r.sent for r in runs)
    # every stream running: after the last one's first token, up to the first one's last token
    start, end = max(r.first for r in runs), min(r.last for r in runs)
    sent_spread = max(r.sent for r in runs) - min(r.sent for r in runs)
    if end <= start:
        return Round(tokens / span, per_stream, ttft, None, None, sent_spread)
    inside = sum(n for r in runs for at, n in r.chunks if start < at <= end)
    return Round(tokens / span, per_stream, ttft, inside / (end - start), end - start, sent_spread)


def span_at_pace(streams: int, new_tokens: int, sent_spread_s: float, per_stream_tok_s: float) -> float:
    """What a round's whole-span rate (:func:`round_figures`' ``aggregate``) reads when its
    ``streams`` streams of ``new_tokens`` are sent over ``sent_spread_s`` and each has its first
    token the moment it is sent, then ``per_stream_tok_s``: the span is the sends' spread plus one
    stream's decode. At a fewer-stream run's per-stream pace it is the whole span of an engine
    whose step costs no more with more streams running (the last streams, sent while the others
    run, are the ones that end the span)."""
    decode = new_tokens - 1
    return streams * decode / (sent_spread_s + decode / per_stream_tok_s)


async def _streams_round(
    client: httpx.AsyncClient, url: str, streams: int, salt: int, arrival_s: float, new_tokens: int
) -> Round:
    rng = random.Random(salt)
    delays = [rng.uniform(0, arrival_s) if arrival_s else 0.0 for _ in range(streams)]
    runs = await asyncio.gather(
        *(
            _timed_stream(client, url, prompt(PROMPT_TOKENS, salt * 1000 + i), d, new_tokens)
            for i, d in enumerate(delays)
        )
    )
    return round_figures(list(runs))


async def engine_streams(
    client: httpx.AsyncClient,
    url: str,
    streams: int,
    *,
    salt: int,
    arrival_s: float = 0.0,
    rounds: int = ROUNDS,
    new_tokens: int = NEW_TOKENS,
) -> dict[str, Any]:
    """Our engine's decode rate with ``streams`` concurrent requests (a warm-up round first)."""
    await _streams_round(client, url, streams, salt, arrival_s, new_tokens)
    results = [await _streams_round(client, url, streams, salt + 1 + r, arrival_s, new_tokens) for r in range(rounds)]
    out: dict[str, Any] = {
        "aggregate_tok_s": spread([r.aggregate for r in results]),
        "per_stream_tok_s": spread([r.per_stream for r in results]),
        "ttft_ms": spread([1000 * r.ttft for r in results]),
    }
    if new_tokens != NEW_TOKENS:
        out["new_tokens"] = new_tokens
    if arrival_s:
        out["streams"] = streams
        out["arrival_s"] = arrival_s
        running = [r for r in results if r.all_running is not None]
        out["all_running_tok_s"] = spread([r.all_running or 0.0 for r in running]) if running else None
        out["all_running_s"] = spread([r.all_running_s or 0.0 for r in running], 2) if running else None
        out["sent_spread_s"] = spread([r.sent_spread_s for r in results], 2)
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
