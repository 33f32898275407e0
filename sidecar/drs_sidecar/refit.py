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
two interleaved loads would leave engines at different versions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

from drs_protocol.control import CollectiveInit, CollectiveUpdate, IpcUpdate, MemoryTags, PrepareRefitInfo
from drs_protocol.limits import MAX_WEIGHTS_VERSION_CHARS
from drs_protocol.routes import ControlOp, TrainerRoute

from drs_sidecar.collective import GroupLayout, group_layout
from drs_sidecar.control import CallResult, ControlClient
from drs_sidecar.errors import FleetError, NoGroup, RefitBusy, Refused
from drs_sidecar.fleet import Engine, Fleet
from drs_sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)

#: The engines refuse longer versions (``drs_protocol.control.LoadWeights``).
MAX_VERSION_CHARS: Final = MAX_WEIGHTS_VERSION_CHARS
#: Seconds before an engine whose catch-up load failed is tried again (doubling per failure).
RETRY_BASE_S: Final = 5.0
RETRY_MAX_S: Final = 300.0


@dataclass(frozen=True, slots=True)
class Weights:
    path: str
    version: str


@dataclass(frozen=True, slots=True)
class EngineOutcome:
    engine: str
    role: str
    replica: int
    url: str | None
    ok: bool
    detail: str
    elapsed_s: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "role": self.role,
            "replica": self.replica,
            "url": self.url,
            "ok": self.ok,
            "detail": self.detail,
            "elapsed_s": round(self.elapsed_s, 3),
        }


@dataclass(slots=True)
class Report:
    """What one fan-out did: every ready engine's outcome, and the engines it could not call."""

    op: ControlOp
    outcomes: list[EngineOutcome] = field(default_factory=list)
    pending: list[Engine] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def failed(self) -> list[EngineOutcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def complete(self) -> bool:
        return bool(self.outcomes) and not self.failed and not self.pending

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op.value,
            "complete": self.complete,
            "engines": len(self.outcomes) + len(self.pending),
            "ok": sum(o.ok for o in self.outcomes),
            "failed": [o.as_dict() for o in self.failed],
            "pending": [{"engine": e.name, "role": e.role, "replica": e.replica} for e in self.pending],
            "outcomes": [o.as_dict() for o in self.outcomes],
            "elapsed_s": round(self.elapsed_s, 3),
        }


def check_weights(path: str, version: str) -> None:
    """:class:`Refused` naming the field for a refit request no engine would accept."""
    if not path:
        raise Refused("path: must not be empty")
    if not version or len(version) > MAX_VERSION_CHARS:
        raise Refused(f"version: must be 1 to {MAX_VERSION_CHARS} characters")


class Refitter:
    def __init__(self, fleet: Fleet, control: ControlClient, metrics: SidecarMetrics, *, concurrency: int = 64) -> None:
        self.fleet = fleet
        self.control = control
        self.metrics = metrics
        self.concurrency = concurrency
        self.desired: Weights | None = None
        self.published: str | None = None
        #: engine name -> the version it serves, as last recorded on the resource
        self.engine_versions: dict[str, str] = {}
        self._lock = asyncio.Lock()
        #: engine URL -> (failed catch-up loads in a row, loop time before which it is not retried)
        self._backoff: dict[str, tuple[int, float]] = {}
        #: the collective refit group the last ``collective_init`` formed
        self.group: GroupLayout | None = None

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    async def refit(self, path: str, version: str) -> Report:
        """Load ``path`` as ``version`` on every ready engine; publish the version if all of the
        fleet now serves it. Raises :class:`RefitBusy`, :class:`FleetError`, :class:`Refused`."""
        check_weights(path, version)
        if self._lock.locked():
            raise RefitBusy()
        async with self._lock:
            report = await self._fan_out(
                ControlOp.LOAD_WEIGHTS,
                await self.fleet.engines(),
                lambda url: self.control.load_weights(url, path, version),
            )
            self.metrics.refits.labels(result="complete" if report.complete else "incomplete").inc()
            self.metrics.refit_seconds.observe(report.elapsed_s)
            if any(o.ok for o in report.outcomes):
                self.desired = Weights(path, version)
                self._backoff.clear()
            await self._record_engines({**self.engine_versions, **{o.engine: version for o in report.outcomes if o.ok}})
            if report.complete:
                await self._publish(version)
            elif self.desired is not None and self.desired.version == version:
                log.warning(
                    "refit to %s incomplete: %d failed, %d pending (kept as desired; retried as engines come up)",
                    version,
                    len(report.failed),
                    len(report.pending),
                )
            else:
                log.warning("refit to %s loaded on no engine: the desired weights are unchanged", version)
            return report

    # -- collective (NCCL) refit: see drs_sidecar.collective ----------------------------------

    async def collective_init(self, ip: str, port: int, train_world_size: int) -> tuple[GroupLayout, Report]:
        """Every engine joins the trainer's NCCL group at its ranks (``NotAllReady``, ``Refused``)."""
        if self._lock.locked():
            raise RefitBusy()
        async with self._lock:
            layout = group_layout(await self.fleet.engines(), train_world_size)
            bodies = {
                m.engine.url: CollectiveInit(
                    rank_prefix=m.rank_prefix,
                    ip=ip,
                    port=port,
                    world_size=layout.world_size,
                    train_world_size=train_world_size,
                )
                for m in layout.members
            }
            report = await self._fan_out(
                ControlOp.INIT_COLLECTIVE,
                [m.engine for m in layout.members],
                lambda url: self.control.op(url, ControlOp.INIT_COLLECTIVE, bodies[url], timeout=self.control.load_s),
                all_at_once=True,
            )
            self.group = layout if report.complete else None
            return layout, report

    async def collective_prepare(self, state_dict_info: dict[str, Any]) -> Report:
        """Tell every engine of the group which tensors will come (names, shapes, dtypes)."""
        return await self._collective(ControlOp.PREPARE_REFIT_INFO, PrepareRefitInfo(state_dict_info=state_dict_info))

    async def collective_update(self, version: str, *, drain: bool, recompute_kv: bool, path: str | None) -> Report:
        """Every engine of the group receives the trainer's broadcast and serves it as ``version``.
        ``path``: a checkpoint of the same weights, loaded on engines that come back later (without
        one, nothing is desired: a restarted engine keeps the weights it starts with)."""
        check_weights(path or "-", version)
        body = CollectiveUpdate(version=version, drain=drain, recompute_kv=recompute_kv)
        report = await self._collective(ControlOp.UPDATE_WEIGHTS_FROM_COLLECTIVE, body)
        if report.complete:
            self.desired = Weights(path, version) if path else None
            self._backoff.clear()
            if path is None:
                log.warning("weights %s came by broadcast, no checkpoint path: restarted engines keep theirs", version)
            await self._publish(version)
        return report

    async def ipc_update(self, body: IpcUpdate, *, path: str | None) -> Report:
        """The colocated refit: every ready engine copies the trainer's CUDA-IPC-shared packed
        buffers into its weights and serves them as ``body.version`` (engines on the trainer's host;
        no group to form). ``path`` as for :meth:`collective_update`."""
        check_weights(path or "-", body.version)
        if self._lock.locked():
            raise RefitBusy()
        async with self._lock:
            op = ControlOp.UPDATE_WEIGHTS_FROM_IPC
            report = await self._fan_out(
                op,
                await self.fleet.engines(),
                lambda url: self.control.op(url, op, body, timeout=self.control.load_s),
                all_at_once=True,
            )
            await self._record_engines(
                {**self.engine_versions, **{o.engine: body.version for o in report.outcomes if o.ok}}
            )
        if report.complete:
            self.desired = Weights(path, body.version) if path else None
            self._backoff.clear()
            await self._publish(body.version)
        return report

    async def _collective(self, op: ControlOp, body: PrepareRefitInfo | CollectiveUpdate) -> Report:
        if self._lock.locked():
            raise RefitBusy()
        async with self._lock:
            group = self.group
            if group is None:
                raise NoGroup(f"no collective group: POST {TrainerRoute.COLLECTIVE_INIT} first")
            report = await self._fan_out(
                op,
                [m.engine for m in group.members],
                lambda url: self.control.op(url, op, body, timeout=self.control.load_s),
                all_at_once=True,
            )
            if report.failed:
                self.group = None  # a member failed mid-collective: the group is not usable
            return report

    async def broadcast(self, op: ControlOp, body: MemoryTags | None = None) -> Report:
        """One control call on every ready engine (prefix-cache reset, sleep, wake, profiling)."""
        return await self._fan_out(op, await self.fleet.engines(), lambda url: self.control.op(url, op, body))

    async def reconcile_once(self) -> Report | None:
        """Record the version every ready engine serves (the operator's per-engine status); bring
        every ready engine that serves another version to the desired weights; publish the
        version once the whole fleet serves it. None when nothing is desired or a refit runs.
        Without desired weights nothing is locked: a refit arriving meanwhile is never refused."""
        if self._lock.locked():
            return None
        if self.desired is None:
            *_, served = await self._read_versions()
            if self.desired is None and not self._lock.locked():
                await self._record_engines(served)
            return None
        async with self._lock:
            desired = self.desired
            engines, ready, versions, served = await self._read_versions()
            behind = [
                e
                for e, v in zip(ready, versions, strict=True)
                if v.ok and v.body.get("weights_version") != desired.version
            ]
            unknown = sum(not v.ok for v in versions)
            self.metrics.engines_behind.set(len(behind) + unknown + (len(engines) - len(ready)))
            now = asyncio.get_running_loop().time()
            due = [e for e in behind if self._backoff.get(e.url or "", (0, 0.0))[1] <= now]
            report = Report(ControlOp.LOAD_WEIGHTS)
            if due:
                log.info("%d engine(s) not at weights %s: loading", len(due), desired.version)
                report = await self._fan_out(
                    ControlOp.LOAD_WEIGHTS,
                    due,
                    lambda url: self.control.load_weights(url, desired.path, desired.version),
                )
                self._note_attempts(report, now)
            await self._record_engines({**served, **{o.engine: desired.version for o in report.outcomes if o.ok}})
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

    async def _read_versions(self) -> tuple[list[Engine], list[Engine], list[CallResult], dict[str, str]]:
        """The fleet's engines, the ready ones, their answers to ``GET /control/weights``, and
        ``{engine name: version}`` of those that answered."""
        engines = await self.fleet.engines()
        ready = [e for e in engines if e.ready and e.url]
        versions = await asyncio.gather(*(self.control.weights_version(e.url) for e in ready if e.url))
        served = {
            e.name: str(v.body["weights_version"])
            for e, v in zip(ready, versions, strict=True)
            if v.ok and isinstance(v.body.get("weights_version"), str)
        }
        return engines, ready, list(versions), served

    async def _record_engines(self, versions: dict[str, str]) -> None:
        """Write the per-engine versions to the resource when they changed (never fails the caller)."""
        if versions == self.engine_versions:
            return
        try:
            await self.fleet.publish_engines(versions)
        except FleetError as exc:
            log.warning("per-engine weights versions could not be recorded: %s", exc)
            return
        self.engine_versions = dict(versions)

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
    ) -> Report:
        """``call`` on every ready engine, at most ``concurrency`` at once, or all at once (a
        collective step: every member must be inside the call for any of them to finish)."""
        started = time.perf_counter()
        report = Report(op, pending=[e for e in engines if not (e.ready and e.url)])
        gate = asyncio.Semaphore(max(1, len(engines)) if all_at_once else self.concurrency)

        async def one(engine: Engine) -> EngineOutcome:
            assert engine.url is not None
            async with gate:
                result = await call(engine.url)
            self.metrics.engine_calls.labels(op=op.value, result="ok" if result.ok else "failed").inc()
            detail = result.detail if result.status is None or result.ok else f"{result.status}: {result.detail}"
            return EngineOutcome(
                engine.name, engine.role, engine.replica, engine.url, result.ok, detail, result.elapsed_s
            )

        report.outcomes = list(await asyncio.gather(*(one(e) for e in engines if e.ready and e.url)))
        report.elapsed_s = time.perf_counter() - started
        for failed in report.failed:
            log.warning("%s on %s (%s) failed: %s", op, failed.engine, failed.url, failed.detail)
        return report
