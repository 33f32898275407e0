"""Refit fan-out over real sim engines: every engine loads the weights, failures are named, and
an engine that comes up at other weights is brought to the desired ones."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
import pytest
from drs_protocol.limits import MAX_WEIGHTS_VERSION_CHARS
from drs_protocol.weights_digest import digest_bytes, digest_files
from drs_protocol.weights_state import DesiredWeights
from drs_sidecar.control import ControlClient
from drs_sidecar.errors import FleetError, RefitBusy
from drs_sidecar.fleet import Engine
from drs_sidecar.metrics import SidecarMetrics
from drs_sidecar.refit import Refitter

from .conftest import TOKEN, as_engine, completion, refitter_over, served_version, sim_engine


async def test_a_refit_reaches_every_engine_changes_their_output_and_is_published(checkpoint: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(sim_engine()) for _ in range(4)]
        before = [await completion(e.url) for e in engines]
        async with refitter_over([as_engine(e, i // 2) for i, e in enumerate(engines)]) as (refitter, fleet):
            report = await refitter.refit(str(checkpoint), "step-100")
        assert report.complete, report.as_dict()
        assert [o.ok for o in report.outcomes] == [True] * 4
        assert [await served_version(e.url) for e in engines] == ["step-100"] * 4
        after = [await completion(e.url) for e in engines]
        assert all(a != b for a, b in zip(after, before, strict=True)), "outputs follow the weights"
        assert len({tuple(a) for a in after}) == 1, "every engine serves the same weights"
        assert fleet.published == ["step-100"]
        assert refitter.desired is not None and refitter.desired.version == "step-100"


async def test_an_engine_that_fails_is_named_and_the_refit_is_not_published(checkpoint: Path, tmp_path: Path) -> None:
    async with sim_engine() as good, sim_engine() as stopped_later:
        engines = [as_engine(good), as_engine(stopped_later)]
        stopped_url = stopped_later.url
    # both servers have stopped now; start one fresh to be the healthy engine
    async with sim_engine() as good:
        engines = [as_engine(good), Engine(name="gone", role="decode", replica=1, url=stopped_url, ready=True)]
        async with refitter_over(engines) as (refitter, fleet):
            report = await refitter.refit(str(checkpoint), "step-100")
            missing = await refitter.refit(str(tmp_path / "no-such-checkpoint"), "step-101")
        assert not report.complete
        assert [(o.engine, o.ok) for o in report.outcomes] == [(good.url, True), ("gone", False)]
        assert "unreachable" in report.failed[0].detail
        assert report.as_dict()["failed"][0]["engine"] == "gone"
        assert fleet.published == []
        assert not missing.complete
        assert missing.outcomes[0].detail.startswith("4")  # the engine's 4xx, with its reason
        assert "no-such-checkpoint" in missing.outcomes[0].detail
        assert await served_version(good.url) == "step-100", "a failed load leaves the previous weights serving"


async def test_engines_that_are_not_ready_are_pending_then_loaded_when_they_come_up(checkpoint: Path) -> None:
    async with sim_engine() as first, sim_engine() as late:
        fleet_engines = [as_engine(first), as_engine(late, 1, ready=False)]
        async with refitter_over(fleet_engines) as (refitter, fleet):
            report = await refitter.refit(str(checkpoint), "step-100")
            assert not report.complete
            assert [e.url for e in report.pending] == [late.url]
            assert fleet.published == []
            assert fleet.engine_versions[-1] == {first.url: "step-100"}  # per engine, for the operator
            assert await served_version(late.url) != "step-100"
            fleet.list[1] = as_engine(late, 1)  # it became ready (a restarted pod comes back at old weights)
            again = await refitter.reconcile_once()
            assert again is not None and [o.url for o in again.outcomes] == [late.url]
            assert await served_version(late.url) == "step-100"
            assert fleet.published == ["step-100"]
            assert fleet.engine_versions[-1] == {first.url: "step-100", late.url: "step-100"}
            assert (await refitter.reconcile_once()) is not None
            assert fleet.published == ["step-100"], "published once"


async def test_a_second_refit_while_one_runs_is_refused(checkpoint: Path) -> None:
    async with sim_engine(weightsLoadSeconds=0.5, speed=1.0) as slow, refitter_over([as_engine(slow)]) as (refitter, _):
        first = asyncio.create_task(refitter.refit(str(checkpoint), "step-100"))
        async with asyncio.timeout(5):
            while not refitter.busy:  # the first refit holds the lock (its load takes 0.5 s)
                await asyncio.sleep(0)
        with pytest.raises(RefitBusy):
            await refitter.refit(str(checkpoint), "step-101")
        assert (await first).complete
        assert refitter.desired is not None and refitter.desired.version == "step-100"


async def test_a_refit_during_the_sidecars_own_catch_up_waits_for_it_instead_of_409(
    checkpoint: Path, tmp_path: Path
) -> None:
    """The background reconcile pass holds the lock while it loads a late engine; a trainer's refit
    arriving then waits for it and runs (only a second trainer operation is refused)."""
    newer = tmp_path / "step-101"
    newer.mkdir()
    (newer / "model.safetensors").write_bytes(b"weights of step 101")
    async with (
        sim_engine() as first,
        sim_engine(weightsLoadSeconds=0.5, speed=1.0) as late,
        refitter_over([as_engine(first), as_engine(late, 1, ready=False)]) as (refitter, fleet),
    ):
        assert not (await refitter.refit(str(checkpoint), "step-100")).complete
        fleet.list[1] = as_engine(late, 1)  # it came up at its old weights
        catch_up = asyncio.create_task(refitter.reconcile_once())
        async with asyncio.timeout(5):
            while not refitter._lock.locked():  # the pass holds the lock (its load takes 0.5 s)
                await asyncio.sleep(0)
        assert not refitter.busy, "a reconcile pass is not the trainer's operation"
        refit = asyncio.create_task(refitter.refit(str(newer), "step-101"))
        async with asyncio.timeout(5):
            while not refitter.busy:
                await asyncio.sleep(0)
        with pytest.raises(RefitBusy):  # a second trainer operation meanwhile is refused
            await refitter.refit(str(newer), "step-102")
        assert not catch_up.done(), "the trainer's refit waited for the pass"
        assert (await catch_up) is not None
        report = await refit
        assert report.complete and len(report.outcomes) == 2
        assert await served_version(first.url) == await served_version(late.url) == "step-101"


@pytest.mark.parametrize(
    ("path", "version", "field"),
    [("", "v1", "path"), ("/ckpt", "", "version"), ("/ckpt", "v" * (MAX_WEIGHTS_VERSION_CHARS + 1), "version")],
)
async def test_a_refit_no_engine_would_accept_is_refused_before_any_call(path: str, version: str, field: str) -> None:
    async with refitter_over([]) as (refitter, fleet):
        with pytest.raises(ValueError, match=f"^{field}:"):
            await refitter.refit(path, version)
        assert refitter.desired is None and fleet.published == []


async def test_a_refit_that_loads_nowhere_leaves_the_desired_weights_as_they_were(
    checkpoint: Path, tmp_path: Path
) -> None:
    async with sim_engine() as engine, refitter_over([as_engine(engine)]) as (refitter, fleet):
        assert (await refitter.refit(str(checkpoint), "step-100")).complete
        typo = await refitter.refit(str(tmp_path / "step-1O1"), "step-101")
        assert not typo.complete and not any(o.ok for o in typo.outcomes)
        assert refitter.desired is not None and refitter.desired.version == "step-100"
        again = await refitter.reconcile_once()
        assert again is not None and again.outcomes == [], "nothing to catch up: no failing loads every pass"
        assert await served_version(engine.url) == "step-100"
        assert fleet.published == ["step-100"]


async def test_an_engine_that_keeps_failing_its_catch_up_load_is_retried_with_back_off(
    checkpoint: Path,
) -> None:
    async with (
        sim_engine() as good,
        sim_engine() as flaky,
        refitter_over([as_engine(good), as_engine(flaky, 1)]) as (refitter, _),
    ):
        assert (await refitter.refit(str(checkpoint), "step-100")).complete
        # the checkpoint disappears, and the flaky engine comes back at other weights
        moved = checkpoint.with_name("moved")
        checkpoint.rename(moved)
        other = moved / "model.safetensors"
        async with httpx.AsyncClient() as client:
            response = await client.post(
                flaky.url + "/control/weights/load",
                json={"path": str(other), "version": "stale"},
                headers={"authorization": f"Bearer {TOKEN}"},
            )
            assert response.status_code == 200
        first = await refitter.reconcile_once()
        assert first is not None and [o.ok for o in first.outcomes] == [False]
        second = await refitter.reconcile_once()
        assert second is not None and second.outcomes == [], "backing off: not retried on the next pass"
        moved.rename(checkpoint)


async def test_a_load_that_moves_nothing_is_caught_by_its_digest_and_named(checkpoint: Path) -> None:
    """The injected fault of the sim double: the load answers 200 under the new version and keeps
    the bytes it had. The other engines agree on the digest, so the odd one out fails by name."""
    async with contextlib.AsyncExitStack() as stack:
        good = [await stack.enter_async_context(sim_engine()) for _ in range(2)]
        liar = await stack.enter_async_context(sim_engine(faultLoadMovesNothing=True))
        engines = [as_engine(e, i) for i, e in enumerate([*good, liar])]
        async with refitter_over(engines) as (refitter, fleet):
            report = await refitter.refit(str(checkpoint), "step-100")
            assert await served_version(liar.url) == "step-100", "the engine itself claims the new version"
            assert not report.complete and fleet.published == []
            assert [o.engine for o in report.failed] == [liar.url]
            assert "moved other bytes" in report.failed[0].detail
            assert report.digest == digest_files(checkpoint) == refitter.desired.digest  # type: ignore[union-attr]
            held = fleet.engine_weights[-1]
            assert held[liar.url].version == "step-100" and held[liar.url].digest != report.digest
            assert {held[e.url].digest for e in good} == {report.digest}
            again = await refitter.reconcile_once()  # the liar is behind by digest: loaded again, fails again
            assert again is not None and [(o.engine, o.ok) for o in again.outcomes] == [(liar.url, False)]


async def test_the_trainers_digest_decides_and_a_wrong_one_fails_every_engine(checkpoint: Path) -> None:
    async with sim_engine() as a, sim_engine() as b, refitter_over([as_engine(a), as_engine(b, 1)]) as (refitter, _):
        sent = digest_files(checkpoint)
        assert (await refitter.refit(str(checkpoint), "step-100", sent)).complete
        other = digest_bytes(b"not what was written")
        wrong = await refitter.refit(str(checkpoint), "step-101", other)
        assert not wrong.complete and len(wrong.failed) == 2
        assert all(other in o.detail and "the trainer's" in o.detail for o in wrong.failed)
        assert refitter.desired is not None and refitter.desired.version == "step-100", "kept as it was"
        with pytest.raises(ValueError, match=r"^digest:"):
            await refitter.refit(str(checkpoint), "step-102", "sha256:abc")


async def test_engines_that_disagree_with_no_majority_all_fail(checkpoint: Path) -> None:
    async with (
        sim_engine() as a,
        sim_engine(faultLoadMovesNothing=True) as b,
        refitter_over([as_engine(a), as_engine(b, 1)]) as (refitter, _),
    ):
        report = await refitter.refit(str(checkpoint), "step-100")
        assert not report.complete and report.digest is None
        assert len(report.failed) == 2 and all("disagree" in o.detail for o in report.failed)


async def test_the_desired_weights_are_stored_before_any_load_and_outlive_the_sidecar(
    checkpoint: Path, tmp_path: Path
) -> None:
    async with sim_engine() as engine, sim_engine() as late:
        async with refitter_over([as_engine(engine)]) as (refitter, fleet):
            report = await refitter.refit(str(checkpoint), "step-100")
            first = DesiredWeights(version="step-100", path=str(checkpoint), effective_at=report.effective_at)
            assert report.effective_at is not None  # the refit's cut-over is stored with it
            assert fleet.desires[0] == first, "stored before the engines were called"
            assert fleet.desires[-1] == first.model_copy(update={"digest": report.digest})
            assert report.digest == digest_files(checkpoint)
            typo = await refitter.refit(str(tmp_path / "step-1O1"), "step-101")
            assert not typo.complete
            assert fleet.desires[-2].version == "step-101"  # type: ignore[union-attr]
            assert fleet.desires[-1] == refitter.desired and refitter.desired.version == "step-100"
        # a new sidecar (its trainer pod restarted) over the same resource, and an engine that came up at its start weights
        fleet.list.append(as_engine(late, 1))
        control = ControlClient(TOKEN, call_s=5.0, load_s=30.0)
        try:
            again = Refitter(fleet, control, SidecarMetrics())
            assert again.desired is None
            assert await again.restore() == fleet.desires[-1]
            caught_up = await again.reconcile_once()
            assert caught_up is not None and [(o.engine, o.ok) for o in caught_up.outcomes] == [(late.url, True)]
            assert await served_version(late.url) == "step-100"
        finally:
            await control.close()


async def test_a_refit_that_cannot_store_its_desired_weights_is_refused_before_any_load(checkpoint: Path) -> None:
    async with sim_engine() as engine, refitter_over([as_engine(engine)]) as (refitter, fleet):

        async def unwritable(weights: DesiredWeights | None) -> None:
            raise FleetError("recording the desired weights: 403 Forbidden")

        fleet.desire = unwritable  # type: ignore[method-assign]
        with pytest.raises(FleetError, match="403"):
            await refitter.refit(str(checkpoint), "step-100")
        assert await served_version(engine.url) == "0", "no engine was called"
        assert refitter.desired is None
