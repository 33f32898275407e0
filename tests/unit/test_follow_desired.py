"""The pure decision of a running engine about the stored desired weights it reads
(``drs_engine.weights.follow``): a binding target defers, a lapsed one does not, weights it holds
or already follows are left alone, older desired weights are ignored, a bad file is named."""

from __future__ import annotations

from pathlib import Path

import pytest
from drs_engine.weights.desired import DesiredWeightsError, desired_file_from_env, holds, weights_from_env
from drs_engine.weights.follow import Action, Held, decide, read_desired_file, stale
from drs_engine.weights.target import TargetGate
from drs_protocol import env
from drs_protocol.control import WeightsTarget
from drs_protocol.weights_digest import digest_bytes
from drs_protocol.weights_state import DesiredWeights
from hypothesis import given, settings
from hypothesis import strategies as st

V1 = digest_bytes(b"v1")
V2 = digest_bytes(b"v2")
NOW = 1_800_000_000.0


def desired(
    version: str = "v2", digest: str | None = V2, effective_at: float | None = NOW, path: str | None = "/ckpt"
) -> DesiredWeights:
    return DesiredWeights(version=version, digest=digest, effective_at=effective_at, path=path)


def held(
    version: str = "v1",
    digest: str | None = V1,
    *,
    target_binds: bool = False,
    pending: DesiredWeights | None = None,
    known: DesiredWeights | None = None,
    control_at: float | None = None,
) -> Held:
    return Held(version, digest, target_binds, pending, known, control_at)


def test_other_weights_and_no_target_catch_up() -> None:
    assert decide(desired(), held()) is Action.CATCH_UP
    assert decide(desired(path=None), held()) is Action.CATCH_UP  # path-less: from a peer, the same decision


def test_a_binding_target_defers_and_a_lapsed_one_does_not() -> None:
    now = [0.0]
    gate = TargetGate(clock=lambda: now[0], wall=lambda: NOW)
    gate.announce(WeightsTarget(version="v2", digest=V2, lease_s=30.0, effective_at=NOW), "v1", V1)
    assert decide(desired(), held(target_binds=gate.current() is not None)) is Action.DEFER
    now[0] = 29.9
    assert decide(desired(), held(target_binds=gate.current() is not None)) is Action.DEFER
    now[0] = 30.0  # the lease lapsed: the sidecar that announced it is gone
    assert gate.current() is None
    assert decide(desired(), held(target_binds=gate.current() is not None)) is Action.CATCH_UP


def test_weights_it_holds_or_already_follows_are_left_alone() -> None:
    assert decide(desired(), held(version="v2", digest=V2)) is Action.HOLDS
    assert decide(desired(digest=None), held(version="v2", digest=V1)) is Action.HOLDS  # by version: no digest
    assert decide(desired(), held(version="v1-renamed", digest=V2)) is Action.HOLDS  # by digest where both know
    assert decide(desired(), held(version="v2", digest=V1)) is Action.CATCH_UP  # the same name, other bytes
    assert decide(desired(), held(pending=desired())) is Action.FOLLOWING
    assert decide(desired(), held(pending=desired(version="v0", digest=None))) is Action.CATCH_UP  # newer
    assert decide(None, held()) is Action.NONE


def test_desired_weights_older_than_the_engines_word_are_ignored() -> None:
    # the sidecar loaded this engine after the file's cut-over (the file lags the API server)
    assert decide(desired(), held(control_at=NOW + 5)) is Action.STALE
    assert decide(desired(), held(control_at=NOW - 5)) is Action.CATCH_UP  # the file's weights are newer
    # the engine started under (or follows) desired weights with a later cut-over
    assert decide(desired(), held(known=desired(version="v3", effective_at=NOW + 60))) is Action.STALE
    assert decide(desired(), held(known=desired(version="v1", effective_at=NOW - 60))) is Action.CATCH_UP
    # no cut-over (an older sidecar): followed only while nothing newer was said
    assert decide(desired(effective_at=None), held()) is Action.CATCH_UP
    assert decide(desired(effective_at=None), held(control_at=NOW)) is Action.STALE
    assert decide(desired(effective_at=None), held(known=desired(version="v0"))) is Action.STALE
    # staleness wins over a binding target and over holding
    assert decide(desired(), held(control_at=NOW + 5, target_binds=True)) is Action.STALE


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ('{"version": "v2", "dig', "not valid desired weights"),  # half written
        ('{"version": "v2", "digest": "md5:x"}', "digest"),  # another digest format
        ('{"version": "v2", "extra": 1}', "extra"),
        (b"\xff\xfe", "cannot be read"),
    ],
    ids=["half-written", "bad-digest", "unknown-field", "not-utf8"],
)
def test_a_bad_desired_file_is_named(tmp_path: Path, content: str | bytes, says: str) -> None:
    path = tmp_path / env.DESIRED_WEIGHTS_KEY
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(DesiredWeightsError, match=says) as raised:
        read_desired_file(path)
    assert str(path) in str(raised.value)


def test_no_file_or_an_empty_one_is_no_desired_weights(tmp_path: Path) -> None:
    path = tmp_path / env.DESIRED_WEIGHTS_KEY
    assert read_desired_file(path) is None
    path.write_text("")  # the ConfigMap of a fleet that never had a refit
    assert read_desired_file(path) is None
    path.write_text(desired().dump())
    assert read_desired_file(path) == desired()


def test_the_engine_follows_the_file_of_the_mounted_weights_configmap() -> None:
    assert desired_file_from_env({}) is None
    assert desired_file_from_env({env.WEIGHTS_DIR: "/etc/drs/weights"}) == Path("/etc/drs/weights/desired")
    assert weights_from_env({env.WEIGHTS_DIR: "/w"})["desired_file"] == Path("/w") / env.DESIRED_WEIGHTS_KEY


cut_overs = st.one_of(st.none(), st.sampled_from([NOW - 60, NOW, NOW + 60]))
some_desired = st.builds(
    desired, st.sampled_from(["v1", "v2"]), st.sampled_from([None, V1, V2]), cut_overs, st.sampled_from([None, "/c"])
)


@given(
    some_desired,
    st.sampled_from(["v1", "v2"]),
    st.sampled_from([None, V1, V2]),
    st.booleans(),
    st.one_of(st.none(), some_desired),
    st.one_of(st.none(), some_desired),
    st.one_of(st.none(), st.sampled_from([NOW - 30, NOW + 30])),
)
@settings(max_examples=300, deadline=None)
def test_an_engine_catches_up_exactly_when_it_should(
    wanted: DesiredWeights,
    version: str,
    digest: str | None,
    binds: bool,
    pending: DesiredWeights | None,
    known: DesiredWeights | None,
    control_at: float | None,
) -> None:
    """CATCH_UP exactly when: not already following them, not older than the engine's newer
    word, not held, and no target binds it; never while a target binds it."""
    state = held(version, digest, target_binds=binds, pending=pending, known=known, control_at=control_at)
    action = decide(wanted, state)
    want = pending != wanted and not stale(wanted, state) and not holds(version, digest, wanted) and not binds
    assert (action is Action.CATCH_UP) == want
    if binds:
        assert action is not Action.CATCH_UP


def test_a_lapsed_target_refuses_until_settled_by_desired_weights_as_new_or_until_its_hold_ends() -> None:
    """The gate's lapsed hold (``hold_lapsed_s``): off, a lapsed target admits at once; on, legs
    stamped at or after its cut-over are refused until desired weights at least as new settle it
    (an older file does not), or the hold runs out; an engine holding the target is admitted."""
    from drs_engine.errors import WeightsPendingError

    now = [0.0]
    target = WeightsTarget(version="v2", digest=None, lease_s=30.0, effective_at=NOW)
    plain = TargetGate(clock=lambda: now[0], wall=lambda: NOW)
    plain.announce(target, "v1", None)
    held = TargetGate(clock=lambda: now[0], wall=lambda: NOW, hold_lapsed_s=90.0)
    held.announce(target, "v1", None)
    now[0] = 31.0  # both leases lapsed
    assert plain.admit("v1", None, NOW + 1) is False and plain.lapsed() is None
    with pytest.raises(WeightsPendingError, match="lapsed"):
        held.admit("v1", None, NOW + 1)
    assert held.admit("v1", None, NOW - 1) is False  # stamped before the cut-over: served as before
    assert held.admit("v2", None, NOW + 1) is False  # an engine holding the target
    held.announce(target, "v1", None)
    now[0] = 62.0
    assert held.settle_lapsed("v1", NOW - 5) is False  # a file older than the target: the kubelet is behind
    with pytest.raises(WeightsPendingError):
        held.admit("v1", None, NOW + 1)
    assert held.settle_lapsed("v1", NOW) is True  # as new as the target, naming v1: withdrawn, serve v1
    assert held.admit("v1", None, NOW + 1) is False
    held.announce(target, "v1", None)
    now[0] = 93.0
    with pytest.raises(WeightsPendingError):
        held.admit("v1", None, NOW + 1)
    now[0] = 93.0 + 90.0  # the hold ran out: the target was never stored
    assert held.admit("v1", None, NOW + 1) is False and held.lapsed() is None
