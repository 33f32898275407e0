"""An engine that started under desired weights it does not hold: up, not ready, trying again.

:class:`CatchUp` runs the attempts (:func:`drs_engine.weights.desired.reach`: the checkpoint path,
or a serving peer) one after the other under the engine's control lock, so a control call never
interleaves with one. A failed attempt does not stop the engine: it stays up and not ready
(``/health`` and turns answer 503 ``weights_pending`` with the reason), ``GET /control/weights``
says what failed (:class:`drs_protocol.control.CatchUpStatus`), and the next attempt comes after a
back-off that starts at :data:`CATCH_UP_FIRST_RETRY_S` and doubles up to
:data:`CATCH_UP_MAX_RETRY_S` (a path that appears later, or a peer that comes up, is picked up
then). It ends when an attempt reaches the desired weights, or when a weights operation of the
control API (the sidecar's load or refit) succeeds: the sidecar's word is newer than what the pod
was started with (:meth:`CatchUp.superseded`). Each attempt presents the control token of its
moment (a :class:`~drs_protocol.token_source.TokenSource`, re-read from the mounted Secret), so a
catch-up that spans a token rotation is not refused by its peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from drs_protocol.control import CatchUpPhase, CatchUpStatus
from drs_protocol.token_source import TokenSource
from drs_protocol.weights_state import DesiredWeights

from drs_engine.backends.base import EngineBackend
from drs_engine.errors import EngineError
from drs_engine.weights import desired as desired_weights

log = logging.getLogger(__name__)

#: The wait after the first failed attempt.
CATCH_UP_FIRST_RETRY_S: Final = 1.0
#: The longest wait between two attempts.
CATCH_UP_MAX_RETRY_S: Final = 30.0
#: Each failure multiplies the wait by this (up to the longest).
CATCH_UP_BACKOFF: Final = 2.0
#: ``source`` of a catch-up from peers.
PEERS_SOURCE: Final = "peers"


class CatchUp:
    """The way of one engine to the desired weights it started under (see the module docstring)."""

    def __init__(
        self, desired: DesiredWeights, peers: Callable[[], Sequence[str]], token: str | TokenSource | None
    ) -> None:
        self.desired = desired
        #: the peers to ask, read again on every attempt (``drs_engine.weights.desired.Peers``)
        self.peers = peers
        self.tokens = TokenSource.of(token)
        self.attempts = 0
        self.last_error: str | None = None
        self.reached_from: str | None = None
        self._next_at: float | None = None
        #: set once the engine holds them (or was moved on): it may serve
        self.done = asyncio.Event()

    @property
    def pending(self) -> bool:
        return not self.done.is_set()

    @property
    def source(self) -> str:
        return self.desired.path if self.desired.path is not None else PEERS_SOURCE

    def status(self) -> CatchUpStatus:
        loop_time = asyncio.get_running_loop().time()
        next_s = None if self._next_at is None or not self.pending else round(max(0.0, self._next_at - loop_time), 3)
        return CatchUpStatus(
            phase=CatchUpPhase.PENDING if self.pending else CatchUpPhase.REACHED,
            desired_version=self.desired.version,
            desired_digest=self.desired.digest,
            source=self.source,
            attempts=self.attempts,
            last_error=self.last_error,
            next_attempt_s=next_s,
            reached_from=self.reached_from,
        )

    def reason(self) -> str:
        """Why the engine is not ready, in one sentence (``/health``'s 503)."""
        want = f"the fleet's desired weights {self.desired.version} (from {self.source})"
        if self.last_error is None:
            return f"the engine is loading {want} before it serves"
        return f"the engine does not hold {want} yet: attempt {self.attempts} failed: {self.last_error}"

    def superseded(self, version: str) -> None:
        """A weights operation of the control API succeeded: the engine serves what it was given."""
        self.end(f"control API ({version})")

    def end(self, why: str) -> None:
        """End a pending catch-up without reaching its weights (``why`` shows as ``reached_from``):
        newer word came (the control API's, or newer desired weights, :mod:`.follow`)."""
        if self.pending:
            log.info("catch-up to %s ends: %s", self.desired.version, why)
            self.reached_from = why
            self.done.set()

    async def run(
        self,
        backend: EngineBackend,
        lock: asyncio.Lock,
        on_attempt: Callable[[str | None, bool], Awaitable[None]],
    ) -> None:
        """Attempt until done. ``on_attempt(digest, reached)`` records the digest held after each
        attempt (None: measure it again, the attempt failed part way)."""
        delay = CATCH_UP_FIRST_RETRY_S
        loop = asyncio.get_running_loop()
        while self.pending:
            async with lock:
                if not self.pending:
                    return
                self.attempts += 1
                self._next_at = None
                try:
                    peers = () if self.desired.path is not None else self.peers()
                    digest, source = await desired_weights.reach(backend, self.desired, peers, self.tokens.current)
                except EngineError as exc:
                    self.last_error = exc.message
                    log.error(
                        "attempt %d to reach the desired weights %s failed: %s",
                        self.attempts,
                        self.desired.version,
                        exc.message,
                    )
                    await on_attempt(None, False)
                except Exception as exc:  # a bug or a backend's own error: the engine stays up all the same
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    log.exception(
                        "attempt %d to reach the desired weights %s failed", self.attempts, self.desired.version
                    )
                    await on_attempt(None, False)
                else:
                    self.reached_from = source
                    self.last_error = None
                    await on_attempt(digest, True)
                    self.done.set()
                    log.info("reached the desired weights %s from %s", self.desired.version, source)
                    return
            self._next_at = loop.time() + delay
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), delay)
            delay = min(delay * CATCH_UP_BACKOFF, CATCH_UP_MAX_RETRY_S)
