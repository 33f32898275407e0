"""An engine whose name does not resolve yet (its pod is ready, its DNS record not published) is
looked up again within the client's ``resolve_s``; a refused connection is not retried.

The resolver is a double (``LateRecords``): it answers "temporary failure in name resolution" for
the first lookups of a name, as CoreDNS does before its watch has the pod's EndpointSlice, then
the loopback address of a real sim engine."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

from aiohttp.abc import AbstractResolver, ResolveResult
from drs_sidecar.control import ControlClient
from drs_sidecar.fleet import Engine
from drs_sidecar.metrics import SidecarMetrics
from drs_sidecar.refit import Refitter

from .conftest import TOKEN, ListFleet, raw_engine, served_version, sim_engine


class LateRecords(AbstractResolver):
    """A resolver double: every name fails its first ``failures`` lookups, then is 127.0.0.1."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.lookups: list[str] = []

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        self.lookups.append(host)
        if self.lookups.count(host) <= self.failures:
            raise OSError(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [
            ResolveResult(
                hostname=host, host="127.0.0.1", port=port, family=socket.AF_INET, proto=0, flags=socket.AI_NUMERICHOST
            )
        ]

    async def close(self) -> None:
        return None


def _named(url: str, name: str) -> str:
    """``url`` (http://127.0.0.1:PORT) with ``name`` for its host, as the fleet's status lists it."""
    port = url.rsplit(":", 1)[1]
    return f"http://{name}:{port}"


async def _refit(url: str, checkpoint: Path, **client: Any) -> tuple[Any, float]:
    control = ControlClient(TOKEN, call_s=5.0, load_s=30.0, **client)
    fleet = ListFleet([Engine(name="r1-prefill-0", role="prefill", replica=1, url=url, ready=True)])
    started = time.perf_counter()
    try:
        report = await Refitter(fleet, control, SidecarMetrics(), concurrency=4).refit(str(checkpoint), "step-100")
    finally:
        await control.close()
    return report, time.perf_counter() - started


async def test_a_refit_waits_for_a_ready_engine_whose_name_is_not_published_yet(checkpoint: Path) -> None:
    records = LateRecords(failures=3)
    async with sim_engine() as engine:
        name = "r1-prefill-0.fleet-engines.ns.svc"
        report, _ = await _refit(_named(engine.url, name), checkpoint, resolver=records)
        assert report.complete, report.as_dict()
        assert await served_version(engine.url) == "step-100"
    assert records.lookups.count(name) >= 4, records.lookups  # three failed lookups, then the record


async def test_a_name_that_never_resolves_fails_within_the_resolve_budget(checkpoint: Path) -> None:
    records = LateRecords(failures=10**6)
    report, took = await _refit(
        "http://r9-decode-0.fleet-engines.ns.svc:8000", checkpoint, resolver=records, resolve_s=0.5
    )
    assert not report.complete
    assert "ClientConnectorDNSError" in report.failed[0].detail, report.as_dict()
    assert len(records.lookups) >= 3, records.lookups  # looked up again (0.1 s, 0.2 s back-off) ...
    assert took < 5.0, took  # ... and given up near the 0.5 s budget, not at the call's 30 s


async def test_a_refused_connection_is_not_retried(checkpoint: Path) -> None:
    records = LateRecords(failures=0)
    async with sim_engine() as stopped:
        url = _named(stopped.url, "r0-decode-0.fleet-engines.ns.svc")
    report, _ = await _refit(url, checkpoint, resolver=records)
    assert not report.complete
    assert "ClientConnectorError" in report.failed[0].detail, report.as_dict()
    assert len(records.lookups) == 1, records.lookups


async def test_lookups_and_the_exchange_together_keep_within_the_calls_timeout() -> None:
    """Four failed lookups (0.1 + 0.2 + 0.4 + 0.8 s of back-off), then an engine that accepts and
    never answers: the call ends at its 2 s timeout, not 1.5 s of lookups plus another 2 s."""
    records = LateRecords(failures=4)

    async def hang(_reader: asyncio.StreamReader, _writer: asyncio.StreamWriter, _nth: int) -> None:
        return None  # read nothing, answer nothing: a hung engine

    control = ControlClient(TOKEN, call_s=5.0, load_s=30.0, resolver=records)
    async with raw_engine(hang) as port:
        started = time.perf_counter()
        try:
            result = await control.health(f"http://r2-decode-0.fleet-engines.ns.svc:{port}", timeout=2.0)
        finally:
            took = time.perf_counter() - started
            await control.close()
    assert result.timed_out and not result.ok, result
    assert len(records.lookups) == 5, records.lookups  # four failures, then the record
    assert 1.9 < took < 2.75, took
