"""Announcing the target weights to every engine before any of them loads them.

A refit loads engines one after the other (at most ``concurrency`` at once); an engine not loaded
yet would answer new turns at the old weights. So before the first load the sidecar tells every
engine the target (``POST /control/weights/target``, :class:`drs_protocol.control.WeightsTarget`):
an engine holding other weights refuses new legs (503 ``weights_pending``) and the frontends send
them to engines that hold the target, or hold them until one does
(``drs_engine.weights.target``).

The announce is the first thing a refit does: :meth:`TargetAnnouncer.lease` sends it at once to
the engines the sidecar already knows (its last read of the fleet, every reconcile pass) while the
refit reads the fleet and stores the desired weights on the resource; :meth:`Lease.cover` then
waits for that round and announces to any engine the fresh read added, before any load. Each call
has its own timeout (:data:`ANNOUNCE_TIMEOUT_S`); an engine that does not take the announce is
logged and loaded all the same (it may answer turns at the old weights until its load: off-policy,
counted in ``drs_sidecar_engine_calls_total{op="announce_weights_target",result="failed"}``).

A target binds an engine for ``lease_s`` seconds after each announce (:data:`DEFAULT_LEASE_S`):
the lease is renewed every third of it while the refit's loads run, and on every reconcile pass
for each engine still behind. A sidecar that dies between its announce and its loads leaves the
engines refusing new legs for one lease at most; then they serve what they hold again, and
``WeightsPending`` (the operator's condition, observed from the engines) says which are behind.
A refit that reached no engine withdraws the target in favour of the previous desired weights
(or none), so the engines serve again at once.

With ``fold`` on (``drs sidecar --fold-announce``; off by default: on one 2-core machine with all
256 engines in one process it made the last engine's receipt later, see docs/results.md), a
checkpoint refit whose fleet fits one fan-out (no more ready engines than its concurrency)
sends no announce round at all: each load carries its target (:meth:`Lease.fold`,
:class:`drs_protocol.control.LoadAnnounce`), which the engine takes on arrival, before it reads
anything; one call per engine instead of two. A larger fleet is loaded in waves, and a load of a
later wave would arrive after the cut-over, so it is announced to first, as above.

The cut-over (:mod:`drs_protocol.cutover`): a target takes effect at ``effective_at``, picked by
:meth:`TargetAnnouncer.desired` as now plus a margin larger than the last refit's time until
every engine was told (``max(floor, 2 x that)``, at most
:data:`~drs_protocol.cutover.MAX_CUTOVER_MARGIN_S`; the announce round, or, for loads that carried
the target, the one-way time the engines measured: :meth:`Lease.told`),
sent with every announce and stored with the desired weights. :meth:`Lease.cut_over` waits for that
instant before a collective or CUDA IPC update (a checkpoint load is sent at once instead, carrying
``effective_at``: the engine swaps at that instant) and :meth:`Lease.outran` says whether the round outran it: an
engine told after its cut-over may have answered turns stamped after it at the old weights, which
it counts (``late_legs`` of its answer, summed in the report).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from drs_protocol.control import ControlAnswer, LoadAnnounce, TargetAnnounced, WeightsChanged, WeightsTarget
from drs_protocol.cutover import MIN_CUTOVER_MARGIN_S, cutover_margin, told_seconds
from drs_protocol.routes import ControlOp
from drs_protocol.weights_state import DesiredWeights

from drs_sidecar.control import CallResult, ControlClient, Encoded, encoded
from drs_sidecar.fleet import Engine
from drs_sidecar.metrics import SidecarMetrics
from drs_sidecar.report import Report

log = logging.getLogger(__name__)

#: Seconds for one announce call (it does no work on the engine: a slow answer is a sick engine).
ANNOUNCE_TIMEOUT_S: Final = 2.0
#: Seconds an announced target binds an engine after each announce (renewed while loads run).
DEFAULT_LEASE_S: Final = 30.0
OP: Final = ControlOp.ANNOUNCE_WEIGHTS_TARGET
#: A weights operation's target as the trainer gives it: (version, checkpoint path, digest).
Target = tuple[str, str | None, str | None]
#: Seconds a collective refit's announce call gets at least (it gets the cut-over margin, so that
#: a member that does not answer delays the broadcast by no more than the margin).
MIN_COLLECTIVE_ANNOUNCE_S: Final = 0.1


@dataclass(slots=True)
class Announced:
    """One round of announces: the engines that took it and those that did not (URL -> why)."""

    reached: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    slowest_s: float = 0.0  #: the longest call of the round, as the client timed it
    #: legs the engines had answered at other weights after the target's cut-over (a late announce)
    late_legs: int = 0


class TargetAnnouncer:
    """Sends targets; ``lease_s`` 0 turns announcing off (engines are never gated: the old rule)."""

    def __init__(
        self,
        control: ControlClient,
        metrics: SidecarMetrics,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        timeout_s: float = ANNOUNCE_TIMEOUT_S,
        margin_s: float = MIN_CUTOVER_MARGIN_S,
        fold: bool = False,
    ) -> None:
        self.control = control
        #: loads may carry the target (``--fold-announce``: :meth:`one_wave`)
        self.fold = fold
        self.metrics = metrics
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        #: the cut-over margin's floor (``--cutover-margin``)
        self.margin_s = margin_s
        #: the last refit's seconds until every engine had been told (its announce round, or the one-way
        #: delivery of loads that carried the announce): the next margin is twice it, when more than the floor
        self.last_told_s: float | None = None

    def desired(self, version: str, path: str | None, digest: str | None) -> tuple[DesiredWeights, float]:
        """A refit's desired weights with their cut-over (now plus the margin; None when
        announcing is off: desired at once), and the margin."""
        if not self.enabled:
            return DesiredWeights(version=version, path=path, digest=digest), 0.0
        margin = cutover_margin(self.margin_s, self.last_told_s)
        return DesiredWeights(version=version, path=path, digest=digest, effective_at=time.time() + margin), margin

    @property
    def enabled(self) -> bool:
        return self.lease_s > 0

    def one_wave(self, engines: Sequence[Engine], concurrency: int) -> bool:
        """Whether a refit's loads reach every ready engine of ``engines`` in one fan-out of
        ``concurrency``: then they carry the target themselves (:meth:`Lease.load_folded`; a load
        of a later wave would tell its engine after the cut-over). Only with :attr:`fold` on
        (``drs sidecar --fold-announce``), never with announcing off."""
        return self.fold and self.enabled and sum(1 for e in engines if e.ready and e.url) <= concurrency

    async def announce(
        self, urls: Iterable[str], target: DesiredWeights | None, *, timeout_s: float | None = None
    ) -> Announced:
        """``target`` (None: withdraw it) to every engine of ``urls`` at once, each call within
        ``timeout_s`` (default :attr:`timeout_s`)."""
        urls = list(dict.fromkeys(urls))
        done = Announced()
        if not self.enabled or not urls:
            return done
        body = encoded(  # one encoding for every engine
            WeightsTarget(
                version=None if target is None else target.version,
                digest=None if target is None else target.digest,
                lease_s=self.lease_s,
                effective_at=None if target is None else target.effective_at,
            )
        )
        timeout = self.timeout_s if timeout_s is None else timeout_s
        results = await asyncio.gather(*(self.control.op(u, OP, body, timeout=timeout) for u in urls))
        done.slowest_s = max(r.elapsed_s for r in results)
        for result in results:
            self.metrics.count_engine_call(OP.value, result.ok)
            if result.ok:
                done.reached.append(result.url)
                answer = result.answer
                if isinstance(answer, ControlAnswer) and isinstance(answer.result, TargetAnnounced):
                    done.late_legs += answer.result.late_legs
            else:
                done.failed[result.url] = (
                    result.detail if result.status is None else f"{result.status}: {result.detail}"
                )
                log.warning("target weights not announced to %s: %s", result.url, done.failed[result.url])
        return done

    @contextlib.asynccontextmanager
    async def lease(
        self,
        known: Sequence[Engine],
        target: DesiredWeights,
        fallback: DesiredWeights | None,
        *,
        timeout_s: float | None = None,
    ) -> AsyncIterator[Lease]:
        """Announce ``target`` to the ``known`` engines at once and renew it while the block runs
        (each call within ``timeout_s``, default :attr:`timeout_s`); a block that raises (the fleet
        unreadable, the desired weights not stored: no engine was loaded) announces ``fallback``
        instead, the weights desired before, so nothing waits."""
        lease = Lease(self, target, [e.url for e in known if e.url], timeout_s)
        try:
            yield lease
        except BaseException:
            await lease.stop()
            if not lease.covered:  # raised before the loads began: nothing holds the target
                await self.announce(lease.urls, fallback)
            raise
        finally:
            await lease.stop()


class Lease:
    """A target announced to a set of engines and renewed until :meth:`close`."""

    def __init__(
        self, announcer: TargetAnnouncer, target: DesiredWeights, urls: list[str], timeout_s: float | None = None
    ) -> None:
        self._announcer = announcer
        self._timeout_s = timeout_s
        self._target = target
        self._urls = dict.fromkeys(urls)
        self._started = time.perf_counter()
        self._first = asyncio.create_task(self._first_round(urls), name="announce-target")
        self._first_done = self._started
        self._stopped = asyncio.Event()
        self._renewal = asyncio.create_task(self._renew(), name="renew-target") if announcer.enabled else None
        #: Seconds from the lease's start until the last engine of the fleet read had been told
        #: (its answer came back; set by :meth:`cover`; None while not, or when announcing is off).
        self.announced_s: float | None = None
        self.covered = False
        #: the wall-clock instant the last engine had been told (set by :meth:`cover`)
        self.told_at: float | None = None
        #: legs the engines counted as answered at other weights after the cut-over (late announces)
        self.late_legs = 0

    async def _first_round(self, urls: list[str]) -> Announced:
        done = await self._announcer.announce(urls, self._target, timeout_s=self._timeout_s)
        self._first_done = time.perf_counter()
        return done

    @property
    def effective_at(self) -> float | None:
        return self._target.effective_at

    @property
    def target(self) -> DesiredWeights:
        return self._target

    @property
    def urls(self) -> list[str]:
        return list(self._urls)

    async def cover(self, engines: Sequence[Engine], *, again: bool = False) -> Announced:
        """Wait for the first round, then announce to every engine of ``engines`` (the fresh
        fleet read) it did not include, or to every engine when ``again`` (a reconcile pass ran
        meanwhile, whose announces of the previous target may have arrived after ours): after
        this, every one of them has been told."""
        done = await self._first
        self.covered = True
        extra = [e.url for e in engines if e.url and (again or e.url not in self._urls)]
        self._urls.update(dict.fromkeys(extra))
        told_at = self._first_done  # the known engines were told while the fleet was read
        if extra:
            more = await self._announcer.announce(extra, self._target, timeout_s=self._timeout_s)
            slowest = max(done.slowest_s, more.slowest_s)
            late = done.late_legs + more.late_legs
            done = Announced([*done.reached, *more.reached], {**done.failed, **more.failed}, slowest, late)
            told_at = time.perf_counter()
        self.late_legs += done.late_legs
        if self._announcer.enabled:
            self.announced_s = told_at - self._started
            self.told_at = time.time() - (time.perf_counter() - told_at)
            self._announcer.last_told_s = self.announced_s
            log.info(
                "target weights %s announced to %d engine(s) in %.3fs, slowest call %.3fs (%d failed; %d known "
                "before, %d after the read)",
                self._target.version,
                len(done.reached),
                self.announced_s,
                done.slowest_s,
                len(done.failed),
                len(self._urls) - len(extra),
                len(extra),
            )
        return done

    def fold(self, engines: Sequence[Engine]) -> LoadAnnounce:
        """The loads carry the target (:class:`~drs_protocol.control.LoadAnnounce`) instead of an
        announce round before them: one call per engine. ``engines`` become this lease's (its
        renewals; a fallback's withdrawal); :meth:`told` records, from their answers, how long
        telling them took."""
        self.covered = True
        self._urls.update(dict.fromkeys(e.url for e in engines if e.url))
        return LoadAnnounce(digest=self._target.digest, lease_s=self._announcer.lease_s)

    def told(self, margin_s: float, leads_s: list[float], late_legs: int) -> None:
        """After loads that carried the target: the seconds from the refit's start until the last
        engine took it, from each engine's ``told_lead_s`` (:func:`drs_protocol.cutover.told_seconds`),
        recorded as :meth:`cover` records an announce round's (the next margin is sized by it)."""
        self.late_legs += late_legs
        told_s = told_seconds(margin_s, leads_s)
        effective_at = self._target.effective_at
        if told_s is None or effective_at is None or not self._announcer.enabled:
            return
        self.announced_s = told_s
        self.told_at = effective_at - min(leads_s)
        self._announcer.last_told_s = told_s
        log.info(
            "target weights %s carried by the loads: the last of %d engine(s) took it %.3fs after the refit's "
            "start (margin %.3fs)",
            self._target.version,
            len(leads_s),
            told_s,
            margin_s,
        )

    async def load_folded(
        self,
        engines: Sequence[Engine],
        margin_s: float,
        body: Callable[[LoadAnnounce], Encoded],
        load: Callable[[str, Encoded], Awaitable[CallResult]],
        fan_out: Callable[[Callable[[str], Awaitable[CallResult]]], Awaitable[Report]],
    ) -> tuple[Report, bool]:
        """A checkpoint refit's loads, each carrying the target (:meth:`fold`: taken on arrival,
        before the engine reads anything; ``body`` encodes it once for every engine), sent by
        ``load`` through ``fan_out`` (every ready engine in one wave), whose report it returns; an
        engine not ready is announced to alongside (it may become ready meanwhile). The engines'
        ``told_lead_s`` size the next margin (:meth:`told`). Returns the report and whether the
        cut-over was outrun (an engine told after it)."""
        folded = body(self.fold(engines))
        leads: list[float] = []
        late_legs = 0

        async def one(url: str) -> CallResult:
            nonlocal late_legs
            result = await load(url, folded)
            answer = result.answer
            if isinstance(answer, ControlAnswer) and isinstance(answer.result, WeightsChanged):
                late_legs += answer.result.late_legs
                if answer.result.told_lead_s is not None:
                    leads.append(answer.result.told_lead_s)
            return result

        idle = [e.url for e in engines if e.url and not e.ready]
        report, _ = await asyncio.gather(fan_out(one), self._announcer.announce(idle, self._target, timeout_s=margin_s))
        self.told(margin_s, leads, late_legs)
        return report, self.outran()

    async def cut_over(self) -> bool:
        """Wait until the target's ``effective_at`` (no update starts before it); :meth:`outran`."""
        late = self.outran()
        effective_at = self._target.effective_at
        if effective_at is None:
            return False
        # waiting for the scheduled instant itself (the cut-over), not standing in for an event
        await asyncio.sleep(max(0.0, effective_at - time.time()))
        return late

    def outran(self) -> bool:
        """True (and logged) when the announce round (:meth:`cover`) ended after the target's
        ``effective_at``: engines told late may have answered turns stamped after the cut-over at
        the old weights (they count them: :attr:`late_legs`)."""
        effective_at = self._target.effective_at
        if effective_at is None:
            return False
        late = self.told_at is not None and self.told_at > effective_at
        if late:
            log.warning(
                "target weights %s: the announce round ended %.3fs after its cut-over (margin too small for this "
                "fleet; raise --cutover-margin): engines told late may have answered new turns at the old weights",
                self._target.version,
                (self.told_at or effective_at) - effective_at,
            )
        return late

    async def _renew(self) -> None:
        period = self._announcer.lease_s / 3
        while not self._stopped.is_set():
            with contextlib.suppress(TimeoutError):  # every period until stopped
                await asyncio.wait_for(self._stopped.wait(), period)
                return
            await self._announcer.announce(list(self._urls), self._target)

    async def stop(self) -> None:
        """No renewal after this returns (one in flight is waited for, so a later announce, e.g.
        a rollback's, reaches the engines after it)."""
        self._stopped.set()
        if not self._first.done():
            self._first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._first
        if self._renewal is not None:
            await self._renewal


def note_cutover(report: Report, lease: Lease, margin: float, late: bool) -> None:
    """The announce and cut-over figures of a weights operation, in its report."""
    report.target_announced_s = lease.announced_s
    if lease.announced_s is not None:
        report.effective_at = lease.effective_at
        report.cutover_margin_s = margin
        report.announce_exceeded_margin = late
        report.late_legs = lease.late_legs


async def announced_update(
    announcer: TargetAnnouncer,
    engines: Sequence[Engine],
    target: Target,
    fallback: DesiredWeights | None,
    start: Callable[[DesiredWeights], Awaitable[DesiredWeights | None]],
    run: Callable[[], Awaitable[Report]],
    *,
    bounded: bool = False,
) -> tuple[Report, DesiredWeights | None, DesiredWeights]:
    """A collective or CUDA IPC update ``run`` with its cut-over: ``target`` stored as the desired
    weights (``start``, which returns the previous ones) and announced to ``engines`` first, no
    engine taking it before its ``effective_at`` (``bounded``: each announce call within the margin,
    so a member that does not answer delays the broadcast by the margin, not the call's timeout).
    Returns the report, the weights desired before, and the target's desired weights."""
    desired, margin = announcer.desired(*target)
    bound = min(announcer.timeout_s, max(margin, MIN_COLLECTIVE_ANNOUNCE_S)) if bounded else None
    async with announcer.lease(engines, desired, fallback, timeout_s=bound) as lease:
        previous = await start(desired)
        await lease.cover(engines)
        late = await lease.cut_over()  # no engine takes the new weights before the cut-over
        report = await run()
        await lease.stop()
    note_cutover(report, lease, margin, late)
    return report, previous, desired
