"""``ensure_packages`` from scratch: a fresh Debian root (mmdebstrap, minbase: none of the packages)
gets exactly the apt commands the plan names, run by the same code as on a CI machine (chrooted
here, so the host's own packages are never removed or changed), and afterwards every command the
build and the real nodes run exists and runs inside that root."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from drs_devcluster import packages

pytestmark = [pytest.mark.realnode]

MMDEBSTRAP_TIMEOUT_S = 900


def chrooted(root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(packages.in_root(root, list(argv)), capture_output=True, text=True, timeout=120, check=False)


def test_the_install_plan_installs_every_package_into_a_fresh_debian_root(tmp_path: Path) -> None:
    root = tmp_path / "debian"
    made = subprocess.run(
        ["mmdebstrap", "--variant=minbase", "--quiet", "bookworm", str(root)],
        capture_output=True, text=True, timeout=MMDEBSTRAP_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    before = packages.missing(root)
    assert {"docker.io", "containerd", "runc", "containernetworking-plugins", "nftables"} <= set(before)
    # As in a container image used for CI: packages' maintainer scripts start no services.
    policy = root / "usr" / "sbin" / "policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)

    assert packages.ensure_packages(root) == before

    assert packages.missing(root) == []
    for argv in (["dockerd", "--version"], ["containerd", "--version"], ["runc", "--version"],
                 ["nft", "--version"], ["iptables", "--version"], ["ip", "-V"], ["mmdebstrap", "--version"],
                 ["/usr/lib/cni/bridge", "--version"]):  # fmt: skip
        out = chrooted(root, *argv)
        assert out.returncode == 0, (argv, out.stdout, out.stderr)
    assert packages.ensure_packages(root) == []  # a second call finds everything: no apt at all
