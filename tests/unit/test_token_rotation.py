"""The operator's token rotation (``drs_operator.manifests.rotation``), pure: a request on the
DisaggReplicaSet walks each Secret through ``next`` then ``previous``, one window each, keeping its
memory on the Secret; the window annotation is checked; no token is in an Event."""

from __future__ import annotations

import base64
import datetime
from typing import Any

import pytest
from drs_operator.api.constants import EventReason
from drs_operator.kube.engines import secret_token
from drs_operator.manifests.rotation import WINDOW_S, recreated_secret, rotation_step, rotation_window, secret_keys
from drs_operator.manifests.secrets import build_serving_secret
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
    assert switched.secret is not None and secret_keys(switched.secret) == {"token": keys["next"], "previous": "A"}
    assert switched.note is not None and switched.note.reason is EventReason.TOKEN_ROTATION_SWITCHED
    secret = live(switched.secret)
    assert secret["metadata"]["annotations"][PHASE] == "previous"
    assert rotation_step(secret, "r1", 10, at(15)).secret is None
    done = rotation_step(secret, "r1", 10, at(20))
    assert done.secret is not None and secret_keys(done.secret) == {"token": keys["next"]}
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
    assert secret_keys(secret) == {"next": "N"} and secret_token({"s": secret}, "s") == "N"
    switched = rotation_step(secret, "r0", WINDOW_S, at(WINDOW_S))
    assert switched.secret is not None and secret_keys(switched.secret) == {"token": "N"}


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
