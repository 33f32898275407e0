"""Everything one engine server holds: config, backend, tokenizer, metrics, admission, sleep
state and the control lock. One instance per app; nothing lives at module level, so several
servers share a process without sharing state.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any, Final

from drs_protocol.chat import load_tokenizer

from drs_engine.backends import create_backend
from drs_engine.backends.base import EngineBackend
from drs_engine.config import BackendName, EngineConfig
from drs_engine.errors import DrainingError, UnavailableError
from drs_engine.metrics import EngineMetrics

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
    def __init__(self, config: EngineConfig, *, control_token: str | None) -> None:
        self.config = config
        self.control_token = control_token
        self.tokenizer: Any = None
        self.backend: EngineBackend | None = None
        self.released_tags: set[str] = set()
        self.control_lock = asyncio.Lock()
        self._local_ids = itertools.count(1)
        self.metrics: EngineMetrics | None = None
        self.admission: Admission | None = None
        self.draining = False

    async def start(self) -> None:
        """Load the tokenizer and the backend; the server is healthy afterwards."""
        path = self.config.model.tokenizer
        if path is None and self.config.backend is BackendName.TRTLLM:
            path = self.config.model.path
        self.tokenizer = await asyncio.to_thread(load_tokenizer, path)
        backend = create_backend(
            self.config, vocab_size=int(self.tokenizer.vocab_size), eos_token_id=int(self.tokenizer.eos_token_id)
        )
        metrics = EngineMetrics(backend=backend.name, role=self.config.role.value, test_double=backend.test_double)
        await backend.start()
        metrics.set_weights_version(backend.weights_version, loaded=False)
        self.metrics = metrics
        self.admission = Admission(limit=self.config.max_batch_size, metrics=metrics)
        self.backend = backend

    async def close(self) -> None:
        if self.backend is not None:
            await self.backend.close()

    @property
    def ready(self) -> bool:
        return self.backend is not None

    def require_backend(self) -> EngineBackend:
        if self.backend is None:
            raise UnavailableError("the engine is still loading")
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
        self.check_awake()

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
                f"the engine is asleep (memory released: {tags}); POST /control/memory/resume wakes it"
            )

    def next_local_ctx_request_id(self) -> int:
        return next(self._local_ids) % LOCAL_ID_LIMIT
