"""The background health prober: ``GET /health`` on every engine, every ``interval`` seconds.

Its results feed the pools (an engine whose probe fails is no candidate; one that answers again
leaves its cool-down early) and ``GET /ready`` (200 while at least one prefill and one decode
engine answer).
"""

from __future__ import annotations

import asyncio
import logging

from drs_protocol import routes

from drs_frontend.engines import EnginePool
from drs_frontend.errors import UpstreamError
from drs_frontend.metrics import FrontendMetrics
from drs_frontend.upstream import UpstreamClient

log = logging.getLogger(__name__)


class HealthProber:
    def __init__(
        self,
        pools: list[EnginePool],
        upstream: UpstreamClient,
        metrics: FrontendMetrics,
        *,
        interval: float,
        timeout: float,
    ) -> None:
        self.pools = pools
        self.upstream = upstream
        self.metrics = metrics
        self.interval = interval
        self.timeout = timeout
        self.rounds = 0

    async def run(self) -> None:
        """Probe forever (until cancelled)."""
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(pool, url) for pool in self.pools for url in pool.urls))
        self.rounds += 1

    async def _probe(self, pool: EnginePool, url: str) -> None:
        try:
            ok = (await self.upstream.get(url + routes.HEALTH, self.timeout)).status == 200
        except UpstreamError:
            ok = False
        engine = pool.engines.get(url)
        if engine is None:  # a fallback engine dropped (engine_info / reload) while its probe was out
            return
        before = engine.probe_ok
        pool.record_probe(url, ok)
        self.metrics.engine_up.labels(role=pool.role, engine=url).set(1 if ok else 0)
        if before is not ok:
            log.info("%s engine %s is %s", pool.role, url, "up" if ok else "down")

    def ready(self) -> bool:
        return all(pool.answering() > 0 for pool in self.pools)
