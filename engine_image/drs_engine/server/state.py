"""Everything one engine server holds: config, backend, tokenizer, metrics, admission, sleep
state and the control lock. One instance per app; nothing lives at module level, so several
servers share a process without sharing state.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from drs_protocol.chat import load_tokenizer
from drs_protocol.routes import CONTROL_ROUTES, ControlOp
from drs_protocol.token_source import TokenSource, run_sources
from drs_protocol.weights_state import DesiredWeights

from drs_engine.backends import create_backend
from drs_engine.backends.base import EngineBackend
from drs_engine.config import BackendName, EngineConfig
from drs_engine.errors import DrainingError, UnavailableError, WeightsIncompleteError, WeightsPendingError
from drs_engine.gang.spec import GangSpec, GangSpecError
from drs_engine.metrics import EngineMetrics
from drs_engine.prefill_work import PrefillWork
from drs_engine.weights import desired
from drs_engine.weights.catchup import CatchUp
from drs_engine.weights.follow import Action, DesiredFollower, Held, decide
from drs_engine.weights.target import HOLD_LAPSED_S, TargetGate

log = logging.getLogger("drs_engine")

#: Engine-local ctx_request_ids stay below 2**40 (snowflake disagg_request_ids are above).
LOCAL_ID_LIMIT: Final = 2**40
#: How often a draining engine looks whether its legs and context states are done.
DRAIN_POLL_S: Final = 0.05


@dataclass
class Admission:
    """Batch slots: at most ``max_batch_size`` requests run; the rest wait in FIFO order."""

    limit: int
    metrics: EngineMetrics
    _semaphore: asyncio.Semaphore = field(init=False)
    waiting: int = 0
    running: int = 0

    def __post_init__(self) -> None:
        self._semaphore = asyncio.Semaphore(self.limit)

    async def acquire(self) -> None:
        self.waiting += 1
        self.metrics.queue_depth.set(self.waiting)
        try:
            await self._semaphore.acquire()
        finally:
            self.waiting -= 1
            self.metrics.queue_depth.set(self.waiting)
        self.running += 1
        self.metrics.in_flight.set(self.running)

    def release(self) -> None:
        self.running -= 1
        self.metrics.in_flight.set(self.running)
        self._semaphore.release()


class EngineState:
    def __init__(
        self,
        config: EngineConfig,
        *,
        control_token: str | TokenSource | None,
        serving_token: str | TokenSource | None = None,
        gang: GangSpec | None = None,
        desired_weights: DesiredWeights | None = None,
        weights_peers: Sequence[str] | desired.Peers = (),
        desired_file: Path | None = None,
    ) -> None:
        self.config = config
        #: The fleet's control and serving tokens (``drs_protocol.auth``, ``token_source``): callers
        #: of the serving routes present the serving token, and this engine presents it to its
        #: peers (KV fetch); none configured: serving routes are open, the control API is off.
        self.control_tokens = TokenSource.of(control_token)
        self.serving_tokens = TokenSource.of(serving_token)
        self._token_task: asyncio.Task[None] | None = None
        #: The fleet's newest desired weights: those it started under, or follows since (reached before it serves).
        self.desired_weights = desired_weights
        #: The engines that hold them (a catch-up without a path asks them; re-read on every attempt).
        self.weights_peers = (
            weights_peers if isinstance(weights_peers, desired.Peers) else desired.Peers(tuple(weights_peers))
        )
        #: The way to the desired weights while the engine does not hold them (None: it did at start).
        self.catch_up: CatchUp | None = None
        self._catch_up_tasks: list[asyncio.Task[None]] = []
        #: The mounted desired weights a running engine follows (``drs_engine.weights.follow``; None: not mounted).
        self.desired_file = desired_file
        self.follower: DesiredFollower | None = None
        self._follow_task: asyncio.Task[None] | None = None
        #: When (epoch seconds) a weights operation of the control API last completed (None: never).
        self.control_weights_at: float | None = None
        #: The leader of an engine wider than a node (``drs_engine.gang.leader``); None for one pod.
        self.gang_spec = gang
        self.gang: Any = None
        self._bring_up: asyncio.Task[None] | None = None
        #: Why the engine stopped serving for good (a lost gang); the process exits non-zero.
        self.fatal: str | None = None
        #: Stops the server this state belongs to (set by whoever runs it).
        self.stop_server: Callable[[], None] = lambda: None
        self.tokenizer: Any = None
        self.backend: EngineBackend | None = None
        #: The digest of the weights the backend holds, measured after start and after every change.
        self.weights_digest: str | None = None
        #: Why the weights hold part of an update that failed (no turn, /health 503, until a good load).
        self.weights_incomplete: str | None = None
        self.released_tags: set[str] = set()
        #: The fleet's announced target weights: new legs wait for them (``drs_engine.weights.target``).
        self.target = TargetGate(hold_lapsed_s=HOLD_LAPSED_S if desired_file is not None else 0.0)
        self.control_lock = asyncio.Lock()
        self._local_ids = itertools.count(1)
        self.metrics: EngineMetrics | None = None
        self.admission: Admission | None = None
        #: The legs prefilling here and the prompt tokens computed lately (the prefix-held answer's).
        self.prefill_work = PrefillWork()
        self.draining = False

    @property
    def control_token(self) -> str | None:
        """The control token presented now (a catch-up's calls to its peers)."""
        return self.control_tokens.current

    @property
    def serving_token(self) -> str | None:
        """The serving token presented now."""
        return self.serving_tokens.current

    async def start(self) -> None:
        """Load the tokenizer and the backend; the server is healthy afterwards.

        The leader of a gang returns at once and brings the gang up in the background, so that its
        ``/v1/gang`` answers while the ranks join; it is healthy once the whole gang serves."""
        self._token_task = asyncio.create_task(run_sources(self.control_tokens, self.serving_tokens), name="tokens")
        if self.gang_spec is None:
            await self._load()
            return
        from drs_engine.gang.leader import GangLeader
        from drs_engine.gang.spec import for_gang

        self.config = for_gang(self.config)
        if self.config.host in ("0.0.0.0", "::", ""):
            raise GangSpecError("--host must be this pod's address for an engine wider than a node (Ray binds it)")
        self.gang = GangLeader(
            self.gang_spec,
            self.config.host,
            shard_workers=self.config.backend is BackendName.SIM,
            on_failure=self._fail,
        )
        self._bring_up = asyncio.create_task(self._start_gang(), name="gang-bring-up")

    async def _start_gang(self) -> None:
        try:
            await self.gang.bring_up()
            await self._load()
            self.gang.serve()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("bringing the gang up failed")
            self.gang.fail(f"bringing the gang up failed: {type(exc).__name__}: {exc}")

    def _fail(self, reason: str) -> None:
        self.fatal = reason
        self.stop_server()

    async def _load(self) -> None:
        path = self.config.model.tokenizer
        if path is None and self.config.backend is BackendName.TRTLLM:
            path = self.config.model.path
        self.tokenizer = await asyncio.to_thread(load_tokenizer, path)
        backend = create_backend(
            self.config,
            vocab_size=int(self.tokenizer.vocab_size),
            eos_token_id=int(self.tokenizer.eos_token_id),
            peer_headers=self.serving_tokens,
        )
        metrics = EngineMetrics(backend=backend.name, role=self.config.role.value, test_double=backend.test_double)
        await backend.start()
        self.weights_digest = await backend.measure_digest()
        metrics.set_weights_version(backend.weights_version, loaded=False)
        self.metrics = metrics
        self.admission = Admission(limit=self.config.max_batch_size, metrics=metrics)
        wanted = self.desired_weights
        if wanted is not None and not desired.holds(backend.weights_version, self.weights_digest, wanted):
            self._catch_up(backend, wanted)
        self.backend = backend
        if self.desired_file is not None:
            self.follower = DesiredFollower(self.desired_file, self.follow_desired)
            self._follow_task = asyncio.create_task(self.follower.run(), name="follow-desired-weights")

    def _peers(self) -> list[str]:
        """The peers a catch-up asks: read again on every attempt; never this engine itself."""
        own = self.config.resolved_advertise_url().rstrip("/")
        return [url for url in self.weights_peers.current() if url.rstrip("/") != own]

    def _catch_up(self, backend: EngineBackend, wanted: DesiredWeights) -> None:
        """Gate the engine and bring it to ``wanted`` (``drs_engine.weights.catchup``); a catch-up
        still pending to other desired weights ends (``wanted`` is newer)."""
        if self.catch_up is not None:
            self.catch_up.end(f"newer desired weights {wanted.version}")
        self.desired_weights = wanted
        self.catch_up = CatchUp(wanted, self._peers, self.control_tokens)
        task = asyncio.create_task(
            self.catch_up.run(backend, self.control_lock, self._caught_up), name="weights-catch-up"
        )
        self._catch_up_tasks = [t for t in self._catch_up_tasks if not t.done()] + [task]

    def follow_desired(self, wanted: DesiredWeights) -> Action:
        """The stored desired weights as the mounted file names them now (``drs_engine.weights.follow``):
        decide, and catch up when no announced target binds this engine and it holds other weights."""
        backend = self.backend
        if backend is None:
            return Action.NONE
        pending = self.catch_up.desired if self.catch_up is not None and self.catch_up.pending else None
        held = Held(
            version=backend.weights_version,
            digest=self.weights_digest,
            target_binds=self.target.current() is not None,
            pending=pending,
            known=self.desired_weights,
            control_at=self.control_weights_at,
        )
        action = decide(wanted, held)
        if action is not Action.DEFER:  # a target that lapsed unreached: these desired weights decide it
            self.target.settle_lapsed(wanted.version, wanted.effective_at)
        if action is Action.CATCH_UP:
            log.warning(
                "the fleet's desired weights are %s and this engine holds %s with no target binding it: "
                "it serves nothing until it holds them",
                wanted.version,
                backend.weights_version,
            )
            self._catch_up(backend, wanted)
        elif action is Action.HOLDS:
            self.desired_weights = wanted
            if self.catch_up is not None:  # one to older desired weights: this engine holds the newer ones
                self.catch_up.end(f"holds the newer desired weights {wanted.version}")
        return action

    async def _caught_up(self, digest: str | None, reached: bool) -> None:
        """After each catch-up attempt: the digest held now (measured again after a failure)."""
        backend = self.backend
        if backend is None:
            return
        self.weights_digest = digest if reached else await backend.measure_digest()
        if reached and self.metrics is not None:
            self.metrics.set_weights_version(backend.weights_version, loaded=True)

    def weights_changed(self, version: str) -> None:
        """A weights operation of the control API succeeded: a catch-up still pending ends, and
        desired weights whose cut-over came before now are older than this word."""
        self.control_weights_at = self.target.wall()
        if self.catch_up is not None:
            self.catch_up.superseded(version)

    async def close(self) -> None:
        if self._token_task is not None:
            self._token_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._token_task
        for task in [self._follow_task, *self._catch_up_tasks]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._bring_up is not None:
            self._bring_up.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._bring_up
        if self.backend is not None:
            await self.backend.close()
        if self.gang is not None:
            await self.gang.close()

    @property
    def ready(self) -> bool:
        return self.backend is not None and (self.gang is None or self.gang.serving) and not self.weights_pending

    @property
    def weights_pending(self) -> bool:
        """Not at the desired weights it started under, or follows, yet (it serves nothing until then)."""
        return self.catch_up is not None and self.catch_up.pending

    def require_backend(self) -> EngineBackend:
        if self.backend is None:
            raise UnavailableError("the engine is still loading")
        if self.gang is not None and not self.gang.serving:
            raise UnavailableError(f"the engine's gang is not serving: {self.gang.reason}")
        return self.backend

    def require_metrics(self) -> EngineMetrics:
        if self.metrics is None:
            raise UnavailableError("the engine is still loading")
        return self.metrics

    def require_admission(self) -> Admission:
        if self.admission is None:
            raise UnavailableError("the engine is still loading")
        return self.admission

    def check_serving(self) -> None:
        """503 (``draining``) once the engine is stopping: the frontend moves the leg elsewhere."""
        if self.draining:
            raise DrainingError("the engine is draining before it stops; send this leg to another engine")
        if self.catch_up is not None and self.catch_up.pending:
            raise WeightsPendingError(self.catch_up.reason())
        self.check_awake()
        if self.weights_incomplete is not None:
            raise WeightsIncompleteError(
                f"the engine holds part of a failed weights update ({self.weights_incomplete}); "
                "it serves again after a load completes"
            )

    def check_weights_target(self, backend: EngineBackend, stamp: float) -> bool:
        """503 (``weights_pending``) for a leg of a turn started at ``stamp`` at or after the cut-over
        of an announced target this engine does not hold; True: its answer is ``weights_boundary``
        (stamped before the cut-over, served at the target) (``drs_engine.weights.target``)."""
        return self.target.admit(backend.weights_version, self.weights_digest, stamp)

    def leg_answered(self, backend: EngineBackend, stamp: float, version: str) -> None:
        """Record a leg answered at ``version`` (not boundary-marked): one answered at weights other
        than a binding target whose cut-over precedes its stamp (the announce came late) is counted
        in ``drs_engine_late_target_legs_total`` and logged."""
        digest = self.weights_digest if version == backend.weights_version else None
        if self.target.answered(stamp, version, digest):
            self.count_late_legs(1, f"a leg of a turn stamped {stamp:.3f} was answered at weights {version}")

    def count_late_legs(self, n: int, what: str) -> None:
        if n <= 0:
            return
        if self.metrics is not None:
            self.metrics.late_target_legs.inc(n)
        target = self.target.current()
        log.warning(
            "late target announce: %s, after the cut-over of target %s (%s): off-policy, counted in "
            "drs_engine_late_target_legs_total",
            what,
            None if target is None else target.version,
            None if target is None else target.effective_at,
        )

    def busy(self) -> int:
        """Legs running or queued, plus context states no decode engine has fetched yet."""
        legs = 0 if self.admission is None else self.admission.running + self.admission.waiting
        handoffs = 0 if self.backend is None else self.backend.pending_handoffs()
        return legs + handoffs

    async def drain(self, seconds: float) -> int:
        """Refuse new legs, then wait (at most ``seconds``) until nothing is busy; the busy count left."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.busy() and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return self.busy()

    def check_awake(self) -> None:
        if self.released_tags:
            tags = ", ".join(sorted(self.released_tags))
            raise UnavailableError(
                f"the engine is asleep (memory released: {tags}); "
                f"POST {CONTROL_ROUTES[ControlOp.RESUME_MEMORY]} wakes it"
            )

    def next_local_ctx_request_id(self) -> int:
        return next(self._local_ids) % LOCAL_ID_LIMIT
