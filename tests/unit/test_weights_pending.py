"""``WeightsPending``: True while an engine does not report the fleet's desired weights (by digest
when both sides have one, else by version), with one Warning Event on the flip; False once every
engine holds them; absent while the fleet has no desired weights. ``Ready`` does not change."""

from __future__ import annotations

import dataclasses
import datetime

from drs_operator.api.status import Condition, DisaggReplicaSetStatus
from drs_operator.conditions import compute_status
from drs_operator.weights_pending import NAMED_ENGINES
from drs_protocol.weights_digest import digest_bytes
from drs_protocol.weights_state import DesiredWeights, HeldWeights
from hypothesis import given, settings
from hypothesis import strategies as st
from operator_fixtures import OWNER, as_live, observed_fleet

T0 = datetime.datetime(2026, 12, 3, 10, 0, tzinfo=datetime.UTC)


_CHILDREN, _OBSERVED = observed_fleet()
BASE = dataclasses.replace(_OBSERVED, live=as_live(_CHILDREN, ready=True))
ENGINES = [e.name for r in BASE.replica_statuses for e in r.engines]
NEW, OLD = digest_bytes(b"step-2 weights"), digest_bytes(b"step-1 weights")


def _status(
    held: dict[str, HeldWeights], desired: DesiredWeights | None, previous: DisaggReplicaSetStatus | None = None
) -> tuple[DisaggReplicaSetStatus, list[tuple[str, str, str]]]:
    observed = dataclasses.replace(BASE, engine_weights=held, desired_weights=desired)
    status, notes = compute_status(OWNER.name, previous or DisaggReplicaSetStatus(), observed, T0)
    return status, [(str(n.type), n.reason, n.message) for n in notes]


def _pending(status: DisaggReplicaSetStatus) -> Condition | None:
    return next((c for c in status.conditions if c.type == "WeightsPending"), None)


def test_no_desired_weights_no_condition() -> None:
    status, notes = _status(dict.fromkeys(ENGINES, HeldWeights(version="v1")), None)
    assert _pending(status) is None
    assert not [n for n in notes if n[1].startswith("Weights") or n[1] == "AllEnginesHoldDesiredWeights"]


def test_one_engine_behind_makes_weights_pending_naming_it_with_a_warning_event_then_clears() -> None:
    desired = DesiredWeights(version="step-2", path="/ckpt/2", digest=NEW)
    held = {n: HeldWeights(version="step-2", digest=NEW) for n in ENGINES}
    held[ENGINES[1]] = HeldWeights(version="step-1", digest=OLD)
    status, notes = _status(held, desired)
    cond = _pending(status)
    assert cond is not None and (cond.status, cond.reason) == ("True", "WeightsPending")
    assert f"1/{len(ENGINES)} engine(s)" in cond.message
    assert f"{ENGINES[1]} holds step-1 ({OLD[:16]}…)" in cond.message and NEW[:16] in cond.message
    assert ENGINES[0] not in cond.message.split(": ", 1)[1]
    warnings = [n for n in notes if n[1] == "WeightsPending"]
    assert len(warnings) == 1 and warnings[0][0] == "Warning" and ENGINES[1] in warnings[0][2]
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert ready.status == "True", "Ready stays about serving capacity"

    again, notes_again = _status(held, desired, previous=status)
    assert not [n for n in notes_again if n[1] == "WeightsPending"], "one Event per flip, not per reconcile"
    assert _pending(again) == cond, "the transition time holds while it stays True"

    held[ENGINES[1]] = HeldWeights(version="step-2", digest=NEW)
    healed, notes_healed = _status(held, desired, previous=again)
    cond = _pending(healed)
    assert cond is not None and (cond.status, cond.reason) == ("False", "AllEnginesHoldDesiredWeights")
    assert [n[0] for n in notes_healed if n[1] == "AllEnginesHoldDesiredWeights"] == ["Normal"]


def test_the_same_version_with_other_bytes_is_pending_and_unknown_weights_are_pending() -> None:
    desired = DesiredWeights(version="step-2", digest=NEW)
    held = {n: HeldWeights(version="step-2", digest=NEW) for n in ENGINES[1:]}
    held[ENGINES[1]] = HeldWeights(version="step-2", digest=OLD)
    status, _ = _status(held, desired)  # ENGINES[0] reported nothing
    cond = _pending(status)
    assert cond is not None and cond.status == "True"
    assert f"{ENGINES[0]} holds unknown weights" in cond.message and f"{ENGINES[1]} holds step-2" in cond.message


def test_without_a_digest_on_one_side_the_version_decides() -> None:
    held = dict.fromkeys(ENGINES, HeldWeights(version="step-2", digest=OLD))
    status, notes = _status(held, DesiredWeights(version="step-2", path="/ckpt/2"))
    cond = _pending(status)
    assert cond is not None and cond.status == "False"
    assert not [n for n in notes if n[1] == "AllEnginesHoldDesiredWeights"], "no Event when it starts False"


def test_the_message_names_a_bounded_number_of_engines_and_counts_the_rest() -> None:
    assert len(ENGINES) > NAMED_ENGINES
    status, _ = _status({}, DesiredWeights(version="step-2"))
    cond = _pending(status)
    assert cond is not None and cond.status == "True"
    assert all(e in cond.message for e in ENGINES[:NAMED_ENGINES])
    assert ENGINES[NAMED_ENGINES] + " holds" not in cond.message
    assert cond.message.endswith(f"; and {len(ENGINES) - NAMED_ENGINES} more")


versions = st.sampled_from(["step-1", "step-2"])
digests = st.sampled_from([None, NEW, OLD])


@settings(max_examples=200, deadline=None)
@given(
    st.tuples(versions, digests),
    st.lists(st.one_of(st.none(), st.tuples(versions, digests)), min_size=len(ENGINES), max_size=len(ENGINES)),
)
def test_pending_iff_some_engine_differs_from_the_desired_weights(
    want: tuple[str, str | None], reports: list[tuple[str, str | None] | None]
) -> None:
    held = {n: HeldWeights(version=r[0], digest=r[1]) for n, r in zip(ENGINES, reports, strict=True) if r}
    status, _ = _status(held, DesiredWeights(version=want[0], digest=want[1]))

    def differs(r: tuple[str, str | None] | None) -> bool:
        if r is None:
            return True
        return r[1] != want[1] if r[1] and want[1] else r[0] != want[0]

    behind = [n for n, r in zip(ENGINES, reports, strict=True) if differs(r)]
    cond = _pending(status)
    assert cond is not None and cond.status == ("True" if behind else "False")
    if behind:
        assert cond.message.startswith(f"{len(behind)}/{len(ENGINES)} engine(s)")
        assert all(f"{n} holds" in cond.message for n in behind[:NAMED_ENGINES])
