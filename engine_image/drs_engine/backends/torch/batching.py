"""The ``torch`` backend's scheduling: decode steps batched across requests, on the GPU thread
(:class:`~drs_engine.backends.torch.worker.GpuWorker`).

:class:`DecodeBatcher` keeps the sequences that are decoding and runs
one step for all of them at a time (up to ``max_batch``): a request that arrives mid-way joins
the next step, and one that finishes (or whose client leaves) drops out before the next. A
sequence that leaves is handed to the next step's job as *leaving* (the step gives its decode
pool slot back, its KV copied out: :class:`~drs_engine.backends.torch.decoder.BatchDecoder`),
and its ``released`` event is set once that job ran, so the engine caches its KV only after.
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
    #: ``kv`` is a slot of the decode pool (set on the GPU thread)
    pooled: bool = False
    #: set once the sequence left the batcher and gave its slot back (``kv`` its own again)
    released: asyncio.Event = field(default_factory=asyncio.Event)


#: (batch, leaving) → logits ``[len(batch), vocab]``; the batcher's view of the model
StepFn = Callable[[list[DecodeSeq], list[DecodeSeq]], Any]


class DecodeBatcher:
    """Runs decode steps for every active sequence, batched, on the GPU worker."""

    def __init__(self, worker: GpuWorker, step: StepFn, *, max_batch: int) -> None:
        self._worker = worker
        self._step = step
        self.max_batch = max_batch
        self._active: list[DecodeSeq] = []
        self._leaving: list[DecodeSeq] = []
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.tokens = 0

    @property
    def active(self) -> int:
        return len(self._active)

    def add(self, seq: DecodeSeq) -> None:
        self._active.append(seq)
        self._kick()

    def remove(self, seq: DecodeSeq) -> None:
        """``seq`` steps no more; the next step's job releases it (``seq.released``)."""
        with contextlib.suppress(ValueError):
            self._active.remove(seq)
            self._leaving.append(seq)
            self._kick()

    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="drs-decode-batcher")

    def fail_all(self, exc: BaseException) -> None:
        for seq in self._active:
            seq.queue.put_nowait(exc)
        for seq in self._active + self._leaving:
            seq.released.set()
        self._active.clear()
        self._leaving.clear()

    async def _loop(self) -> None:
        try:
            await self._steps()
        except BaseException as exc:  # never leave a waiter hanging on a dead loop
            self.fail_all(exc if isinstance(exc, Exception) else RuntimeError("decode loop cancelled"))
            raise

    async def _steps(self) -> None:
        while self._active or self._leaving:
            batch = self._active[: self.max_batch]
            leaving, self._leaving = self._leaving, []
            try:
                choices = await self._worker.run(self._run_step, batch, leaving)
            except Exception as exc:
                for seq in batch:
                    self.remove(seq)
                    seq.queue.put_nowait(exc)
                continue
            finally:
                for seq in leaving:
                    seq.released.set()
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

    def _run_step(self, batch: list[DecodeSeq], leaving: list[DecodeSeq]) -> list[Choice]:
        logits = self._step(batch, leaving)
        if not batch:
            return []
        banned = [s.banned(len(s.generated)) for s in batch]
        choices: list[Choice] = choose_tokens(logits, [s.sampling for s in batch], banned)
        return choices
