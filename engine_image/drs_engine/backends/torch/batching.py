"""The ``torch`` backend's scheduling: decode steps batched across requests, on the GPU thread
(:class:`~drs_engine.backends.torch.worker.GpuWorker`).

:class:`DecodeBatcher` keeps the sequences that are decoding and runs
one step for all of them at a time (up to ``max_batch``): a request that arrives mid-way joins
the next step, and one that finishes (or whose client leaves) drops out before the next.
Choosing the token is :func:`~drs_engine.backends.torch.sampling.choose_tokens`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from drs_engine.backends.torch.sampling import Choice, Sampling, choose_tokens
from drs_engine.backends.torch.worker import GpuWorker


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
