"""The ``torch`` backend's scheduling: decode steps batched across requests, on the GPU thread
(:class:`~drs_engine.backends.torch.worker.GpuWorker`).

:class:`DecodeBatcher` keeps the sequences that are decoding and runs
one step for all of them at a time (up to ``max_batch``): a request that arrives mid-way joins
the next step, and one that finishes (or whose client leaves) drops out before the next. A
sequence that leaves is handed to the next step's job as *leaving* (the step gives its decode
pool slot back, its KV copied out: :class:`~drs_engine.backends.torch.decoder.BatchDecoder`),
and its ``released`` event is set once that job ran, so the engine caches its KV only after.
Choosing the token is :func:`~drs_engine.backends.torch.sampling.choose_tokens`.

With ``steps_per_job`` above 1 (``decodeStepsPerJob``, 8 by default; 1.15-1.27x the decode
tokens/s of one step a job on an H100, docs/results.md)
one job runs up to that many steps in a row on the GPU thread (:meth:`DecodeBatcher._run_steps`):
each step's tokens are applied to its sequences there and handed to the event loop as the step
ends (``call_soon_threadsafe``, in order), and the run ends after the step in which a sequence
finished, a sequence joined or left (``_changed``, set on the loop), or another job (a prefill, a
load) was submitted to the GPU thread (:attr:`GpuWorker.waiting`). The event loop's round trip
between two steps is then off the decode's path while nothing changes.

:class:`PrefillQueue` does the same for prompts: the prompts that arrive while the GPU thread is
busy (a decode step, another prefill) wait together and go to it as one job, up to a token budget
(the padded tokens of one batched forward pass), so 32 prompts sent at once prefill in a few
batched passes between decode steps rather than one after another.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from drs_engine.backends.torch.sampling import Choice, Sampling, choose_tokens
from drs_engine.backends.torch.worker import GpuWorker

J = TypeVar("J")
R = TypeVar("R")


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
    #: among the batcher's active sequences (False once removed: a step's token is not delivered)
    stepping: bool = False


#: (batch, leaving) → logits ``[len(batch), vocab]``; the batcher's view of the model
StepFn = Callable[[list[DecodeSeq], list[DecodeSeq]], Any]


class DecodeBatcher:
    """Runs decode steps for every active sequence, batched, on the GPU worker."""

    def __init__(self, worker: GpuWorker, step: StepFn, *, max_batch: int, steps_per_job: int = 1) -> None:
        self._worker = worker
        self._step = step
        self.max_batch = max_batch
        self.steps_per_job = steps_per_job
        self._active: list[DecodeSeq] = []
        self._leaving: list[DecodeSeq] = []
        self._task: asyncio.Task[None] | None = None
        #: a sequence joined or left since the running job's batch was taken (ends a run of steps)
        self._changed = False
        self.jobs = 0  #: GPU-thread jobs that ran steps (``steps`` over ``jobs``: steps a run)
        self.steps = 0
        self.tokens = 0

    @property
    def active(self) -> int:
        return len(self._active)

    def add(self, seq: DecodeSeq) -> None:
        seq.stepping = True
        self._active.append(seq)
        self._changed = True
        self._kick()

    def remove(self, seq: DecodeSeq) -> None:
        """``seq`` steps no more; the next step's job releases it (``seq.released``)."""
        with contextlib.suppress(ValueError):
            self._active.remove(seq)
            seq.stepping = False
            self._leaving.append(seq)
            self._changed = True
            self._kick()

    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="drs-decode-batcher")

    def fail_all(self, exc: BaseException) -> None:
        for seq in self._active:
            seq.stepping = False
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
        if self.steps_per_job > 1:
            return await self._runs()
        while self._active or self._leaving:
            batch = self._active[: self.max_batch]
            leaving, self._leaving = self._leaving, []
            choices = await self._job(self._run_step, batch, leaving)
            if choices is None:
                continue
            self.jobs += 1
            self.steps += 1
            self.tokens += len(batch)
            for seq, choice in zip(batch, choices, strict=True):
                if not seq.stepping:
                    continue  # removed (client gone) while the step ran
                seq.length += 1
                seq.next_token = choice.token_id
                seq.generated.append(choice.token_id)
                seq.queue.put_nowait(choice)
                seq.finish = seq.check(seq.generated)
                if seq.finish[0] is not None:
                    self.remove(seq)
                    seq.queue.put_nowait(None)

    async def _runs(self) -> None:
        """:meth:`_steps` with up to ``steps_per_job`` steps a job (:meth:`_run_steps`)."""
        loop = asyncio.get_running_loop()
        while self._active or self._leaving:
            batch = self._active[: self.max_batch]
            leaving, self._leaving = self._leaving, []
            self._changed = False
            await self._job(self._run_steps, batch, leaving, loop)

    async def _job(
        self, fn: Callable[..., R], batch: list[DecodeSeq], leaving: list[DecodeSeq], *args: Any
    ) -> R | None:
        """``fn(batch, leaving, *args)`` on the GPU thread; the sequences that were leaving are
        released either way. On failure every sequence of ``batch`` leaves with the exception (None)."""
        try:
            return await self._worker.run(fn, batch, leaving, *args)
        except Exception as exc:
            for seq in batch:
                self.remove(seq)
                seq.queue.put_nowait(exc)
            return None
        finally:
            for seq in leaving:
                seq.released.set()

    def _run_steps(self, batch: list[DecodeSeq], leaving: list[DecodeSeq], loop: asyncio.AbstractEventLoop) -> None:
        """On the GPU thread: steps of ``batch`` until one of them finishes a sequence, the batch
        changed, another job waits, or ``steps_per_job`` ran; each step's tokens applied here and
        handed to the loop (:meth:`_deliver`) as it ends."""
        self.jobs += 1
        for n in range(self.steps_per_job):
            choices = self._run_step(batch, leaving if n == 0 else [])
            self.steps += 1
            self.tokens += len(batch)
            finished = False
            for seq, choice in zip(batch, choices, strict=True):
                seq.length += 1
                seq.next_token = choice.token_id
                seq.generated.append(choice.token_id)
                seq.finish = seq.check(seq.generated)
                finished = finished or seq.finish[0] is not None
                loop.call_soon_threadsafe(self._deliver, seq, choice, seq.finish)
            if not batch or finished or self._changed or self._worker.waiting:
                return

    def _deliver(self, seq: DecodeSeq, choice: Choice, finish: tuple[str | None, int | str | None]) -> None:
        """On the loop: a token of :meth:`_run_steps` to its stream (nothing once it left). ``finish``
        is the sequence's state after this token's step: by the time the loop runs this, the GPU
        thread may have run further steps (``seq.finish`` is theirs)."""
        if not seq.stepping:
            return
        seq.queue.put_nowait(choice)
        if finish[0] is not None:
            self.remove(seq)
            seq.queue.put_nowait(None)

    def _run_step(self, batch: list[DecodeSeq], leaving: list[DecodeSeq]) -> list[Choice]:
        logits = self._step(batch, leaving)
        if not batch:
            return []
        banned = [s.banned(len(s.generated)) for s in batch]
        choices: list[Choice] = choose_tokens(logits, [s.sampling for s in batch], banned)
        return choices


@dataclass(eq=False)
class _Pending(Generic[J, R]):
    job: J
    tokens: int
    done: asyncio.Future[R]


def take_within(tokens: list[int], budget: int) -> int:
    """How many of the waiting jobs (``tokens``: each one's prompt tokens, in arrival order) go
    into one batched pass: the longest prefix whose padded size (count x longest) stays within
    ``budget``, and at least one (a prompt longer than the budget runs alone)."""
    longest = 0
    for count, n in enumerate(tokens):
        longest = max(longest, n)
        if count and (count + 1) * longest > budget:
            return count
    return len(tokens)


class PrefillQueue(Generic[J, R]):
    """Prefill jobs batched on the GPU worker: :meth:`submit` waits for its job's result; jobs that
    arrive while one batch runs (or waits for the GPU thread) form the next, up to ``budget``
    padded tokens (:func:`take_within`). ``run_many`` runs on the GPU thread and gives each job its
    result or its exception (one job's failure fails only that job). A result nobody takes (its
    client left) goes to ``discard`` (its hold on the device let go)."""

    def __init__(
        self,
        worker: GpuWorker,
        run_many: Callable[[list[J]], list[R | Exception]],
        *,
        budget: int,
        tokens: Callable[[J], int],
        discard: Callable[[R], None] = lambda result: None,
    ) -> None:
        self._worker = worker
        self._discard = discard
        self._run_many = run_many
        self.budget = budget
        self._tokens = tokens
        self._waiting: list[_Pending[J, R]] = []
        self._task: asyncio.Task[None] | None = None
        self.batches = 0
        self.prompts = 0

    async def submit(self, job: J) -> R:
        done: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Pending(job, self._tokens(job), done))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name="drs-prefill-batcher")
        try:
            return await done
        except asyncio.CancelledError:
            if done.done() and not done.cancelled() and done.exception() is None:
                self._discard(done.result())  # set, but this waiter was cancelled before taking it
            raise

    async def _drain(self) -> None:
        while self._waiting:
            count = take_within([p.tokens for p in self._waiting], self.budget)
            batch, self._waiting = self._waiting[:count], self._waiting[count:]
            batch = [p for p in batch if not p.done.done()]  # a client that left before its turn
            if not batch:
                continue
            results: list[R | Exception]
            try:
                results = await self._worker.run(self._run_many, [p.job for p in batch])
            except Exception as exc:
                results = [exc] * len(batch)
            except BaseException:
                for p in batch + self._waiting:
                    p.done.cancel()
                self._waiting.clear()
                raise
            self.batches += 1
            self.prompts += len(batch)
            for p, result in zip(batch, results, strict=True):
                if p.done.done():
                    if not isinstance(result, Exception):
                        self._discard(result)
                    continue
                if isinstance(result, Exception):
                    p.done.set_exception(result)
                else:
                    p.done.set_result(result)
