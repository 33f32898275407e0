"""The ``torch`` backend's scheduling: one GPU thread, and decode steps batched across requests.

All device work runs on one worker thread (:class:`GpuWorker`), so the event loop never blocks on
the GPU and jobs never race on the weights: prefills, decode steps, KV exports and weight loads
queue in submission order. :class:`DecodeBatcher` keeps the sequences that are decoding and runs
one step for all of them at a time (up to ``max_batch``): a request that arrives mid-way joins
the next step, and one that finishes (or whose client leaves) drops out before the next.
Choosing the token (greedy or sampled, with log-probabilities) is :func:`choose_tokens`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class GpuWorker:
    """A single thread that owns the device (its current device is set once)."""

    def __init__(self, device: Any) -> None:
        def init() -> None:
            if device.type == "cuda":
                torch.cuda.set_device(device)

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drs-gpu", initializer=init)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True, slots=True)
class Sampling:
    """How one request picks tokens: ``temperature`` 0 is greedy."""

    temperature: float
    top_p: float
    top_k: int
    logprobs: bool
    top_logprobs: int
    generator: Any = None


@dataclass(frozen=True, slots=True)
class Choice:
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def choose_tokens(logits: Any, samplings: list[Sampling], banned: list[Any]) -> list[Choice]:
    """One token per row of ``logits`` ``[batch, vocab]`` (float32); ``banned[b]``: a bool mask of
    ids row ``b`` may not pick (outside the tokenizer, or EOS before ``min_tokens``)."""
    with torch.inference_mode():
        return _choose(logits, samplings, banned)


def _choose(logits: Any, samplings: list[Sampling], banned: list[Any]) -> list[Choice]:
    masked = logits.masked_fill(torch.stack(banned), float("-inf"))
    want_lp = any(s.logprobs for s in samplings)
    logp = torch.log_softmax(masked, dim=-1) if want_lp else None
    greedy = masked.argmax(dim=-1)
    picked: list[Any] = []
    for b, s in enumerate(samplings):
        if s.temperature <= 0:
            picked.append(greedy[b])
        else:
            picked.append(_sample(masked[b], s))
    ids = torch.stack(picked)
    k = max((s.top_logprobs for s in samplings), default=0)
    chosen_lp = logp.gather(1, ids[:, None])[:, 0].tolist() if logp is not None else None
    top = torch.topk(logp, k, dim=-1) if logp is not None and k > 0 else None
    top_ids = top.indices.tolist() if top is not None else None
    top_vals = top.values.tolist() if top is not None else None
    out: list[Choice] = []
    for b, (token, s) in enumerate(zip(ids.tolist(), samplings, strict=True)):
        lp = float(chosen_lp[b]) if chosen_lp is not None and s.logprobs else None
        alts: tuple[tuple[int, float], ...] = ()
        if top_ids is not None and top_vals is not None and s.top_logprobs:
            alts = tuple((int(i), float(v)) for i, v in zip(top_ids[b][: s.top_logprobs], top_vals[b], strict=False))
        out.append(Choice(int(token), lp, alts))
    return out


def _sample(row: Any, s: Sampling) -> Any:
    scaled = row / s.temperature
    if s.top_k > 0:
        kth = torch.topk(scaled, min(s.top_k, scaled.shape[-1])).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < s.top_p
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p * keep)
    return torch.multinomial(probs, 1, generator=s.generator)[0]


@dataclass(eq=False)  # compared by identity (the batcher's list membership)
class DecodeSeq:
    """A sequence that is decoding: its KV, how much of it is computed, what it feeds next."""

    kv: Any
    length: int
    next_token: int
    sampling: Sampling
    generated: list[int]
    #: ``generated`` → ``(finish_reason, stop_reason)`` or ``(None, None)`` to go on
    check: Callable[[list[int]], tuple[str | None, int | str | None]]
    #: ``len(generated)`` → the banned-id mask for the next pick
    banned: Callable[[int], Any]
    #: the prompt (with ``generated`` minus its last token: the ids whose KV is in ``kv``)
    prompt: list[int] = field(default_factory=list)
    #: the weights generation the KV was computed with (-1: unknown, recompute before the next step)
    weights_gen: int = 0
    #: tokens generated before the last weights switch (refit safety), None: no switch
    boundary: int | None = None
    #: the KV capacity to grow to first (a received context arrives exactly its length)
    grow_to: int = 0
    queue: asyncio.Queue[Choice | BaseException | None] = field(default_factory=asyncio.Queue)
    finish: tuple[str | None, int | str | None] = (None, None)


#: (kvs, tokens, positions) → logits; the batcher's view of the model
StepFn = Callable[[list[Any], list[int], list[int]], Any]


class DecodeBatcher:
    """Runs decode steps for every active sequence, batched, on the GPU worker."""

    def __init__(
        self, worker: GpuWorker, step: StepFn, prepare: Callable[[DecodeSeq], None], *, max_batch: int
    ) -> None:
        self._worker = worker
        self._step = step
        self._prepare = prepare
        self.max_batch = max_batch
        self._active: list[DecodeSeq] = []
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.tokens = 0

    @property
    def active(self) -> int:
        return len(self._active)

    def add(self, seq: DecodeSeq) -> None:
        self._active.append(seq)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="drs-decode-batcher")

    def remove(self, seq: DecodeSeq) -> None:
        with contextlib.suppress(ValueError):
            self._active.remove(seq)

    def fail_all(self, exc: BaseException) -> None:
        for seq in self._active:
            seq.queue.put_nowait(exc)
        self._active.clear()

    async def _loop(self) -> None:
        try:
            await self._steps()
        except BaseException as exc:  # never leave a waiter hanging on a dead loop
            self.fail_all(exc if isinstance(exc, Exception) else RuntimeError("decode loop cancelled"))
            raise

    async def _steps(self) -> None:
        while self._active:
            batch = self._active[: self.max_batch]
            try:
                choices = await self._worker.run(self._run_step, batch)
            except Exception as exc:
                for seq in batch:
                    self.remove(seq)
                    seq.queue.put_nowait(exc)
                continue
            self.steps += 1
            self.tokens += len(batch)
            for seq, choice in zip(batch, choices, strict=True):
                if seq not in self._active:
                    continue  # removed (client gone) while the step ran
                seq.length += 1
                seq.next_token = choice.token_id
                seq.generated.append(choice.token_id)
                seq.queue.put_nowait(choice)
                seq.finish = seq.check(seq.generated)
                if seq.finish[0] is not None:
                    self.remove(seq)
                    seq.queue.put_nowait(None)

    def _run_step(self, batch: list[DecodeSeq]) -> list[Choice]:
        for seq in batch:  # room for one more token; KV recomputed if the weights changed
            self._prepare(seq)
        logits = self._step([s.kv for s in batch], [s.next_token for s in batch], [s.length for s in batch])
        banned = [s.banned(len(s.generated)) for s in batch]
        choices: list[Choice] = choose_tokens(logits, [s.sampling for s in batch], banned)
        return choices
