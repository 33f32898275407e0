"""Which Debian packages are missing (commands looked up under a root directory) and which apt
commands install them; the plan is run from scratch in tests/realnodes/test_packages.py."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from drs_devcluster import packages
from hypothesis import given
from hypothesis import strategies as st

EVERYTHING = [*packages.COMMANDS, "containernetworking-plugins"]


def fake_root(root: Path, present: set[str]) -> Path:
    """A root directory where only the ``present`` packages' commands exist (executables)."""
    for pkg in present:
        if pkg == "containernetworking-plugins":
            path = root / packages.CNI_BRIDGE
        else:
            path = (
                root
                / "usr"
                / ("sbin" if pkg in ("docker.io", "iptables", "nftables") else "bin")
                / packages.COMMANDS[pkg]
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    return root


@given(st.sets(st.sampled_from(EVERYTHING)))
def test_missing_names_exactly_the_packages_whose_command_is_absent(present: set[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = fake_root(Path(tmp), present)
        absent = packages.missing(root)
        assert set(absent) == set(EVERYTHING) - present
        assert absent == sorted(absent, key=packages.APT_PACKAGES.index)


def test_a_command_that_is_not_executable_counts_as_missing(tmp_path: Path) -> None:
    root = fake_root(tmp_path, set(EVERYTHING))
    os.chmod(root / "usr" / "bin" / "runc", 0o644)
    assert packages.missing(root) == ["runc"]


def test_nothing_missing_means_no_apt_command() -> None:
    assert packages.install_plan([]) == []


@given(st.sets(st.sampled_from(EVERYTHING), min_size=1))
def test_anything_missing_means_update_then_the_whole_set_without_recommends(absent: set[str]) -> None:
    update, install = packages.install_plan(sorted(absent))
    assert update == ["apt-get", "update", "-q"]
    assert install[:5] == ["apt-get", "install", "-y", "-q", "--no-install-recommends"]
    assert set(install[5:]) == set(packages.APT_PACKAGES) >= set(packages.COMMANDS)


def test_every_package_has_a_command_or_the_cni_check() -> None:
    assert set(packages.APT_PACKAGES) == set(EVERYTHING)


def test_a_root_other_than_slash_runs_chrooted_with_its_own_proc(tmp_path: Path) -> None:
    argv = packages.in_root(tmp_path, ["apt-get", "update"])
    assert argv[-3:] == [str(tmp_path), "apt-get", "update"] and "chroot" in argv
    assert f"--mount-proc={tmp_path / 'proc'}" in argv and "--mount" in argv
    assert packages.in_root(Path("/"), ["apt-get", "update"]) == ["apt-get", "update"]
