"""Refit safety on the ``trtllm`` backend: a leg decoding across a weights update is re-prefilled.

TensorRT-LLM applies a weights update between two executor steps (a control action) and lets the
requests in flight go on with the KV cache their old weights computed: every token after the
update would come from new weights over old KV, which neither set of weights would produce. The
engine's rule (:func:`drs_engine.backends.base.restate_after_refit`, as ``sim`` and ``torch`` do it)
is that the prompt plus the tokens generated so far are prefilled again under the new weights, and
the leg resumes from there, marked ``weights_boundary``.

:class:`WeightsSwitch` does the bookkeeping: every decoding leg registers its request
(:meth:`WeightsSwitch.track`); a weights update (:meth:`WeightsSwitch.update`) first marks every
registered leg stale and aborts its request (``GenerationResult.abort``: the executor frees its
slot and KV), then runs; no leg submits a request while one runs (:meth:`WeightsSwitch.ready`). A
stale leg drops whatever its old request still delivers (it may have been computed after the
update began), waits for the update to end (:meth:`WeightsSwitch.settled`) and submits a new
request over the prompt plus the tokens it has already passed on. An update that failed may have
changed part of the weights (TensorRT-LLM updates in place): the legs it interrupted end with
:class:`~drs_engine.errors.UnavailableError` naming it rather than decode on them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from drs_engine.errors import UnavailableError


@dataclass(slots=True)
class _Update:
    op: str
    error: str | None = None  #: why it failed (None: succeeded, or still running)


@dataclass(slots=True, eq=False)
class Running:
    """One decoding leg's request to TensorRT-LLM, as the switch sees it."""

    promise: Any  #: the ``GenerationResult`` of ``generate_async``
    #: the updates that began while it ran (non-empty: its output is stale, it must resubmit)
    updates: list[_Update] = field(default_factory=list)
    aborted: bool = False

    @property
    def stale(self) -> bool:
        return bool(self.updates)

    def abort(self) -> None:
        """Free the request's slot in the executor (once)."""
        if not self.aborted:
            self.aborted = True
            self.promise.abort()


class WeightsSwitch:
    """The decoding legs of one engine, and the weights updates that interrupt them."""

    def __init__(self) -> None:
        self._running: set[Running] = set()
        self._updating = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def ready(self) -> None:
        """Returns when no weights update runs (a request submitted now is prefilled under the
        weights the engine will hold once it is scheduled). Nothing awaits between this and the
        caller's submit, so no update can begin in between."""
        while self._updating:
            await self._idle.wait()

    def track(self, promise: Any) -> Running:
        running = Running(promise)
        self._running.add(running)
        return running

    def untrack(self, running: Running) -> None:
        self._running.discard(running)

    async def settled(self, running: Running) -> None:
        """Wait for the updates that interrupted ``running`` to end; :class:`UnavailableError`
        when one failed (its bytes may be part old, part new)."""
        await self.ready()
        failed = [u for u in running.updates if u.error is not None]
        if failed:
            raise UnavailableError(
                f"the weights changed under this leg and the update failed ({failed[-1].op}: {failed[-1].error}): "
                "the engine may hold part of it, so the leg is not continued"
            )

    @contextlib.asynccontextmanager
    async def update(self, op: str) -> AsyncIterator[None]:
        """Around a weights update (``op`` names it): every leg in flight is marked stale and its
        request aborted before the update begins; no new request is submitted until it ends."""
        update = _Update(op)
        self._updating += 1
        self._idle.clear()
        for running in list(self._running):
            running.updates.append(update)
            running.abort()
        try:
            yield
        except BaseException as exc:
            update.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._updating -= 1
            if not self._updating:
                self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._running)
