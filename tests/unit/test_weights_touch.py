"""Which engine pods the reconcile touches when the desired weights change, and with what value
(``drs_operator.weights_touch.touches``, pure); the touch rolls nothing."""

from __future__ import annotations

import copy
from typing import Any

from drs_operator.api.constants import ANNOTATION_DESIRED_WEIGHTS_TOUCH
from drs_operator.manifests import desired_children
from drs_operator.rollout import compute_actions
from drs_operator.weights_touch import VALUE_CHARS, touch_value, touches
from drs_protocol.weights_digest import digest_bytes
from drs_protocol.weights_state import DesiredWeights
from hypothesis import given
from hypothesis import strategies as st
from operator_fixtures import OWNER, as_live, build, spec

STEP = DesiredWeights(version="step-7", path="/ckpt/step-7", digest=digest_bytes(b"step 7"), effective_at=1e9)


def _live_pods(desired: DesiredWeights | None = None) -> dict[str, dict[str, Any]]:
    s = spec()
    p, placement, _ = build(s)
    return as_live(desired_children(OWNER, s, p, placement, {}, desired))["Pod"]


def _annotated(pods: dict[str, dict[str, Any]], value: str, *names: str) -> dict[str, dict[str, Any]]:
    out = copy.deepcopy(pods)
    for n in names:
        meta = out[n]["metadata"]
        meta["annotations"] = {**(meta.get("annotations") or {}), ANNOTATION_DESIRED_WEIGHTS_TOUCH: value}
    return out


def test_a_fleet_without_desired_weights_is_never_touched() -> None:
    assert touch_value(None) is None
    assert touches(_live_pods(), None) == {}


def test_new_desired_weights_touch_every_engine_pod_with_their_value() -> None:
    pods = _live_pods(STEP)
    assert pods
    value = touch_value(STEP)
    assert value is not None and len(value) == VALUE_CHARS
    assert touches(pods, STEP) == dict.fromkeys(sorted(pods), value)


def test_a_pod_already_carrying_the_value_is_not_patched_again_one_with_an_older_one_is() -> None:
    pods = _live_pods(STEP)
    first, *rest = sorted(pods)
    older = touch_value(STEP.model_copy(update={"version": "step-6"}))
    assert older is not None
    pods = _annotated(_annotated(pods, older, first), str(touch_value(STEP)), *rest)
    assert touches(pods, STEP) == {first: touch_value(STEP)}
    assert touches(_annotated(pods, str(touch_value(STEP)), first), STEP) == {}


def test_a_terminating_pod_is_not_touched() -> None:
    pods = copy.deepcopy(_live_pods(STEP))
    gone = sorted(pods)[0]
    pods[gone]["metadata"]["deletionTimestamp"] = "2026-12-06T12:00:00Z"
    assert gone not in touches(pods, STEP)
    assert len(touches(pods, STEP)) == len(pods) - 1


def test_the_touch_annotation_rolls_no_pod() -> None:
    s = spec()
    p, placement, _ = build(s)
    after = desired_children(OWNER, s, p, placement, {}, STEP)
    live = as_live(after)
    live["Pod"] = _annotated(live["Pod"], str(touch_value(STEP)), *live["Pod"])
    assert compute_actions(after, live, set(), [r.index for r in p.replicas]).actions == ()


@given(
    a=st.from_regex(r"[a-z0-9][a-z0-9.-]{0,15}", fullmatch=True),
    b=st.from_regex(r"[a-z0-9][a-z0-9.-]{0,15}", fullmatch=True),
    at_a=st.floats(min_value=1e9, max_value=2e9),
    at_b=st.floats(min_value=1e9, max_value=2e9),
)
def test_the_value_changes_exactly_when_the_stored_desired_weights_do(a: str, b: str, at_a: float, at_b: float) -> None:
    one = DesiredWeights(version=a, digest=digest_bytes(b"x"), effective_at=at_a)
    two = DesiredWeights(version=b, digest=digest_bytes(b"x"), effective_at=at_b)
    assert (touch_value(one) == touch_value(two)) == (one.dump() == two.dump())
