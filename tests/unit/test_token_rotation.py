"""The operator's token rotation (``drs_operator.manifests.rotation``), pure: a request on the
DisaggReplicaSet walks each Secret through ``next`` then ``previous``, one window each, keeping its
memory on the Secret; the window annotation is checked; no token is in an Event."""

from __future__ import annotations

import base64
import datetime
from typing import Any

import pytest
from drs_operator.api.constants import EventReason
from drs_operator.api.status import MAX_LAGGING_PODS
from drs_operator.kube.engines import secret_token
from drs_operator.manifests.rotation import (
    CONFIRM_POLL_S,
    WINDOW_S,
    generation,
    recreated_secret,
    rotation_status,
    rotation_step,
    rotation_window,
    secret_keys,
)
from drs_operator.manifests.secrets import build_serving_secret
from drs_operator.status_write import status_patch
from operator_fixtures import OWNER

T0 = datetime.datetime(2026, 12, 5, 16, 0, tzinfo=datetime.UTC)
PHASE = "disagg.dev/token-rotation-phase"


def live(secret: dict[str, Any]) -> dict[str, Any]:
    """What the API answers for a written Secret: ``data`` base64, a resourceVersion."""
    keys = secret_keys(secret)
    meta = {**secret["metadata"], "resourceVersion": "1"}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in keys.items()},
    }


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def test_a_request_walks_the_secret_through_both_phases_one_window_each() -> None:
    secret = live(build_serving_secret(OWNER, "A"))
    assert rotation_step(secret, None, 10, T0).secret is None  # never asked: nothing
    started = rotation_step(secret, "r1", 10, T0)
    assert started.secret is not None and started.due_in_s == 10
    keys = secret_keys(started.secret)
    assert keys["token"] == "A" and len(keys["next"]) == 64
    assert started.note is not None and started.note.reason is EventReason.TOKEN_ROTATION_STARTED
    secret = live(started.secret)
    assert secret_token({"s": secret}, "s") == "A"  # the operator still presents the old token
    waiting = rotation_step(secret, "r1", 10, at(4))
    assert waiting.secret is None and waiting.due_in_s == pytest.approx(6)
    switched = rotation_step(secret, "r1", 10, at(10))
    assert switched.secret is not None
    assert secret_keys(switched.secret) == {"token": keys["next"], "previous": "A", "generation": "2"}
    assert switched.note is not None and switched.note.reason is EventReason.TOKEN_ROTATION_SWITCHED
    secret = live(switched.secret)
    assert secret["metadata"]["annotations"][PHASE] == "previous"
    assert rotation_step(secret, "r1", 10, at(15)).secret is None
    done = rotation_step(secret, "r1", 10, at(20))
    assert done.secret is not None and secret_keys(done.secret) == {"token": keys["next"], "generation": "3"}
    assert PHASE not in done.secret["metadata"]["annotations"] and done.due_in_s is None
    secret = live(done.secret)
    assert rotation_step(secret, "r1", 10, at(100)).secret is None  # the same request is not redone
    again = rotation_step(secret, "r2", 10, at(100))  # a new value rotates again
    assert again.secret is not None and secret_keys(again.secret)["token"] == keys["next"]
    for step in (started, switched, done):
        assert step.note is not None and "A" not in step.note.message.split() and keys["next"] not in step.note.message
    assert done.secret["metadata"]["ownerReferences"] == secret["metadata"]["ownerReferences"]


def test_a_recreated_secret_switches_to_its_token_after_one_window() -> None:
    built = recreated_secret(build_serving_secret(OWNER, "N"), "r0", T0)
    secret = live(built)
    fresh = int(T0.timestamp() * 1000)  # no pod holds it: theirs counted writes of the deleted Secret
    assert secret_keys(secret) == {"next": "N", "generation": str(fresh)} and secret_token({"s": secret}, "s") == "N"
    switched = rotation_step(secret, "r0", WINDOW_S, at(WINDOW_S))
    assert switched.secret is not None and secret_keys(switched.secret) == {"token": "N", "generation": str(fresh + 1)}


@pytest.mark.parametrize(
    ("value", "window", "problem"),
    [
        (None, WINDOW_S, False),
        ("30", 30, False),
        ("0", WINDOW_S, True),
        ("soon", WINDOW_S, True),
        ("999999", WINDOW_S, True),
    ],
    ids=[
        "absent: the default",
        "thirty seconds",
        "zero is refused",
        "not a number is refused",
        "over a day is refused",
    ],
)
def test_the_window_annotation_is_checked(value: str | None, window: int, problem: bool) -> None:
    annotations = {} if value is None else {"disagg.dev/token-rotation-window-seconds": value}
    got, why = rotation_window(annotations)
    assert got == window and (why is not None) == problem
    if why is not None:
        assert "disagg.dev/token-rotation-window-seconds" in why


def test_a_phase_ends_once_every_pod_reported_reading_it_and_the_window_stays_the_bound() -> None:
    secret = live(rotation_step(live(build_serving_secret(OWNER, "A")), "r1", 60, T0).secret or {})
    assert generation(secret) == 1
    polling = rotation_step(secret, "r1", 60, at(3), lagging=["fleet-r0-f0-abc"])
    assert polling.secret is None and polling.due_in_s == CONFIRM_POLL_S  # asked again soon
    near_end = rotation_step(secret, "r1", 60, at(59), lagging=["fleet-r0-f0-abc"])
    assert near_end.secret is None and near_end.due_in_s == pytest.approx(1)
    early = rotation_step(secret, "r1", 60, at(5), lagging=[])
    assert early.secret is not None and early.secret["metadata"]["annotations"][PHASE] == "previous"
    assert early.note is not None and "every pod that mounts it read the phase, after 5s" in early.note.message
    switched = live(early.secret)
    assert generation(switched) == 2
    late = rotation_step(switched, "r1", 60, at(65), lagging=[f"pod-{i}" for i in range(7)])
    assert late.secret is not None and late.note is not None and late.note.reason is EventReason.TOKEN_ROTATION_DONE
    assert "window ended before these pods reported reading the phase: pod-0, pod-1" in late.note.message
    assert "pod-4 and 2 more" in late.note.message
    assert rotation_step(switched, "r1", 60, at(10), lagging=None).due_in_s == pytest.approx(
        55
    )  # not asked: the window


def test_status_names_the_phase_and_the_pods_it_waits_on_bounded() -> None:
    secret = live(build_serving_secret(OWNER, "old-serving-token"))
    assert rotation_status(secret, None) is None  # no rotation under way: nothing in status
    started = rotation_step(secret, "r1", 10, T0).secret
    assert started is not None
    fresh = rotation_status(started, None)  # the phase just began: nobody asked yet
    assert fresh is not None and fresh.phase == "next" and fresh.since == T0
    assert fresh.lagging_pods is None and fresh.lagging_count is None
    assert fresh.secret == started["metadata"]["name"]
    pods = [f"pod-{i:02d}" for i in range(MAX_LAGGING_PODS + 3)]
    shown = rotation_status(live(started), list(reversed(pods)))
    assert shown is not None and shown.lagging_pods == pods[:MAX_LAGGING_PODS]  # sorted, bounded
    assert shown.lagging_count == MAX_LAGGING_PODS + 3
    caught_up = rotation_status(live(started), [])
    assert caught_up is not None and caught_up.lagging_pods == [] and caught_up.lagging_count == 0
    dumped = shown.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert set(dumped) == {"secret", "phase", "since", "laggingPods", "laggingCount"}
    tokens = [v for k, v in secret_keys(started).items() if k != "generation"]
    assert len(tokens) == 2 and not [t for t in tokens if t in str(dumped)]  # no token in status


def test_a_finished_rotation_leaves_the_status_by_a_null_in_the_merge_patch() -> None:
    under_way = {"replicas": 1, "tokenRotations": [{"secret": "s", "phase": "next"}]}
    assert status_patch(under_way, under_way) is None  # nothing changed: nothing written
    assert status_patch({"replicas": 1}, under_way) == {"replicas": 1, "tokenRotations": None}
    assert status_patch(under_way, {"replicas": 1}) == under_way
