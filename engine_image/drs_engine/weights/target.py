"""The announced target weights and their cut-over: which new legs an engine admits.

A refit is a sequence of loads, one engine after the other; without a gate, a turn that starts
while it runs is answered at the old weights by an engine not loaded yet (an off-policy turn). So
the sidecar *announces* the target (``POST /control/weights/target``,
:class:`drs_protocol.control.WeightsTarget`) to every engine before it loads any, with the instant
the target takes effect, ``effective_at`` (:mod:`drs_protocol.cutover`: slightly in the future, no
load starts before it). Every leg carries the instant its turn started (the frontend's stamp, else
the engine's receipt time), and :meth:`TargetGate.admit` judges it by that:

* stamped at or after ``effective_at``, the engine not holding the target: 503 ``weights_pending``
  (:class:`~drs_engine.errors.WeightsPendingError`); the frontend moves the leg to an engine that
  holds them, or holds it until one does;
* stamped before ``effective_at``: served with what the engine holds; when that is already the
  target (the engine loaded it after the turn started), the answer is marked ``weights_boundary``
  (the turn straddled the refit), never silently at weights other than those desired at its stamp;
* a target without ``effective_at`` (an older sidecar) gates every new leg, as before.

Legs already running are not touched: a load re-prefills them under the new weights
(``weights_boundary``). An announce that arrives after its own cut-over is late: legs stamped at or
after it that this engine answered at other weights (:meth:`TargetGate.answered` keeps the last
:data:`RECENT_LEGS`) are counted (``late_legs``, ``drs_engine_late_target_legs_total``) and
logged, as is a leg that finishes at other weights while a target whose cut-over precedes its
stamp binds.

Invariants:

* the engine *holds* the target when the versions are equal and, where both sides know a digest,
  the digests are equal (the digest is the engine's own measurement, never what it was told);
* a target binds for ``lease_s`` seconds after its last announce, then lapses as if withdrawn:
  a sidecar that died between its announce and its loads never leaves an engine refusing for good;
* except on an engine that follows the stored desired weights (:mod:`.follow`, ``hold_lapsed_s``
  above 0): a target that lapsed before the engine held it keeps refusing the legs it refused
  until the stored desired weights decide (:meth:`TargetGate.settle_lapsed`: a file at least as
  new as the target, and then the engine catches up to them or holds them) or ``hold_lapsed_s``
  passes (the sidecar died before it stored them: the file never names them). Without this,
  the legs the frontends held for the target, and every new one, were answered at the previous
  weights from the lapse until the kubelet had updated the mounted file (8-14 s on the real node);
* an announce replaces the previous target (the newest announce wins; ``version`` None withdraws).

Pure apart from the clocks (a test can give its own): no I/O, no lock (the announce does not wait
behind a load in the control lock, which is the point: it comes first). ``clock`` (monotonic) times
the lease, ``wall`` (epoch seconds) compares stamps with cut-overs.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from drs_protocol.control import TargetState, WeightsTarget

from drs_engine.errors import WeightsPendingError

#: Answered legs remembered (stamp, version) for an announce that comes after its cut-over.
RECENT_LEGS: Final = 4096
#: How long a target that lapsed unreached keeps refusing on an engine that follows the stored
#: desired weights, at most: the kubelet updates a mounted ConfigMap within its sync period (one
#: minute by default) plus its cache's; after that the target was never stored (the sidecar died
#: between its announce and its store) and the engine serves what it holds.
HOLD_LAPSED_S: Final = 90.0


@dataclass(frozen=True, slots=True)
class Target:
    version: str
    digest: str | None
    expires_at: float  #: on the gate's clock
    effective_at: float | None = None  #: the cut-over, wall clock (None: every new leg)
    #: the engine held other weights when it was first told: a leg stamped before the cut-over and
    #: served at the target straddles the refit
    new: bool = True


def holds(target: Target, version: str, digest: str | None) -> bool:
    """Whether weights ``version`` with ``digest`` are ``target`` (by digest where both know one)."""
    if version != target.version:
        return False
    return target.digest is None or digest is None or digest == target.digest


class TargetGate:
    """One engine's announced target (none at start: an engine admits every leg until told)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        *,
        hold_lapsed_s: float = 0.0,
    ) -> None:
        self._clock = clock
        self.wall = wall
        self._target: Target | None = None
        #: seconds a target that lapsed unreached keeps refusing (0: it lapses at once, as withdrawn)
        self.hold_lapsed_s = hold_lapsed_s
        #: the target that lapsed last, and since when (gate clock), until the desired weights settle it
        self._lapsed: tuple[Target, float] | None = None
        #: (stamp, version, digest) of the last answered legs not marked ``weights_boundary``
        self._recent: collections.deque[tuple[float, str, str | None]] = collections.deque(maxlen=RECENT_LEGS)
        #: the last target whose late announce was judged against the recent legs
        self._judged: tuple[str, str | None, float | None] | None = None

    def announce(self, request: WeightsTarget, version: str, digest: str | None) -> int:
        """Take ``request``; the engine holds ``version``/``digest``. Returns the legs already
        answered at other weights whose turns started at or after its cut-over (an announce that
        came late; 0 when on time)."""
        self._lapsed = None  # the sidecar speaks again: its word decides
        if request.version is None:
            self._target = None
            return 0
        before = self.current()
        same = before is not None and (before.version, before.digest) == (request.version, request.digest)
        target = Target(
            request.version,
            request.digest,
            self._clock() + request.lease_s,
            request.effective_at,
            new=before.new if same and before is not None else not self._holds_now(request, version, digest),
        )
        self._target = target
        cut = target.effective_at
        key = (target.version, target.digest, cut)
        if cut is None or cut > self.wall() or key == self._judged:
            return 0
        self._judged = key  # a renewal of the same target does not count them again
        return sum(1 for stamp, v, d in self._recent if stamp >= cut and not holds(target, v, d))

    @staticmethod
    def _holds_now(request: WeightsTarget, version: str, digest: str | None) -> bool:
        assert request.version is not None
        return holds(Target(request.version, request.digest, 0.0), version, digest)

    def current(self) -> Target | None:
        """The target while its lease runs (a lapsed one is dropped: see :meth:`lapsed`)."""
        target = self._target
        if target is not None and target.expires_at <= self._clock():
            self._target = None
            if self.hold_lapsed_s > 0:
                self._lapsed = (target, target.expires_at)
            target = None
        return target

    def lapsed(self) -> Target | None:
        """The target that lapsed within the last ``hold_lapsed_s`` and is not settled yet."""
        self.current()
        if self._lapsed is not None and self._clock() - self._lapsed[1] >= self.hold_lapsed_s:
            self._lapsed = None
        return None if self._lapsed is None else self._lapsed[0]

    def settle_lapsed(self, version: str, effective_at: float | None) -> bool:
        """The stored desired weights (``version``, cut-over ``effective_at``) as the engine reads
        them now: a lapsed target they are at least as new as stops refusing (they decide: the
        engine catches up to them, or holds them). True when one was settled."""
        target = self.lapsed()
        if target is None:
            return False
        newer = target.effective_at is None or (effective_at is not None and effective_at >= target.effective_at)
        if version == target.version or newer:
            self._lapsed = None
            return True
        return False

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
            effective_at=target.effective_at,
        )

    def admit(self, version: str, digest: str | None, stamp: float) -> bool:
        """Admit a new leg of a turn started at ``stamp`` (wall clock) on an engine holding weights
        ``version``/``digest``: True when its answer must be marked ``weights_boundary`` (stamped
        before the cut-over, served at the target); :class:`WeightsPendingError` when stamped at or
        after the cut-over (any leg, without one) and the engine does not hold the target."""
        target = self.current()
        if target is None:
            self._refuse_lapsed(version, digest, stamp)
            return False
        held = holds(target, version, digest)
        if target.effective_at is not None and stamp < target.effective_at:
            return held and target.new
        if held:
            return False
        left = target.expires_at - self._clock()
        raise WeightsPendingError(
            f"this engine holds weights {version} and the fleet's target is {target.version}: it takes new legs "
            f"once it holds them (or in {left:.1f}s at most, when the target lapses); send this leg to another engine",
            retry_after_s=max(1, min(math.ceil(left), 60)),
        )

    def _refuse_lapsed(self, version: str, digest: str | None, stamp: float) -> None:
        """:class:`WeightsPendingError` for a leg a lapsed, unsettled target would refuse."""
        target = self.lapsed()
        if target is None or (target.effective_at is not None and stamp < target.effective_at):
            return
        if holds(target, version, digest):
            self._lapsed = None
            return
        assert self._lapsed is not None
        left = self.hold_lapsed_s - (self._clock() - self._lapsed[1])
        raise WeightsPendingError(
            f"this engine holds weights {version}; the fleet's target {target.version} lapsed before it held them "
            f"and it waits for the stored desired weights to say whether they stand ({left:.1f}s at most); "
            "send this leg to another engine",
            retry_after_s=max(1, min(math.ceil(left), 60)),
        )

    def check(self, version: str, digest: str | None) -> None:
        """:meth:`admit` for a leg of a turn that starts now."""
        self.admit(version, digest, self.wall())

    def answered(self, stamp: float, version: str, digest: str | None) -> bool:
        """Record an answered leg (not marked ``weights_boundary``): True when it was answered at
        weights other than a binding target whose cut-over precedes ``stamp`` (a late announce:
        the leg was admitted before the engine was told)."""
        self._recent.append((stamp, version, digest))
        target = self.current()
        return (
            target is not None
            and target.effective_at is not None
            and stamp >= target.effective_at
            and not holds(target, version, digest)
        )
