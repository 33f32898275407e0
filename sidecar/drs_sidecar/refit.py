"""Refit: load new weights on every engine of every replica, and keep them there.

:meth:`Refitter.refit` reads the fleet now (never a cached list), calls ``POST
/control/weights/load`` on every ready engine at once (at most ``concurrency`` in flight, each
within the load timeout) and reports each engine's outcome. Only when every engine of the fleet
serves the new version is the refit *complete*: then the version is published
(``disagg.dev/weights-version``) and becomes the *desired* weights. Engines that were not ready
are listed as ``pending``; a refit with failures or pending engines is not complete and is not
published, but its weights are still desired, so :meth:`Refitter.reconcile_once` (run every few
seconds by the app) loads them on each engine that comes up at another version: a restarted or
replaced engine pod comes back at the trainer's current weights. Loading resets the engine's
prefix cache (the engine does it), so the next turn re-prefills under the new weights.

A refit that loaded nowhere (a mistyped path: every engine refused it) changes nothing: the
previous desired weights stay. An engine whose catch-up load fails is retried with exponential
back-off (``RETRY_BASE_S`` doubling up to ``RETRY_MAX_S``), not on every pass.

One refit at a time: a second one while the first runs is refused (:class:`RefitBusy`), since
two interleaved loads would leave engines at different versions. The sidecar's own reconcile pass
is no such reason: a trainer's operation arriving during one waits for it to end.

Digest proof: every answer of a weights operation carries the digest the engine measured over the
bytes it now holds (:mod:`drs_protocol.weights_digest`). An engine's load counts only when its
digest equals the desired one: the trainer's (``digest`` in its request, computed over what it
sent), else the one the engines agree on (most of them; a tie is a disagreement and fails every
engine of it). A load that answered 200 but holds other bytes is a failure naming the engine. An
engine whose backend computes no digest (``trtllm`` today) counts unverified, and its outcome
says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, TypeVar

from drs_protocol.control import (
    CollectiveInit,
    CollectiveUpdate,
    IpcUpdate,
    MemoryTags,
    PrepareRefitInfo,
    Refit,
    TrainerCollectiveUpdate,
    TrainerIpcUpdate,
)
from drs_protocol.cutover import MIN_CUTOVER_MARGIN_S
from drs_protocol.limits import DEFAULT_COLLECTIVE_TIMEOUT_S
from drs_protocol.routes import ControlOp, TrainerRoute
from drs_protocol.validation_errors import field_problems
from drs_protocol.weights_state import DesiredWeights, HeldWeights
from pydantic import BaseModel, ValidationError

from drs_sidecar.collective import GroupLayout, group_layout, membership_changes
from drs_sidecar.control import CallResult, ControlClient
from drs_sidecar.errors import FleetError, GroupChanged, NoGroup, RefitBusy, Refused
from drs_sidecar.fleet import Engine, Fleet
from drs_sidecar.group_abort import CollectiveSteps
from drs_sidecar.metrics import SidecarMetrics
from drs_sidecar.report import EngineOutcome, Report, held_after, holds_desired, verify_digests
from drs_sidecar.targets import DEFAULT_LEASE_S, Announced, Target, TargetAnnouncer, announced_update, note_cutover

log = logging.getLogger(__name__)

#: Seconds before an engine whose catch-up load failed is tried again (doubling per failure).
RETRY_BASE_S: Final = 5.0
RETRY_MAX_S: Final = 300.0


ModelT = TypeVar("ModelT", bound=BaseModel)
#: The operations that change an engine's weights (their outcomes are checked by digest).
WEIGHTS_OPS: Final = frozenset(
    {ControlOp.LOAD_WEIGHTS, ControlOp.UPDATE_WEIGHTS_FROM_COLLECTIVE, ControlOp.UPDATE_WEIGHTS_FROM_IPC}
)


def checked(model: type[ModelT], data: object) -> ModelT:
    """``model`` from ``data``, or :class:`Refused` naming each bad field (the models of
    :mod:`drs_protocol.control` hold the one rule for each: version, digest, path). The one place
    the sidecar words a validation error (trainer bodies, and refits called in-process)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise Refused("; ".join(f"{p.path or 'body'}: {p.message}" for p in field_problems(exc.errors()))) from None


class Refitter:
    def __init__(
        self,
        fleet: Fleet,
        control: ControlClient,
        metrics: SidecarMetrics,
        *,
        concurrency: int = 64,
        collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        target_lease_s: float = DEFAULT_LEASE_S,
        cutover_margin_s: float = MIN_CUTOVER_MARGIN_S,
    ) -> None:
        self.fleet = fleet
        #: announces the target weights and their cut-over before any load (``drs_sidecar.targets``)
        self.targets = TargetAnnouncer(control, metrics, lease_s=target_lease_s, margin_s=cutover_margin_s)
        #: the engines of the last fleet read: a refit announces to them before it reads again
        self.known: list[Engine] = []
        self.control = control
        self.metrics = metrics
        self.concurrency = concurrency
        self.desired: DesiredWeights | None = None
        self.published: str | None = None
        #: engine name -> what it holds, as last recorded on the resource
        self.engine_weights: dict[str, HeldWeights] = {}
        self._lock = asyncio.Lock()
        #: a trainer's operation holds, or waits for, the lock (a second one is refused)
        self._trainer_busy = False
        #: engine URL -> (failed catch-up loads in a row, loop time before which it is not retried)
        self._backoff: dict[str, tuple[int, float]] = {}
        #: a failed collective step's withdrawal of its target, still going out (``_settle``)
        self._withdrawal: asyncio.Task[Announced] | None = None
        #: the collective refit group the last ``collective_init`` formed
        self.group: GroupLayout | None = None
        #: each collective step bounded, and aborted on every member when one fails
        self.steps = CollectiveSteps(control, collective_timeout_s)

    @property
    def busy(self) -> bool:
        """A trainer's operation runs (or waits for the reconcile pass in flight to end)."""
        return self._trainer_busy

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """One trainer operation at a time: a second one while the first runs is refused
        (:class:`RefitBusy`); the sidecar's own reconcile pass in flight is waited for, never a
        reason to refuse the trainer (it is short unless it loads a late engine)."""
        async with self._claim(), self._lock:
            yield

    @contextlib.asynccontextmanager
    async def _claim(self) -> AsyncIterator[None]:
        if self._trainer_busy:
            raise RefitBusy()
        self._trainer_busy = True
        try:
            if self._withdrawal is not None:  # a failed collective's withdrawal reaches the engines first
                await self._withdrawal
                self._withdrawal = None
            yield
        finally:
            self._trainer_busy = False

    async def refit(self, path: str, version: str, digest: str | None = None) -> Report:
        """Load ``path`` as ``version`` on every ready engine; publish the version if all of the
        fleet now holds it (by digest: ``digest``, the trainer's, else the engines' agreement).
        Raises :class:`RefitBusy`, :class:`FleetError`, :class:`Refused`."""
        request = checked(Refit, {"path": path, "version": version, "digest": digest})
        target, margin = self.targets.desired(request.version, request.path, request.digest)
        async with self._claim():
            passing = self._lock.locked()  # a reconcile pass runs: it may announce the old target
            # the loads carry the target (--fold-announce, no pass running), else announced at once (targets.py)
            fold = not passing and self.targets.one_wave(self.known, self.concurrency)
            async with self.targets.lease([] if fold else self.known, target, self.desired) as lease, self._lock:
                engines = self.known = await self.fleet.engines()
                previous = await self._start(target)
                checkpoint = (request.path, request.version, lease.effective_at)  # read now, swapped at the cut-over

                def fan_out(load: Callable[[str], Awaitable[CallResult]]) -> Awaitable[Report]:
                    return self._fan_out(ControlOp.LOAD_WEIGHTS, engines, load, desired_digest=request.digest)

                if fold and self.targets.one_wave(engines, self.concurrency):  # each load tells its engine
                    loads = (lambda told: self.control.load_body(*checkpoint, told), self.control.load)
                    report, late = await lease.load_folded(engines, margin, *loads, fan_out)
                else:
                    await lease.cover(engines, again=passing)  # every engine has been told before the first load
                    late, body = lease.outran(), self.control.load_body(*checkpoint)  # one encoding for all
                    report = await fan_out(functools.partial(self.control.load, body=body))
                await lease.stop()  # no renewal after this: a rollback's announce comes last
                note_cutover(report, lease, margin, late)
                self.metrics.refits.labels(result="complete" if report.complete else "incomplete").inc()
                self.metrics.refit_seconds.observe(report.elapsed_s)
                await self._settle(report, previous, target, announced=True)
                await self._record_outcomes(report)
                if report.complete:
                    await self._publish(request.version)
                elif self.desired is not None and self.desired.version == request.version:
                    log.warning(
                        "refit to %s incomplete: %d failed, %d pending (kept as desired; retried as engines come up)",
                        request.version,
                        len(report.failed),
                        len(report.pending),
                    )
                else:
                    log.warning("refit to %s loaded on no engine: the desired weights are unchanged", request.version)
                return report

    # -- collective (NCCL) refit: see drs_sidecar.collective ----------------------------------

    async def collective_init(self, ip: str, port: int, train_world_size: int) -> tuple[GroupLayout, Report]:
        """Every engine joins the trainer's NCCL group at its ranks (``NotAllReady``, ``Refused``)."""
        async with self._exclusive():
            layout = group_layout(await self.steps.members(self.fleet), train_world_size)
            bodies = {
                m.engine.url: CollectiveInit(
                    rank_prefix=m.rank_prefix,
                    ip=ip,
                    port=port,
                    world_size=layout.world_size,
                    train_world_size=train_world_size,
                    timeout_s=self.steps.engine_s,
                )
                for m in layout.members
            }
            report = await self.steps.run(self._fan_out, ControlOp.INIT_COLLECTIVE, layout, bodies.__getitem__)
            self.group = layout if report.complete else None
            return layout, report

    async def collective_prepare(self, state_dict_info: dict[str, Any]) -> Report:
        """Tell every engine of the group which tensors will come (names, shapes, dtypes)."""
        return await self._collective(ControlOp.PREPARE_REFIT_INFO, PrepareRefitInfo(state_dict_info=state_dict_info))

    async def collective_update(self, request: TrainerCollectiveUpdate) -> Report:
        """Every engine of the group receives the trainer's broadcast and serves it as
        ``request.version``, checked against ``request.digest``. ``request.path``: a checkpoint of
        the same weights, loaded on engines that come back later (without one, a restarted engine
        cannot be brought to them from a checkpoint)."""
        body = CollectiveUpdate(
            version=request.version,
            drain=request.drain,
            recompute_kv=request.recompute_kv,
            timeout_s=self.steps.engine_s,
        )
        report = await self._collective(
            ControlOp.UPDATE_WEIGHTS_FROM_COLLECTIVE,
            body,
            desired_digest=request.digest,
            target=(request.version, request.path, request.digest),
        )
        if report.complete:
            await self._publish(request.version)
        return report

    async def ipc_update(self, request: TrainerIpcUpdate) -> Report:
        """The colocated refit: every ready engine copies the trainer's CUDA-IPC-shared packed
        buffers into its weights and serves them as ``request.version`` (engines on the trainer's
        host; no group to form). ``path`` and ``digest`` as for :meth:`collective_update`."""
        body = IpcUpdate(version=request.version, state_dict_info=request.state_dict_info, buffers=request.buffers)
        async with self._exclusive():
            op = ControlOp.UPDATE_WEIGHTS_FROM_IPC
            engines = self.known = await self.fleet.engines()
            target = (request.version, request.path, request.digest)
            report, previous, desired = await self._cut_over(
                engines,
                target,
                lambda: self._fan_out(
                    op,
                    engines,
                    lambda url: self.control.op(url, op, body, timeout=self.control.load_s),
                    all_at_once=True,
                    desired_digest=request.digest,
                ),
            )
            await self._settle(report, previous, desired, announced=True)
            await self._record_outcomes(report)
        if report.complete:
            await self._publish(request.version)
        return report

    async def restore(self) -> DesiredWeights | None:
        """Take the desired weights from the resource, where an earlier refit stored them (a
        restarted sidecar or trainer pod forgets nothing), and the engines of the fleet (the
        first refit's announce goes to them). :class:`FleetError` when unreadable."""
        stored = await self.fleet.desired()
        self.known = await self.fleet.engines()  # a first refit announces to them at once
        if stored is not None and self.desired is None:
            self.desired = stored
            log.info("desired weights %s restored from the resource", stored.version)
        return stored

    async def _cut_over(
        self, engines: list[Engine], target: Target, run: Callable[[], Awaitable[Report]], *, bounded: bool = False
    ) -> tuple[Report, DesiredWeights | None, DesiredWeights]:
        """A collective or CUDA IPC update ``run``, its target stored and announced first
        (:func:`drs_sidecar.targets.announced_update`)."""
        return await announced_update(self.targets, engines, target, self.desired, self._start, run, bounded=bounded)

    async def _start(self, target: DesiredWeights) -> DesiredWeights | None:
        """Store ``target`` as the desired weights on the resource before any engine is called (a
        refit that cannot be recorded is refused: :class:`FleetError`); the previous ones back."""
        previous = self.desired
        await self.fleet.desire(target)
        self.desired = target
        return previous

    async def _settle(
        self,
        report: Report,
        previous: DesiredWeights | None,
        target: DesiredWeights,
        *,
        announced: bool = False,
        at_once: bool = False,
    ) -> None:
        """After a weights operation: the new weights stay desired (with the digest the engines were
        checked against) when any engine took them; one that reached no engine puts the previous
        desired weights back (a mistyped path changes nothing), announced to the engines when the
        operation had announced its target (every refit: by checkpoint, collective or CUDA IPC), so
        nothing waits for weights that did not arrive. ``at_once``: that announce goes out without
        the trainer's answer waiting for it (a failed collective step: a hung member would add its
        announce timeout); the next trainer operation waits for it first."""
        if any(o.ok for o in report.outcomes):
            desired: DesiredWeights | None = target.model_copy(update={"digest": target.digest or report.digest})
            self._backoff.clear()
            if target.path is None:
                log.warning("weights %s came without a checkpoint path: later engines cannot load them", target.version)
        else:
            desired = previous  # the engines serve again at once: the target gave way to the previous one
            if announced:
                told = [e.url for e in self.known if e.url] + [o.url for o in report.outcomes if o.url]
                withdraw = asyncio.create_task(self.targets.announce(told, desired), name="withdraw-target")
                if at_once:
                    self._withdrawal = withdraw
                else:
                    await withdraw
        if desired != target:
            try:
                await self.fleet.desire(desired)
            except FleetError as exc:
                log.error("desired weights could not be recorded: %s", exc)
        self.desired = desired

    async def _collective(
        self,
        op: ControlOp,
        body: PrepareRefitInfo | CollectiveUpdate,
        *,
        desired_digest: str | None = None,
        target: Target | None = None,
    ) -> Report:
        """A collective step on every member of the group; ``target`` (version, path, digest): the
        weights it brings, announced to the members with their cut-over before the step (engines
        refuse legs stamped after it until they hold them) and withdrawn when none took them."""
        async with self._exclusive():
            group = self.group
            if group is None:
                raise NoGroup(f"no collective group: POST {TrainerRoute.COLLECTIVE_INIT} first")
            changes = membership_changes(group, await self.steps.members(self.fleet))
            if changes:  # a collective over a member that is not there would wait for it
                self.group = None
                raise GroupChanged(changes)

            def step() -> Awaitable[Report]:
                return self.steps.run(self._fan_out, op, group, lambda _: body, desired_digest=desired_digest)

            if target is None:
                report = await step()
            else:  # a member that does not answer the announce costs the margin at most, not its timeout
                members = [m.engine for m in group.members]
                report, previous, desired = await self._cut_over(members, target, step, bounded=True)
            if report.failed:
                self.group = None  # aborted on every member: the next collective/init forms a new one
            if target is not None:
                await self._settle(report, previous, desired, announced=True, at_once=True)
            if op in WEIGHTS_OPS:
                await self._record_outcomes(report)
            return report

    async def broadcast(self, op: ControlOp, body: MemoryTags | None = None) -> Report:
        """One control call on every ready engine (prefix-cache reset, sleep, wake, profiling)."""
        return await self._fan_out(op, await self.fleet.engines(), lambda url: self.control.op(url, op, body))

    async def reconcile_once(self) -> Report | None:
        """Record what every ready engine holds (the operator's per-engine status); bring every
        ready engine that holds other weights (another version, or another digest than the
        desired one) to the desired weights when they have a checkpoint path; publish the version
        once the whole fleet holds it. None when nothing is desired or a refit runs. Without
        desired weights nothing is locked: a refit arriving meanwhile is never refused."""
        if self._lock.locked() or self._trainer_busy:
            return None
        if self.desired is None:
            *_, held = await self._read_weights()
            if self.desired is None and not self._lock.locked():
                await self._record_engines(held)
            return None
        async with self._lock:
            desired = self.desired
            engines, ready, answers, held = await self._read_weights()
            behind = [e for e, a in zip(ready, answers, strict=True) if a.ok and not holds_desired(a, desired)]
            await self.targets.announce([e.url for e in behind if e.url], desired)  # renews their lease
            unknown = sum(not a.ok for a in answers)
            self.metrics.engines_behind.set(len(behind) + unknown + (len(engines) - len(ready)))
            now = asyncio.get_running_loop().time()
            due = [e for e in behind if self._backoff.get(e.url or "", (0, 0.0))[1] <= now]
            report = Report(ControlOp.LOAD_WEIGHTS)
            path = desired.path
            if due and path is not None:
                log.info("%d engine(s) not at weights %s: loading", len(due), desired.version)
                report = await self._fan_out(
                    ControlOp.LOAD_WEIGHTS,
                    due,
                    lambda url: self.control.load_checkpoint(url, path, desired.version),
                    desired_digest=desired.digest,
                )
                self._note_attempts(report, now)
            await self._record_engines({**held, **held_after(report)})
            loaded = {o.url for o in report.outcomes if o.ok}
            all_current = len(ready) == len(engines) and unknown == 0 and all(e.url in loaded for e in behind)
            if all_current and engines and self.published != desired.version:
                await self._publish(desired.version)
            return report

    def _note_attempts(self, report: Report, now: float) -> None:
        for outcome in report.outcomes:
            url = outcome.url or ""
            if outcome.ok:
                self._backoff.pop(url, None)
            else:
                failures = self._backoff.get(url, (0, 0.0))[0] + 1
                self._backoff[url] = (failures, now + min(RETRY_BASE_S * 2 ** (failures - 1), RETRY_MAX_S))

    async def _read_weights(self) -> tuple[list[Engine], list[Engine], list[CallResult], dict[str, HeldWeights]]:
        """The fleet's engines, the ready ones, their answers to ``GET /control/weights``, and
        what each that answered holds, by engine name (one holding part of a failed update counts
        ready: a load is what it waits for)."""
        engines = self.known = await self.steps.members(self.fleet)
        ready = [e for e in engines if e.ready and e.url]
        answers = await asyncio.gather(*(self.control.weights(e.url) for e in ready if e.url))
        held = {
            e.name: HeldWeights(version=a.weights_version, digest=a.weights_digest)
            for e, a in zip(ready, answers, strict=True)
            if a.ok and a.weights_version is not None
        }
        return engines, ready, list(answers), held

    async def _record_outcomes(self, report: Report) -> None:
        await self._record_engines({**self.engine_weights, **held_after(report)})

    async def _record_engines(self, held: dict[str, HeldWeights]) -> None:
        """Write what each engine holds to the resource when it changed (never fails the caller)."""
        if held == self.engine_weights:
            return
        try:
            await self.fleet.publish_engines(held)
        except FleetError as exc:
            log.warning("per-engine weights could not be recorded: %s", exc)
            return
        self.engine_weights = dict(held)

    async def _publish(self, version: str) -> None:
        try:
            await self.fleet.publish(version)
        except FleetError as exc:
            log.error("weights %s reached every engine but could not be recorded: %s", version, exc)
            return
        self.published = version
        self.metrics.engines_behind.set(0)
        log.info("weights %s serve on every engine", version)

    async def _fan_out(
        self,
        op: ControlOp,
        engines: list[Engine],
        call: Callable[[str], Awaitable[CallResult]],
        *,
        all_at_once: bool = False,
        desired_digest: str | None = None,
    ) -> Report:
        """``call`` on every ready engine, at most ``concurrency`` at once, or all at once (a
        collective step: every member must be inside the call for any of them to finish). The
        outcomes of a weights operation are checked by digest (:func:`verify_digests`)."""
        started = time.perf_counter()
        report = Report(op, pending=[e for e in engines if not (e.ready and e.url)])
        gate = asyncio.Semaphore(max(1, len(engines)) if all_at_once else self.concurrency)

        async def one(engine: Engine) -> EngineOutcome:
            assert engine.url is not None
            async with gate:
                result = await call(engine.url)
            self.metrics.count_engine_call(op.value, result.ok)
            detail = result.detail if result.status is None or result.ok else f"{result.status}: {result.detail}"
            return EngineOutcome(
                engine.name,
                engine.role,
                engine.replica,
                engine.url,
                result.ok,
                detail,
                result.elapsed_s,
                result.weights_version,
                result.weights_digest,
            )

        report.outcomes = list(await asyncio.gather(*(one(e) for e in engines if e.ready and e.url)))
        report.elapsed_s = time.perf_counter() - started
        if op in WEIGHTS_OPS:
            return verify_digests(report, desired_digest)
        for failed in report.failed:
            log.warning("%s on %s (%s) failed: %s", op, failed.engine, failed.url, failed.detail)
        return report
