"""A refit's cut-over (``drs_protocol.cutover``), with real sim engines: ``effective_at`` is in the
future when announced, stored with the desired weights and in the report; no engine loads before
it; turns that started before it are served at the old weights, those after it wait for the new
ones; a CUDA IPC refit announces its target too and withdraws it when no engine took the weights."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from drs_protocol.control import TrainerIpcUpdate
from drs_protocol.cutover import DEFAULT_CUTOVER_MARGIN_S, MIN_CUTOVER_MARGIN_S, cutover_margin
from drs_protocol.routes import CONTROL_WEIGHTS
from drs_protocol.weights_digest import digest_files

from .conftest import TOKEN, ListFleet, as_engine, sim_engine
from .test_targets import WAIT_S, refitter, refused_pending, target_of, turn

MARGIN_S = 1.0


async def held_version(url: str) -> str:
    async with httpx.AsyncClient(timeout=10.0) as client:
        answer = await client.get(url + CONTROL_WEIGHTS, headers={"authorization": f"Bearer {TOKEN}"})
    version: str = answer.json()["weights_version"]
    return version


@pytest.mark.parametrize("fold", [False, True], ids=["announce round", "loads carry the target"])
async def test_a_refit_cuts_over_at_an_instant_in_the_future_and_loads_nothing_before_it(
    checkpoint: Path, fold: bool
) -> None:
    async with sim_engine(weightsLoadSeconds=0.0) as a:
        fleet = ListFleet([as_engine(a)])
        async with refitter(fleet, cutover_margin_s=MARGIN_S) as r:
            r.targets.fold = fold
            await r.reconcile_once()
            called = time.time()
            refit = asyncio.create_task(r.refit(str(checkpoint), "step-100", digest_files(checkpoint)))
            deadline = time.monotonic() + WAIT_S
            while (target := await target_of(a)) is None:
                assert time.monotonic() < deadline, "the target was never announced"
                await asyncio.sleep(0.01)
            cut = float(target["effective_at"])
            before = await turn(a, cut - 0.01)  # a turn that started before the cut-over
            held_before = []
            while time.time() < cut - 0.2:  # the window before the cut-over: the old weights stay
                held_before.append(await held_version(a.url))
                await asyncio.sleep(0.02)
            after = asyncio.create_task(turn(a, cut + 0.01))  # refused until the load, or served after it
            report = await asyncio.wait_for(refit, WAIT_S)
            after_answer = await after
            final = await held_version(a.url)
    assert called + MARGIN_S * 0.99 <= cut <= called + MARGIN_S + 1.0
    assert held_before and set(held_before) == {"0"}, held_before
    assert before.status_code == 200 and before.headers["x-drs-weights-version"] == "0", "loaded before the cut-over"
    assert refused_pending(after_answer) or after_answer.headers["x-drs-weights-version"] == "step-100"
    assert report.complete, report.as_dict()
    assert report.effective_at == cut
    assert report.as_dict()["cutover_margin_s"] == MARGIN_S
    assert report.announce_exceeded_margin is False
    assert fleet.desires[-1] is not None and fleet.desires[-1].effective_at == cut  # stored durably
    assert final == "step-100"


@pytest.mark.parametrize("fold", [False, True], ids=["announce round", "loads carry the target"])
async def test_the_engines_read_the_weights_during_the_margin_and_serve_them_only_from_the_cut_over(
    checkpoint: Path, fold: bool
) -> None:
    load_s, margin_s = 1.5, 2.0  # sent after the announce, the load's read overlaps the margin
    async with sim_engine(weightsLoadSeconds=load_s, speed=1.0) as a:
        fleet = ListFleet([as_engine(a)])
        async with refitter(fleet, cutover_margin_s=margin_s) as r:
            r.targets.fold = fold
            await r.reconcile_once()
            called = time.monotonic()
            refit = asyncio.create_task(r.refit(str(checkpoint), "step-100", digest_files(checkpoint)))
            deadline = time.monotonic() + WAIT_S
            while (target := await target_of(a)) is None:
                assert time.monotonic() < deadline, "the target was never announced"
                await asyncio.sleep(0.01)
            cut = float(target["effective_at"])
            held_before = []
            while time.time() < cut - 0.2:  # read by then (1.5 s), not swapped in: the old weights serve
                held_before.append(await held_version(a.url))
                await asyncio.sleep(0.05)
            report = await asyncio.wait_for(refit, WAIT_S)
            took = time.monotonic() - called
    assert held_before and set(held_before) == {"0"}, held_before
    assert report.complete, report.as_dict()
    assert report.announce_exceeded_margin is False
    assert took < margin_s + load_s - 0.3, f"the load followed the margin ({took:.2f}s): it did not overlap it"


async def test_a_restarted_sidecar_restores_the_cut_over_with_the_desired_weights(checkpoint: Path) -> None:
    async with sim_engine(weightsLoadSeconds=0.0) as a:
        fleet = ListFleet([as_engine(a)])
        async with refitter(fleet, cutover_margin_s=0.1) as r:
            report = await r.refit(str(checkpoint), "step-100")
        async with refitter(fleet) as restarted:
            restored = await restarted.restore()
    assert restored is not None and restored.effective_at == report.effective_at is not None


async def test_a_cuda_ipc_refit_announces_its_target_and_withdraws_it_when_no_engine_took_it() -> None:
    handle = {
        "size": [4],
        "stride": [1],
        "offset": 0,
        "device": 0,
        "handle": "AAAA",
        "storage_size_bytes": 4,
        "storage_offset_bytes": 0,
        "ref_counter_handle": None,
        "ref_counter_offset": 0,
        "event_handle": None,
        "event_sync_required": False,
    }
    request = TrainerIpcUpdate.model_validate(
        {
            "version": "step-7",
            "state_dict_info": {"w": [[4], "uint8"]},
            "buffers": [{"gpu_uuid": "GPU-0", "offset": 0, "nbytes": 4, "ipc": handle}],
        }
    )
    async with sim_engine() as a:  # the sim backend has no CUDA IPC: every engine refuses the update
        fleet = ListFleet([as_engine(a)])
        async with refitter(fleet, cutover_margin_s=0.1) as r:
            report = await r.ipc_update(request)
        target = await target_of(a)
        served = await turn(a, time.time())
    assert not report.complete and not any(o.ok for o in report.outcomes)
    assert report.target_announced_s is not None and report.effective_at is not None  # it was announced
    assert target is None, "no earlier desired weights: the target is withdrawn"
    assert served.status_code == 200 and served.headers["x-drs-weights-version"] == "0"
    assert [d.version if d else None for d in fleet.desires] == ["step-7", None]


async def test_a_refit_over_one_fan_out_tells_each_engine_with_its_load_and_sizes_the_next_margin_by_it(
    checkpoint: Path,
) -> None:
    """One call per engine (no announce round: ``LoadWeights.announce``); the engines' ``told_lead_s``
    give the time until the last was told, and the next refit's margin is twice it (at least the floor)."""
    async with sim_engine(weightsLoadSeconds=0.0) as a:
        fleet = ListFleet([as_engine(a)])
        # concurrency 1: one engine fits one fan-out
        async with refitter(fleet, cutover_margin_s=MIN_CUTOVER_MARGIN_S) as r:
            r.targets.fold = True
            first = await r.refit(str(checkpoint), "step-100", digest_files(checkpoint))
            told = r.targets.last_told_s
            second = await r.refit(str(checkpoint), "step-101", digest_files(checkpoint))
        async with httpx.AsyncClient(timeout=10.0) as client:
            metrics = (await client.get(a.url + "/metrics")).text
    assert first.complete and second.complete, (first.as_dict(), second.as_dict())
    assert first.cutover_margin_s == DEFAULT_CUTOVER_MARGIN_S  # nothing measured before the first
    assert first.target_announced_s is not None and told == first.target_announced_s
    assert 0 < told < DEFAULT_CUTOVER_MARGIN_S and first.announce_exceeded_margin is False
    assert second.cutover_margin_s == pytest.approx(cutover_margin(MIN_CUTOVER_MARGIN_S, told), abs=1e-4)
    assert 'op="announce_weights_target"' not in metrics, "an announce call went out beside the loads"
    assert 'drs_engine_control_ops_total{op="load_weights",status="ok"} 2.0' in metrics
