"""The scheduled cut-over (``drs_protocol.cutover``): an engine judges each leg by its turn's stamp
against the announced target's ``effective_at``: pending, served, or served and marked
``weights_boundary``; an announce that arrives after its cut-over counts the legs answered at the
old weights; a bad stamp is a 400 naming the header."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from drs_engine.errors import WeightsPendingError
from drs_engine.weights.target import TargetGate
from drs_protocol.control import WeightsTarget
from drs_protocol.cutover import (
    DEFAULT_CUTOVER_MARGIN_S,
    MAX_SWITCH_AHEAD_S,
    BadTurnStamp,
    cutover_margin,
    format_stamp,
    parse_stamp,
    told_seconds,
)
from drs_protocol.fields import HEADER_TURN_STARTED, HEADER_WEIGHTS_VERSION
from drs_protocol.lifecycle import FIELD_WEIGHTS_BOUNDARY, FIELD_WEIGHTS_VERSION, WEIGHTS_PENDING_ERROR_TYPE
from drs_protocol.routes import CONTROL_WEIGHTS, Endpoint
from pydantic import ValidationError

from .conftest import EngineFactory, auth, metric_value
from .test_weights_target import CHAT, LOAD, TARGET, checkpoint

CUT = 2_000_000_000.0  #: a cut-over on the gate's wall clock (2033)


class Clocks:
    """The gate's monotonic clock (its lease) and wall clock (stamps and cut-overs), both set by hand."""

    def __init__(self) -> None:
        self.mono = 100.0
        self.wall = CUT - 10.0

    def gate(self) -> TargetGate:
        return TargetGate(lambda: self.mono, lambda: self.wall)


def target(version: str = "v2", *, at: float | None = CUT, digest: str | None = None) -> WeightsTarget:
    return WeightsTarget(version=version, digest=digest, lease_s=30, effective_at=at)


@pytest.mark.parametrize(
    ("holds", "stamp", "outcome"),
    [
        pytest.param("v1", CUT - 0.001, "served", id="old weights, turn started before the cut-over: served"),
        pytest.param("v1", CUT, "pending", id="old weights, turn started at the cut-over: pending"),
        pytest.param("v1", CUT + 5, "pending", id="old weights, turn started after the cut-over: pending"),
        pytest.param("v2", CUT - 0.001, "boundary", id="the target, turn started before the cut-over: boundary"),
        pytest.param("v2", CUT + 5, "served", id="the target, turn started after the cut-over: served"),
    ],
)
def test_a_leg_is_pending_served_or_boundary_by_its_stamp(holds: str, stamp: float, outcome: str) -> None:
    gate = Clocks().gate()
    gate.announce(target(), "v1", None)  # announced while the engine held v1
    if outcome == "pending":
        with pytest.raises(WeightsPendingError):
            gate.admit(holds, None, stamp)
    else:
        assert gate.admit(holds, None, stamp) is (outcome == "boundary")


def test_a_target_without_a_cut_over_gates_every_new_leg_as_before() -> None:
    gate = Clocks().gate()
    gate.announce(target(at=None), "v1", None)
    with pytest.raises(WeightsPendingError):
        gate.admit("v1", None, CUT - 1000)
    assert gate.admit("v2", None, CUT - 1000) is False


def test_an_engine_told_while_it_held_the_target_marks_no_boundary_and_a_renewal_keeps_the_mark() -> None:
    clocks = Clocks()
    current = clocks.gate()
    current.announce(target(), "v2", None)  # it already held them (a reconcile's renewal after a restart)
    assert current.admit("v2", None, CUT - 1) is False
    behind = clocks.gate()
    behind.announce(target(), "v1", None)
    behind.announce(target(), "v2", None)  # renewed after its load: the same target
    assert behind.admit("v2", None, CUT - 1) is True


def test_a_late_announce_counts_the_legs_already_answered_at_the_old_weights_once() -> None:
    clocks = Clocks()
    gate = clocks.gate()
    for stamp in (CUT - 2, CUT - 1, CUT + 1, CUT + 2, CUT + 3):
        assert gate.answered(stamp, "v1", None) is False  # no target yet
    gate.answered(CUT + 4, "v2", None)  # answered at the target (another engine's load): on-policy
    clocks.wall = CUT + 5
    assert gate.announce(target(), "v1", None) == 3  # stamped at or after the cut-over, at v1
    assert gate.announce(target(), "v1", None) == 0  # a renewal does not count them again
    assert gate.answered(CUT + 6, "v1", None) is True  # admitted before the announce, finished after


def test_an_announce_on_time_counts_nothing() -> None:
    clocks = Clocks()
    gate = clocks.gate()
    gate.answered(CUT - 20, "v1", None)
    assert gate.announce(target(), "v1", None) == 0  # the wall clock is before the cut-over


@pytest.mark.parametrize(
    ("floor", "last_told", "margin"),
    [
        pytest.param(0.05, None, DEFAULT_CUTOVER_MARGIN_S, id="nothing measured yet: the default"),
        pytest.param(0.5, None, 0.5, id="nothing measured yet, a larger floor: the floor"),
        pytest.param(0.05, 0.01, 0.05, id="engines told fast: the floor"),
        pytest.param(0.05, 0.12, 0.24, id="engines told slower: twice it"),
        pytest.param(0.3, 0.1, 0.3, id="a floor above twice it: the floor"),
        pytest.param(0.05, 60.0, 5.0, id="told very late: bounded"),
    ],
)
def test_the_cut_over_margin_exceeds_the_time_until_every_engine_was_told(
    floor: float, last_told: float | None, margin: float
) -> None:
    assert cutover_margin(floor, last_told) == pytest.approx(margin)


@pytest.mark.parametrize(
    ("margin", "leads", "told"),
    [
        pytest.param(0.3, [], None, id="no engine said: unknown"),
        pytest.param(0.3, [0.25, 0.1, 0.2], 0.2, id="the engine told last decides"),
        pytest.param(0.3, [0.1, -0.2], 0.5, id="one told after the cut-over: more than the margin"),
        pytest.param(0.3, [0.4], 0.0, id="a clock behind the sidecar's: never negative"),
    ],
)
def test_the_time_until_every_engine_was_told_comes_from_their_leads(
    margin: float, leads: list[float], told: float | None
) -> None:
    assert told_seconds(margin, leads) == (None if told is None else pytest.approx(told))


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-5", "1e20", "12", ""])
def test_a_bad_stamp_is_refused_naming_the_header(value: str) -> None:
    with pytest.raises(BadTurnStamp, match=HEADER_TURN_STARTED):
        parse_stamp(value)


def test_a_stamp_survives_its_header_form() -> None:
    now = time.time()
    assert parse_stamp(format_stamp(now)) == pytest.approx(now, abs=1e-6)


@pytest.mark.parametrize("at", [0, -1, float("nan"), float("inf")])
def test_a_bad_cut_over_is_refused(at: float) -> None:
    with pytest.raises(ValidationError, match="effective_at"):
        WeightsTarget(version="v2", lease_s=5, effective_at=at)


# -- real sim engines --------------------------------------------------------------------------


async def chat(client: httpx.AsyncClient, url: str, stamp: float | None = None) -> httpx.Response:
    headers = {} if stamp is None else {HEADER_TURN_STARTED: format_stamp(stamp)}
    return await client.post(url + Endpoint.CHAT, json=CHAT, headers=headers)


async def announce_at(client: httpx.AsyncClient, url: str, version: str, at: float, **extra: Any) -> dict[str, Any]:
    body = {"version": version, "lease_s": 60, "effective_at": at, **extra}
    response = await client.post(url + TARGET, headers=auth(), json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def test_an_engine_serves_refuses_and_marks_legs_by_their_turns_stamps(
    client: httpx.AsyncClient, engine_factory: EngineFactory, tmp_path: Path
) -> None:
    step = checkpoint(tmp_path, "step-1")
    async with engine_factory("prefill", sim={"weightsLoadSeconds": 0.0}) as engine:
        cut = time.time() + 3600  # far ahead: the test decides which side of it each turn started
        await announce_at(client, engine.url, "step-1", cut)
        before_old = await chat(client, engine.url, cut - 1)
        after_old = await chat(client, engine.url, cut + 1)
        load = await client.post(engine.url + LOAD, headers=auth(), json={"path": str(step), "version": "step-1"})
        before_new = await chat(client, engine.url, cut - 1)
        after_new = await chat(client, engine.url, cut + 1)
    assert before_old.status_code == 200, before_old.text
    assert before_old.json()[FIELD_WEIGHTS_VERSION] == "0"
    assert FIELD_WEIGHTS_BOUNDARY not in before_old.json()
    assert before_old.headers[HEADER_TURN_STARTED] == format_stamp(cut - 1)
    assert after_old.status_code == 503
    assert after_old.json()["error"]["type"] == WEIGHTS_PENDING_ERROR_TYPE
    assert load.status_code == 200, load.text
    assert before_new.status_code == 200
    assert before_new.json()[FIELD_WEIGHTS_VERSION] == "step-1"
    assert before_new.json()[FIELD_WEIGHTS_BOUNDARY] == 0  # started before the cut-over, served after the load
    assert after_new.status_code == 200
    assert after_new.headers[HEADER_WEIGHTS_VERSION] == "step-1"
    assert FIELD_WEIGHTS_BOUNDARY not in after_new.json()


async def test_an_engine_called_directly_stamps_the_turn_itself(
    client: httpx.AsyncClient, engine_factory: EngineFactory
) -> None:
    async with engine_factory("prefill") as engine:
        await announce_at(client, engine.url, "step-1", time.time() + 3600)
        sent = time.time()
        served = await chat(client, engine.url)
        received = time.time()
        await announce_at(client, engine.url, "step-1", time.time() - 1)  # took effect already
        refused = await chat(client, engine.url)
    assert served.status_code == 200, served.text
    assert sent <= parse_stamp(served.headers[HEADER_TURN_STARTED]) <= received
    assert refused.status_code == 503


@pytest.mark.parametrize("value", ["yesterday", "nan", "1e20"])
async def test_a_bad_turn_stamp_is_a_400_naming_the_header(
    client: httpx.AsyncClient, engine_factory: EngineFactory, value: str
) -> None:
    async with engine_factory("prefill") as engine:
        response = await client.post(engine.url + Endpoint.CHAT, json=CHAT, headers={HEADER_TURN_STARTED: value})
    assert response.status_code == 400
    assert HEADER_TURN_STARTED in response.json()["error"]["message"]


async def test_a_late_announce_counts_the_legs_answered_at_the_old_weights(
    client: httpx.AsyncClient, engine_factory: EngineFactory
) -> None:
    async with engine_factory("prefill") as engine:
        cut = time.time()
        answered = [await chat(client, engine.url, stamp) for stamp in (cut - 5, cut + 0.001, cut + 0.002)]
        answer = await announce_at(client, engine.url, "step-1", cut)  # arrives after its cut-over
        metrics = (await client.get(engine.url + "/metrics")).text
    assert [a.status_code for a in answered] == [200, 200, 200]
    assert answer["result"]["late_legs"] == 2
    assert metric_value(metrics, "drs_engine_late_target_legs_total") == 2


async def held(client: httpx.AsyncClient, url: str) -> str:
    version: str = (await client.get(url + CONTROL_WEIGHTS, headers=auth())).json()["weights_version"]
    return version


async def test_a_load_at_a_cut_over_reads_first_and_serves_the_new_weights_only_from_it(
    client: httpx.AsyncClient, engine_factory: EngineFactory, tmp_path: Path
) -> None:
    step = checkpoint(tmp_path, "step-1")
    async with engine_factory("prefill", sim={"weightsLoadSeconds": 0.0}) as engine:
        cut = time.time() + 1.5
        await announce_at(client, engine.url, "step-1", cut)
        load = asyncio.create_task(
            client.post(
                engine.url + LOAD, headers=auth(), json={"path": str(step), "version": "step-1", "effective_at": cut}
            )
        )
        seen = []  # what the engine holds and serves while the load waits for its cut-over
        while time.time() < cut - 0.2:
            seen.append((await held(client, engine.url), (await chat(client, engine.url, cut - 1)).json()))
            await asyncio.sleep(0.05)
        answer = await load
        answered_at = time.time()
        after = await chat(client, engine.url, cut + 1)
    assert seen and {version for version, _ in seen} == {"0"}, seen
    assert all(turn[FIELD_WEIGHTS_VERSION] == "0" and FIELD_WEIGHTS_BOUNDARY not in turn for _, turn in seen)
    assert answer.status_code == 200, answer.text
    assert answered_at >= cut
    assert answer.json()["weights_version"] == "step-1"
    assert after.status_code == 200 and after.headers[HEADER_WEIGHTS_VERSION] == "step-1"


async def test_a_load_whose_cut_over_is_too_far_ahead_is_refused_naming_the_field(
    client: httpx.AsyncClient, engine_factory: EngineFactory, tmp_path: Path
) -> None:
    step = checkpoint(tmp_path, "step-1")
    async with engine_factory("prefill") as engine:
        at = time.time() + MAX_SWITCH_AHEAD_S + 30
        refused = await client.post(
            engine.url + LOAD, headers=auth(), json={"path": str(step), "version": "step-1", "effective_at": at}
        )
        version = await held(client, engine.url)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "effective_at"
    assert "ahead of this engine's clock" in refused.json()["error"]["message"]
    assert version == "0"
