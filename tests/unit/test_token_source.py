"""The token source (``drs_protocol.token_source``): what a process presents and accepts, re-read
from a Secret mounted the kubelet's way, through every phase of a rotation.

Real files in a temporary directory, written as the pod runner projects a Secret
(``drs_devcluster.runner_volumes.write_files``: versioned directory, ``..data`` swap, key links);
a fake clock only for the held token's grace.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from pathlib import Path

import pytest
from drs_devcluster.runner_volumes import current_files, localize, secret_mounts, write_files
from drs_protocol.token_source import (
    HELD_GRACE_S,
    TokenSource,
    format_generations,
    parse_generations,
    read_keys,
    token_source,
)
from hypothesis import given, settings
from hypothesis import strategies as st


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def project(directory: Path, **keys: str) -> None:
    write_files(directory, {k: v.encode() for k, v in keys.items()})


def test_a_static_source_presents_and_accepts_its_token_only() -> None:
    source = TokenSource(static="abc")
    assert source.current == "abc" and source.headers == {"authorization": "Bearer abc"}
    assert source.matches("abc") and not source.matches("abd") and not source.matches(None)
    assert not source.refresh()  # nothing to re-read
    empty = TokenSource()
    assert not empty.configured and empty.headers == {} and not empty.matches("")


def test_the_two_phases_of_a_rotation_present_late_and_drop_late(tmp_path: Path) -> None:
    clock = Clock()
    project(tmp_path, token="A")
    source = TokenSource(tmp_path, clock=clock)
    assert (source.current, source.matches("A"), source.matches("B")) == ("A", True, False)
    project(tmp_path, token="A", next="B")  # phase 1: B accepted, not presented
    assert source.current == "A" and not source.matches("B")  # not re-read yet: no file read per check
    assert source.refresh()
    assert source.current == "A" and source.matches("A") and source.matches("B")
    project(tmp_path, token="B", previous="A")  # phase 2: B presented, A still accepted
    assert source.refresh()
    assert source.current == "B" and source.headers == {"authorization": "Bearer B"} and source.matches("A")
    project(tmp_path, token="B")  # done: A only within the held grace
    source.refresh()
    assert source.matches("A")
    clock.now += HELD_GRACE_S + 1
    source.refresh()
    assert source.current == "B" and source.matches("B") and not source.matches("A")
    project(tmp_path, token="C")  # a token two rotations old is refused at once
    source.refresh()
    assert source.matches("B") and not source.matches("A")


def test_a_hand_edit_of_token_keeps_the_held_token_accepted_for_the_grace(tmp_path: Path) -> None:
    clock = Clock()
    project(tmp_path, token="A")
    source = TokenSource(tmp_path, clock=clock)
    project(tmp_path, token="B")
    source.refresh()
    assert source.current == "B" and source.matches("A")
    clock.now += HELD_GRACE_S - 1
    source.refresh()
    assert source.matches("A")
    clock.now += 2
    source.refresh()
    assert not source.matches("A")


def test_a_deleted_or_unreadable_secret_keeps_the_tokens_held(tmp_path: Path) -> None:
    directory = tmp_path / "serving"
    project(directory, token="A")
    source = TokenSource(directory)
    for path in directory.iterdir():
        path.unlink() if path.is_symlink() or path.is_file() else None
    assert read_keys(directory) == {}  # the kubelet's files gone: no token key
    source.refresh()
    assert source.current == "A" and source.matches("A")
    (tmp_path / "gone").mkdir()
    vanished = TokenSource(tmp_path / "gone" / "nothing")
    assert not vanished.configured and not vanished.refresh()


def test_a_recreated_secret_in_phase_one_keeps_presenting_the_held_token(tmp_path: Path) -> None:
    project(tmp_path, token="A")
    running = TokenSource(tmp_path)
    project(tmp_path, next="B")  # the operator re-created the Secret: no `token` key
    running.refresh()
    assert running.current == "A" and running.matches("A") and running.matches("B")
    fresh = TokenSource(tmp_path)  # a pod started now has no held token: it presents `next`
    assert fresh.current == "B" and not fresh.matches("A")
    project(tmp_path, token="B")
    running.refresh()
    assert running.current == "B" and running.matches("A")  # held grace


def test_malformed_files_are_not_tokens(tmp_path: Path) -> None:
    project(tmp_path, token="A", next="two words", previous="x" * 5000)
    source = TokenSource(tmp_path)
    assert source.current == "A" and source.accepted == (b"A",)
    assert not source.matches("two words")


def test_a_malformed_key_is_logged_once_naming_the_key_and_the_rule_never_its_value(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hand-edited Secret whose key is no token: the process says which key and which rule, in
    the log every pod keeps, and goes on with the keys that are tokens."""
    project(tmp_path, token="A", next="two words", previous="x" * 5000)
    with caplog.at_level(logging.WARNING, logger="drs_protocol.token_source"):
        source = TokenSource(tmp_path, what="serving token")
        first = caplog.text
        caplog.clear()
        source.refresh()
        again = caplog.text
        project(tmp_path, token="A", next=" ")
        source.refresh()
        changed = caplog.text
    assert source.current == "A" and source.accepted == (b"A",)
    assert f"serving token directory {tmp_path}: key 'next' is not a token (it contains whitespace)" in first
    assert "key 'previous' is not a token (it is over 4096 characters)" in first
    assert "two words" not in first and "x" * 64 not in first
    assert again == "", "logged once while the Secret stays as it is"
    assert "key 'next' is not a token (it is empty)" in changed and "previous" not in changed


def test_the_refresh_loop_picks_a_rotation_up_without_a_call(tmp_path: Path) -> None:
    async def scenario() -> None:
        project(tmp_path, token="A")
        source = TokenSource(tmp_path)
        task = asyncio.create_task(source.run(interval_s=0.01))
        generation = source.generation
        project(tmp_path, token="A", next="B")
        async with asyncio.timeout(5):
            while source.generation == generation:
                await asyncio.sleep(0.01)
        assert source.matches("B")
        task.cancel()

    asyncio.run(scenario())


def test_token_source_prefers_the_directory_then_the_file_then_the_environment(tmp_path: Path) -> None:
    project(tmp_path / "dir", token="from-dir")
    (tmp_path / "file").write_text("from-file\n")
    assert token_source(str(tmp_path / "dir"), tmp_path / "file", "from-env", "t").current == "from-dir"
    assert token_source(None, tmp_path / "file", "from-env", "t").current == "from-file"
    assert token_source(None, None, " from-env ", "t").current == "from-env"
    assert token_source(None, None, "", "t").current is None


def test_the_runner_projects_a_secret_atomically_and_localizes_its_mount_path(tmp_path: Path) -> None:
    pod = {
        "spec": {
            "volumes": [
                {"name": "serving-token", "secret": {"secretName": "fleet-serving"}},
                {"name": "x", "emptyDir": {}},
            ],
            "containers": [
                {
                    "volumeMounts": [
                        {"name": "serving-token", "mountPath": "/etc/drs/tokens/serving/"},
                        {"name": "x", "mountPath": "/tmp"},
                    ]
                }
            ],
        }
    }
    (mount,) = secret_mounts(pod, tmp_path)
    assert mount.secret == "fleet-serving" and mount.local == tmp_path / "volumes" / "serving-token"
    assert localize("/etc/drs/tokens/serving", [mount]) == str(mount.local)
    assert localize("/etc/drs/tokens/serving/token", [mount]) == f"{mount.local}/token"
    assert localize("/etc/drs/tokens/servingX", [mount]) == "/etc/drs/tokens/servingX"
    assert write_files(mount.local, {"token": b"A", "next": b"B"})
    assert not write_files(mount.local, {"token": b"A", "next": b"B"})  # unchanged: nothing written
    assert write_files(mount.local, {"token": b"B"})
    assert current_files(mount.local) == {"token": b"B"} and not (mount.local / "next").exists()
    assert (mount.local / "token").read_text() == "B"
    assert len([p for p in mount.local.iterdir() if p.name.startswith("..") and p.is_dir() and not p.is_symlink()]) == 1


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.text(alphabet="0123456789abcdef", min_size=8, max_size=16), min_size=3, max_size=6, unique=True),
    presenter_lag=st.booleans(),
)
def test_property_a_two_phase_rotation_never_refuses_a_peer_at_either_step(
    tokens: list[str], presenter_lag: bool
) -> None:
    """Two processes (a presenter and an acceptor) read each phase at different moments (either one
    first); at every moment the token the presenter holds is accepted by the acceptor, and after the
    chain of rotations only the last two tokens can be accepted (nothing older)."""
    import tempfile

    with tempfile.TemporaryDirectory() as raw:
        directory = Path(raw)
        clock = Clock()
        project(directory, token=tokens[0])
        presenter, acceptor = TokenSource(directory, clock=clock), TokenSource(directory, clock=clock)
        phases: list[dict[str, str]] = []
        for old, new in itertools.pairwise(tokens):
            phases += [{"token": old, "next": new}, {"token": new, "previous": old}, {"token": new}]
        for keys in phases:
            project(directory, **keys)
            first, second = (acceptor, presenter) if presenter_lag else (presenter, acceptor)
            first.refresh()
            assert acceptor.matches(presenter.current)
            second.refresh()
            assert acceptor.matches(presenter.current)
            clock.now += HELD_GRACE_S + 1  # each phase lasts longer than the held grace
        presenter.refresh()
        acceptor.refresh()
        for stale in tokens[:-1]:
            assert not acceptor.matches(stale)
        assert acceptor.matches(tokens[-1])


def test_a_random_operator_token_round_trips(tmp_path: Path) -> None:
    token = secrets.token_hex(32)
    project(tmp_path, token=token)
    assert TokenSource(tmp_path).matches(token)


@pytest.mark.parametrize("header", ["Basic abc", "Bearer", "bearer  ", "abc"])
def test_a_malformed_authorization_header_presents_no_token(header: str) -> None:
    from drs_protocol import auth

    assert auth.presented_token(header) is None


def test_the_secret_generation_is_read_with_the_tokens_and_not_a_token(tmp_path: Path) -> None:
    write_files(tmp_path, {"token": b"t-one", "generation": b"7"})
    source = TokenSource(tmp_path)
    assert source.secret_generation == 7 and source.accepted == (b"t-one",)
    assert format_generations({"serving": source, "control": TokenSource(static="x")}) == "serving=7"
    write_files(tmp_path, {"token": b"t-one", "generation": b"not-a-number"})
    source.refresh()
    assert source.secret_generation is None and not source.matches("not-a-number")


def test_the_generations_header_is_parsed_and_a_bad_part_is_named() -> None:
    assert parse_generations("serving=3,control=12") == {"serving": 3, "control": 12}
    assert parse_generations(None) == {} and parse_generations("") == {}
    with pytest.raises(ValueError, match=r"x-drs-token-generations: 'serving=three' is not realm=generation"):
        parse_generations("serving=three")
