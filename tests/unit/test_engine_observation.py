"""What status says each engine holds comes from what the operator observed of the engines
(``drs_operator.engine_observation``, pure): which engines are asked, and how their answers (or
silence) become ``weightsVersion``/``weightsDigest``, ``WeightsSplit`` and ``WeightsPending``."""

from __future__ import annotations

import copy
import dataclasses
import datetime
from typing import Any

from drs_operator.api.status import Condition, DisaggReplicaSetStatus
from drs_operator.conditions import compute_status
from drs_operator.engine_observation import Observation, catch_up_reasons, held_weights, observation_targets
from drs_operator.plan import plan
from drs_protocol.weights_digest import digest_bytes
from drs_protocol.weights_state import DesiredWeights, HeldWeights
from hypothesis import given, settings
from hypothesis import strategies as st
from operator_fixtures import OWNER, as_live, observed_fleet, spec

T0 = datetime.datetime(2026, 12, 3, 15, 0, tzinfo=datetime.UTC)
_CHILDREN, _OBSERVED = observed_fleet()
PLAN = plan(spec(), OWNER.name)
ENGINES = [e.name for r in _OBSERVED.replica_statuses for e in r.engines]
PORTS = {e.name: e.port for e in PLAN.engines}
NEW, OLD = digest_bytes(b"step-2 weights"), digest_bytes(b"step-1 weights")


def _live(pod_states: dict[str, str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Live children, every engine's rank-0 pod Ready at 10.0.0.<i>, then ``pod_states`` applied:
    ``unready``, ``no-ip`` (not yet given an address), ``missing``."""
    live = copy.deepcopy(as_live(_CHILDREN, ready=True))
    for i, name in enumerate(ENGINES):
        live["Pod"][name]["status"]["podIP"] = f"10.0.0.{i + 1}"
    for name, state in pod_states.items():
        pod = live["Pod"][name]
        if state == "unready":
            pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
        elif state == "no-ip":
            del pod["status"]["podIP"]
        elif state == "missing":
            del live["Pod"][name]
    return live


def _status(live: dict[str, Any], observations: list[Observation], desired: DesiredWeights | None) -> Any:
    observed = dataclasses.replace(
        _OBSERVED, live=live, engine_weights=held_weights(observations), desired_weights=desired
    )
    status, _ = compute_status(OWNER.name, DisaggReplicaSetStatus(), observed, T0)
    return status


def _cond(status: DisaggReplicaSetStatus, type_: str) -> Condition | None:
    return next((c for c in status.conditions if c.type == type_), None)


def test_every_serving_engine_is_asked_at_its_pod_ip_and_engine_port() -> None:
    targets = observation_targets(PLAN, _OBSERVED.replica_statuses, _live({})["Pod"])
    assert [t.engine for t in targets] == ENGINES
    assert [t.url for t in targets] == [f"http://10.0.0.{i + 1}:{PORTS[n]}" for i, n in enumerate(ENGINES)]


def test_engines_not_serving_or_without_an_address_or_unplaced_are_not_asked() -> None:
    live = _live({ENGINES[0]: "unready", ENGINES[1]: "no-ip", ENGINES[2]: "missing"})
    targets = observation_targets(PLAN, _OBSERVED.replica_statuses, live["Pod"])
    assert [t.engine for t in targets] == ENGINES[3:]
    unplaced = [r.model_copy(update={"placed": False}) if r.index == 1 else r for r in _OBSERVED.replica_statuses]
    targets = observation_targets(PLAN, unplaced, _live({})["Pod"])
    replica0 = [e.name for e in _OBSERVED.replica_statuses[0].engines]
    assert [t.engine for t in targets] == replica0


def test_ipv6_pod_ips_are_bracketed() -> None:
    live = _live({})
    live["Pod"][ENGINES[0]]["status"]["podIP"] = "fd00::1"
    targets = observation_targets(PLAN, _OBSERVED.replica_statuses, live["Pod"])
    assert targets[0].url == f"http://[fd00::1]:{PORTS[ENGINES[0]]}"


def test_an_engine_that_did_not_answer_is_unknown_and_pending_not_at_what_it_held_before() -> None:
    desired = DesiredWeights(version="step-2", digest=NEW)
    answered = [Observation(n, HeldWeights(version="step-2", digest=NEW)) for n in ENGINES]
    status = _status(_live({}), answered, desired)
    assert [e.weights_digest for r in status.replica_statuses for e in r.engines] == [NEW] * len(ENGINES)
    pending = _cond(status, "WeightsPending")
    assert pending is not None and pending.status == "False"

    silent = [Observation(ENGINES[0], None, "no answer within 2s"), *answered[1:]]
    status = _status(_live({}), silent, desired)
    first = status.replica_statuses[0].engines[0]
    assert (first.weights_version, first.weights_digest) == (None, None)
    pending = _cond(status, "WeightsPending")
    assert pending is not None and pending.status == "True"
    assert f"{ENGINES[0]} holds unknown weights" in pending.message
    degraded = _cond(status, "Degraded")
    assert degraded is not None and degraded.reason != "WeightsSplit", "an unknown engine is no split"


STATES = st.sampled_from(["ready", "unready", "no-ip", "missing"])
ANSWERS = st.one_of(st.none(), st.tuples(st.sampled_from(["step-1", "step-2"]), st.sampled_from([None, NEW, OLD])))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(STATES, ANSWERS), min_size=len(ENGINES), max_size=len(ENGINES)),
    st.tuples(st.sampled_from(["step-1", "step-2"]), st.sampled_from([None, NEW])),
)
def test_status_shows_exactly_what_the_asked_engines_answered(
    engines: list[tuple[str, tuple[str, str | None] | None]], want: tuple[str, str | None]
) -> None:
    """Any pod states and answers: an engine shows weights iff it was asked (serving, with an
    address) and answered, and then exactly its answer; ``WeightsPending`` names every other one
    and every one at other weights; ``WeightsSplit`` only ever counts engines that answered."""
    states = dict(zip(ENGINES, (s for s, _ in engines), strict=True))
    answers = dict(zip(ENGINES, (a for _, a in engines), strict=True))
    live = _live({n: s for n, s in states.items() if s != "ready"})
    targets = observation_targets(PLAN, _OBSERVED.replica_statuses, live["Pod"])
    assert {t.engine for t in targets} == {n for n, s in states.items() if s == "ready"}
    observations = [
        Observation(t.engine, HeldWeights(version=a[0], digest=a[1]) if (a := answers[t.engine]) else None)
        for t in targets
    ]
    desired = DesiredWeights(version=want[0], digest=want[1])
    status = _status(live, observations, desired)

    known = {o.engine: o.held for o in observations if o.held is not None}
    shown = {e.name: (e.weights_version, e.weights_digest) for r in status.replica_statuses for e in r.engines}
    assert shown == {n: (known[n].version, known[n].digest) if n in known else (None, None) for n in ENGINES}

    def behind(name: str) -> bool:
        held = known.get(name)
        if held is None:
            return True
        return held.digest != want[1] if held.digest and want[1] else held.version != want[0]

    pending = _cond(status, "WeightsPending")
    late = [n for n in ENGINES if behind(n)]
    assert pending is not None and pending.status == ("True" if late else "False")
    if late:
        assert pending.message.startswith(f"{len(late)}/{len(ENGINES)} engine(s)")
    degraded = _cond(status, "Degraded")
    assert degraded is not None
    if degraded.reason == "WeightsSplit":
        assert len({(h.version, h.digest) for h in known.values()}) > 1


def test_while_catching_up_engines_not_ready_are_asked_why_and_what_they_hold_stays_unknown() -> None:
    """An engine up but not Ready (catching up to the desired weights) is asked only with
    ``catching_up``; what it holds is not merged (it serves nothing); its reason is named in
    ``WeightsPending``."""
    live = _live({ENGINES[0]: "unready"})
    assert ENGINES[0] not in [t.engine for t in observation_targets(PLAN, _OBSERVED.replica_statuses, live["Pod"])]
    targets = observation_targets(PLAN, _OBSERVED.replica_statuses, live["Pod"], catching_up=True)
    assert [(t.engine, t.serving) for t in targets] == [(ENGINES[0], False), *((n, True) for n in ENGINES[1:])]
    desired = DesiredWeights(version="step-2", digest=NEW)
    why = "catching up from peers, attempt 2 failed: no peer gave the desired weights step-2"
    observations = [
        Observation(ENGINES[0], HeldWeights(version="0", digest=OLD), serving=False, catch_up=why),
        *(Observation(n, HeldWeights(version="step-2", digest=NEW)) for n in ENGINES[1:]),
    ]
    assert ENGINES[0] not in held_weights(observations)
    assert catch_up_reasons(observations) == {ENGINES[0]: why}
    observed = dataclasses.replace(
        _OBSERVED,
        live=live,
        engine_weights=held_weights(observations),
        desired_weights=desired,
        engine_catch_up=catch_up_reasons(observations),
    )
    status, _ = compute_status(OWNER.name, DisaggReplicaSetStatus(), observed, T0)
    pending = _cond(status, "WeightsPending")
    assert pending is not None and pending.status == "True"
    assert f"{ENGINES[0]} holds unknown weights ({why})" in pending.message
