"""bfloat16 agreement "up to near-ties": two kernels that order their sums differently give logits
a few hundredths apart, so a greedy stream may take the other token where the reference's top two
were that close, and from there on the two streams continue different texts. The check: each
stream equals the reference's up to its first difference, and there the reference's top two
log-probabilities were within :data:`NEAR_TIE` of each other; and up to it, the chosen tokens'
log-probabilities agree within :data:`LOGPROB_TOLERANCE` (random weights' distributions are flat,
near-ties everywhere, so the token check alone would pass a broken kernel; its log-probabilities
would not)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from .conftest import COMPLETIONS, completion_body

#: the largest top-1 minus top-2 log-probability gap a bfloat16 kernel change may flip (nats): the
#: bench's bf16 logits of two attention kernels differ by up to ~0.19 (``bench/decode_step.py``),
#: a gap twice that
NEAR_TIE = 0.4
#: the largest difference of a chosen token's log-probability between the two, before they differ
LOGPROB_TOLERANCE = 0.25


async def greedy_with_gaps(
    client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int
) -> tuple[list[int], list[float], list[float]]:
    """The greedy tokens, per step the top-1 minus top-2 log-probability, and the chosen tokens'
    log-probabilities."""
    body = completion_body(ids, max_tokens=max_tokens, logprobs=2)
    response = await client.post(url + COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    gaps = []
    for top in choice["logprobs"]["top_logprobs"]:
        values = sorted(top.values(), reverse=True)
        gaps.append(values[0] - values[1] if len(values) > 1 else float("inf"))
    return list(choice["token_ids"]), gaps, [float(v) for v in choice["logprobs"]["token_logprobs"]]


Answer = tuple[list[int], list[float], list[float]]


async def alone_and_together(
    client: httpx.AsyncClient, reference: str, other: str, prompts: list[list[int]], max_tokens: int = 48
) -> tuple[list[Answer], list[Answer], list[Answer]]:
    """:func:`greedy_with_gaps` of every prompt: from ``reference`` one at a time, from ``other`` one
    at a time and then all at once."""
    expected = [await greedy_with_gaps(client, reference, ids, max_tokens) for ids in prompts]
    alone = [await greedy_with_gaps(client, other, ids, max_tokens) for ids in prompts]
    together = list(await asyncio.gather(*(greedy_with_gaps(client, other, ids, max_tokens) for ids in prompts)))
    return expected, alone, together


def assert_same_or_near_ties(precision: str, reference: list[Answer], *answers: list[Answer]) -> None:
    """float32: the same greedy tokens; bfloat16: :func:`assert_agree_up_to_near_ties`."""
    for got in answers:
        if precision == "float32":
            assert [g[0] for g in got] == [r[0] for r in reference]
        else:
            assert_agree_up_to_near_ties(got, reference)


def first_differences(got: list[list[int]], expected: list[list[int]], gaps: list[list[float]]) -> list[Any]:
    """Per stream that differs: (stream, first differing step, the reference's gap there)."""
    out = []
    for s, (g, e) in enumerate(zip(got, expected, strict=True)):
        step = next((i for i, (a, b) in enumerate(zip(g, e, strict=True)) if a != b), None)
        if step is not None:
            out.append((s, step, round(gaps[s][step], 4)))
    return out


def assert_agree_up_to_near_ties(got: list[Answer], reference: list[Answer]) -> None:
    """Every difference starts at a near-tie of the reference (:data:`NEAR_TIE`), and the chosen
    tokens' log-probabilities agree before it (:data:`LOGPROB_TOLERANCE`)."""
    expected, gaps = [r[0] for r in reference], [r[1] for r in reference]
    diffs = first_differences([g[0] for g in got], expected, gaps)
    assert all(gap <= NEAR_TIE for _, _, gap in diffs), diffs
    upto = {s: step for s, step, _ in diffs}
    worst = max(
        abs(a - b)
        for s, (g, r) in enumerate(zip(got, reference, strict=True))
        for a, b in list(zip(g[2], r[2], strict=True))[: upto.get(s, len(r[2]))]
    )
    assert worst <= LOGPROB_TOLERANCE, (worst, diffs)
