"""The announced target weights: an engine that does not hold them admits no new leg.

A refit is a sequence of loads, one engine after the other; without a gate, a turn that starts
while it runs is answered at the old weights by an engine not loaded yet (an off-policy turn). So
the sidecar *announces* the target (``POST /control/weights/target``,
:class:`drs_protocol.control.WeightsTarget`) to every engine before it loads any, and
:meth:`TargetGate.check` refuses each new leg with 503 ``weights_pending``
(:class:`~drs_engine.errors.WeightsPendingError`) while the engine holds other weights; the
frontend moves the leg to an engine that holds them, or holds it until one does. Legs already
running are not touched: a load re-prefills them under the new weights (``weights_boundary``).

Invariants:

* the engine *holds* the target when the versions are equal and, where both sides know a digest,
  the digests are equal (the digest is the engine's own measurement, never what it was told);
* a target binds for ``lease_s`` seconds after its last announce, then lapses as if withdrawn:
  a sidecar that died between its announce and its loads never leaves an engine refusing for good
  (the sidecar renews the lease while its loads run and on every reconcile pass while an engine
  is behind);
* an announce replaces the previous target (the newest announce wins; ``version`` None withdraws).

Pure apart from the clock (a test can give its own): no I/O, no lock (the announce does not wait
behind a load in the control lock, which is the point: it comes first).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from drs_protocol.control import TargetState, WeightsTarget

from drs_engine.errors import WeightsPendingError


@dataclass(frozen=True, slots=True)
class Target:
    version: str
    digest: str | None
    expires_at: float  #: on the gate's clock


def holds(target: Target, version: str, digest: str | None) -> bool:
    """Whether weights ``version`` with ``digest`` are ``target`` (by digest where both know one)."""
    if version != target.version:
        return False
    return target.digest is None or digest is None or digest == target.digest


class TargetGate:
    """One engine's announced target (none at start: an engine admits every leg until told)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._target: Target | None = None

    def announce(self, request: WeightsTarget) -> None:
        if request.version is None:
            self._target = None
            return
        self._target = Target(request.version, request.digest, self._clock() + request.lease_s)

    def current(self) -> Target | None:
        """The target while its lease runs (a lapsed one is dropped)."""
        target = self._target
        if target is not None and target.expires_at <= self._clock():
            self._target = target = None
        return target

    def state(self, version: str, digest: str | None) -> TargetState | None:
        """The target as ``GET /control/weights`` shows it (None: no target binds)."""
        target = self.current()
        if target is None:
            return None
        return TargetState(
            version=target.version,
            digest=target.digest,
            held=holds(target, version, digest),
            expires_in_s=round(max(0.0, target.expires_at - self._clock()), 3),
        )

    def check(self, version: str, digest: str | None) -> None:
        """Admit a new leg, or :class:`WeightsPendingError` while a target binds that the engine's
        weights (``version``, ``digest``) are not."""
        target = self.current()
        if target is None or holds(target, version, digest):
            return
        left = target.expires_at - self._clock()
        raise WeightsPendingError(
            f"this engine holds weights {version} and the fleet's target is {target.version}: it takes new legs "
            f"once it holds them (or in {left:.1f}s at most, when the target lapses); send this leg to another engine",
            retry_after_s=max(1, min(math.ceil(left), 60)),
        )
