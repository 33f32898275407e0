"""The sidecar announces the target weights to every engine before any load (real sim engines):
engines refuse new legs from the announce until they hold the target; a refit that reached no
engine, or could not start, gives the engines back at once; a target a dead sidecar left lapses."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_engine.server.runner import RunningEngine
from drs_protocol.cutover import format_stamp
from drs_protocol.fields import HEADER_TURN_STARTED
from drs_protocol.lifecycle import WEIGHTS_PENDING_ERROR_TYPE
from drs_protocol.routes import CONTROL_WEIGHTS
from drs_protocol.weights_digest import digest_files
from drs_protocol.weights_state import DesiredWeights
from drs_sidecar.control import ControlClient
from drs_sidecar.errors import FleetError
from drs_sidecar.fleet import Engine
from drs_sidecar.metrics import SidecarMetrics
from drs_sidecar.refit import Refitter
from drs_sidecar.targets import TargetAnnouncer

from .conftest import CHAT, TOKEN, ListFleet, as_engine, sim_engine

WAIT_S = 20.0
BODY: dict[str, Any] = {"model": "sim-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class HeldFleet(ListFleet):
    """A fleet whose reads can be held (a slow Kubernetes API) or made to fail."""

    def __init__(self, engines: list[Engine]) -> None:
        super().__init__(engines)
        self.release = asyncio.Event()
        self.release.set()
        self.reading = asyncio.Event()
        self.fail = False

    async def engines(self) -> list[Engine]:
        self.reading.set()
        await self.release.wait()
        if self.fail:
            raise FleetError("DisaggReplicaSet default/x: 503 Service Unavailable")
        return await super().engines()


@contextlib.asynccontextmanager
async def refitter(fleet: ListFleet, **kwargs: Any) -> Any:
    control = ControlClient(TOKEN, call_s=5.0, load_s=30.0)
    try:
        yield Refitter(fleet, control, SidecarMetrics(), concurrency=1, **kwargs)
    finally:
        await control.close()


async def turn(engine: RunningEngine, stamp: float | None = None) -> httpx.Response:
    """A turn (``stamp``: the instant it started, as a frontend stamps it; None: the engine's receipt time)."""
    headers = {} if stamp is None else {HEADER_TURN_STARTED: format_stamp(stamp)}
    async with httpx.AsyncClient(timeout=10.0) as client:
        return await client.post(engine.url + CHAT, json=BODY, headers=headers)


def after_cutover(target: dict[str, Any] | None) -> float:
    """A stamp just after the cut-over of an engine's target (a turn that started once it took effect)."""
    assert target is not None and target["effective_at"] is not None, target
    return float(target["effective_at"]) + 0.001


async def target_of(engine: RunningEngine) -> dict[str, Any] | None:
    async with httpx.AsyncClient(timeout=10.0) as client:
        answer = await client.get(engine.url + CONTROL_WEIGHTS, headers={"authorization": f"Bearer {TOKEN}"})
    target: dict[str, Any] | None = answer.json().get("target")
    return target


def refused_pending(response: httpx.Response) -> bool:
    return response.status_code == 503 and response.json()["error"]["type"] == WEIGHTS_PENDING_ERROR_TYPE


async def test_the_target_is_announced_to_the_known_engines_before_the_fleet_is_read_and_any_load(
    checkpoint: Path,
) -> None:
    async with sim_engine() as a, sim_engine() as b:
        fleet = HeldFleet([as_engine(a), as_engine(b, 1)])
        async with refitter(fleet) as r:
            await r.reconcile_once()  # the sidecar's pass: it knows the engines from here on
            fleet.release.clear()
            fleet.reading.clear()
            refit = asyncio.create_task(r.refit(str(checkpoint), "step-100", digest_files(checkpoint)))
            await asyncio.wait_for(fleet.reading.wait(), WAIT_S)  # the refit's fleet read is held ...
            deadline = time.monotonic() + WAIT_S
            while not all([await target_of(a), await target_of(b)]):  # ... its announce is not
                assert time.monotonic() < deadline, "the target was not announced while the fleet was read"
                await asyncio.sleep(0.01)
            during = [
                await turn(a, after_cutover(await target_of(a))),
                await turn(b, after_cutover(await target_of(b))),
            ]
            assert fleet.desires == [], "announced before the desired weights were even stored"
            fleet.release.set()
            report = await asyncio.wait_for(refit, WAIT_S)
        after = [await turn(a), await turn(b)]
    assert all(refused_pending(r) for r in during), [r.text for r in during]
    assert report.complete, report.as_dict()
    assert report.target_announced_s is not None
    assert [r.status_code for r in after] == [200, 200]
    assert {r.headers["x-drs-weights-version"] for r in after} == {"step-100"}


async def test_an_engine_the_fresh_read_adds_is_told_before_the_first_load(checkpoint: Path) -> None:
    """No earlier read: the announce covers the fleet as read, before ``concurrency=1`` loads the
    slow first engine; the second, not loaded yet, already refuses new legs."""
    async with sim_engine(speed=1.0, weightsLoadSeconds=1.5) as slow, sim_engine(weightsLoadSeconds=0.0) as fast:
        fleet = ListFleet([as_engine(slow), as_engine(fast, 1)])
        async with refitter(fleet) as r:
            refit = asyncio.create_task(r.refit(str(checkpoint), "step-100"))
            deadline = time.monotonic() + WAIT_S
            while (await target_of(fast)) is None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            waiting = await turn(fast, after_cutover(await target_of(fast)))  # the slow engine's load holds the slot
            report = await asyncio.wait_for(refit, WAIT_S)
    assert refused_pending(waiting), waiting.text
    assert report.complete, report.as_dict()


async def test_a_refit_that_reached_no_engine_gives_the_engines_back_at_once(tmp_path: Path) -> None:
    async with sim_engine() as a, sim_engine() as b:
        fleet = ListFleet([as_engine(a), as_engine(b, 1)])
        async with refitter(fleet) as r:
            report = await r.refit(str(tmp_path / "no-such-checkpoint"), "step-101")
        served = [await turn(a), await turn(b)]
        targets = [await target_of(a), await target_of(b)]
    assert not any(o.ok for o in report.outcomes)
    assert [s.status_code for s in served] == [200, 200]
    assert targets == [None, None], "no earlier desired weights: the target is withdrawn"


async def test_a_rollback_announces_the_previous_desired_weights(checkpoint: Path, tmp_path: Path) -> None:
    async with sim_engine() as a:
        fleet = ListFleet([as_engine(a)])
        async with refitter(fleet) as r:
            assert (await r.refit(str(checkpoint), "step-100")).complete
            await r.refit(str(tmp_path / "no-such-checkpoint"), "step-101")
        served = await turn(a)
        target = await target_of(a)
    assert served.status_code == 200 and served.headers["x-drs-weights-version"] == "step-100"
    assert target is not None and target["version"] == "step-100" and target["held"] is True


async def test_a_refit_whose_fleet_read_fails_gives_the_engines_back(checkpoint: Path) -> None:
    async with sim_engine() as a:
        fleet = HeldFleet([as_engine(a)])
        async with refitter(fleet) as r:
            await r.reconcile_once()
            fleet.fail = True
            with pytest.raises(FleetError):
                await r.refit(str(checkpoint), "step-100")
        served = await turn(a)
    assert served.status_code == 200, served.text


async def test_a_target_left_by_a_sidecar_that_died_before_its_loads_lapses_after_its_lease() -> None:
    """Announce, then nothing (the sidecar's process is gone): the engine refuses new legs for one
    lease, then serves what it holds again."""
    lease_s = 1.0
    async with sim_engine() as a:
        control = ControlClient(TOKEN, call_s=5.0, load_s=30.0)
        try:
            announced = await TargetAnnouncer(control, SidecarMetrics(), lease_s=lease_s).announce(
                [a.url], DesiredWeights(version="step-100", path="/ckpt/step-100")
            )
        finally:
            await control.close()
        told = time.monotonic()
        first = await turn(a)
        while refused_pending(served := await turn(a)):
            assert time.monotonic() - told < WAIT_S, "the target never lapsed"
            await asyncio.sleep(0.05)
        lapsed_after = time.monotonic() - told
    assert announced.reached == [a.url]
    assert refused_pending(first)
    assert served.status_code == 200 and served.headers["x-drs-weights-version"] == "0"
    assert lapsed_after >= lease_s * 0.9


async def test_a_reconcile_pass_gates_an_engine_behind_the_desired_weights(checkpoint: Path) -> None:
    """A restarted sidecar restores the desired weights; its pass announces them to an engine that
    holds others before it loads it (a failing load leaves it gated, not serving old weights)."""
    async with sim_engine() as a:
        fleet = ListFleet([as_engine(a)])
        fleet.desires.append(DesiredWeights(version="step-100", path="/no/such/checkpoint"))
        async with refitter(fleet) as r:
            await r.restore()
            await r.reconcile_once()
        served = await turn(a)
    assert refused_pending(served), served.text


async def test_announcing_off_leaves_the_engines_ungated(checkpoint: Path) -> None:
    async with sim_engine() as a:
        async with refitter(ListFleet([as_engine(a)]), target_lease_s=0) as r:
            report = await r.refit(str(checkpoint), "step-100")
        target = await target_of(a)
    assert report.complete
    assert target is None


async def test_a_refit_arriving_during_a_reconcile_pass_announces_again_after_it(
    checkpoint: Path, tmp_path: Path
) -> None:
    """The pass in flight announces the previous target to an engine behind and loads it; the
    refit's announce went out first, so the refit announces once more before its own load: the
    engine holding the previous weights refuses new legs during that load."""
    previous = tmp_path / "step-99"
    previous.mkdir()
    (previous / "model.safetensors").write_bytes(b"weights of step 99")
    async with sim_engine(speed=1.0, weightsLoadSeconds=1.0) as a:
        fleet = HeldFleet([as_engine(a)])
        fleet.desires.append(DesiredWeights(version="step-99", path=str(previous)))
        async with refitter(fleet) as r:
            await r.restore()  # knows the engine and the desired step-99, which it does not hold
            fleet.release.clear()
            fleet.reading.clear()
            reconcile = asyncio.create_task(r.reconcile_once())
            await asyncio.wait_for(fleet.reading.wait(), WAIT_S)  # the pass holds the lock, reading
            refit = asyncio.create_task(r.refit(str(checkpoint), "step-100"))
            deadline = time.monotonic() + WAIT_S
            while ((await target_of(a)) or {}).get("version") != "step-100":
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            fleet.release.set()  # the pass announces step-99, loads it; then the refit runs
            seen: httpx.Response | None = None
            while not refit.done():
                target = await target_of(a)
                async with httpx.AsyncClient(timeout=10.0) as client:
                    held = (
                        await client.get(a.url + CONTROL_WEIGHTS, headers={"authorization": f"Bearer {TOKEN}"})
                    ).json()["weights_version"]
                if held == "step-99" and target is not None and target["version"] == "step-100":
                    seen = await turn(a, after_cutover(target))
                    break
                await asyncio.sleep(0.01)
            await asyncio.wait_for(reconcile, WAIT_S)
            report = await asyncio.wait_for(refit, WAIT_S)
    assert seen is not None, "the engine held step-99 with no step-100 target during the refit's load"
    assert refused_pending(seen), seen.text
    assert report.complete, report.as_dict()
