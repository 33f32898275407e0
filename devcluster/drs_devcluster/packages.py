"""The Debian packages the image build and the real nodes need, installed with apt when missing.

Split in two so the part that decides is tested without installing anything: ``missing`` says
which packages lack a command (looked up under a root directory, ``/`` for this machine), and
``install_plan`` says which apt commands install them. ``ensure_packages`` runs the plan, on this
machine or (for the test that proves the plan works from scratch) inside a fresh Debian root,
and checks afterwards that nothing is missing any more.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

#: The apt packages the build and the real nodes use, all installed whenever one is missing.
APT_PACKAGES = (
    "docker.io",
    "containerd",
    "runc",
    "containernetworking-plugins",
    "mmdebstrap",
    "iptables",
    "ipset",
    "nftables",
    "iproute2",
)
#: A command each package provides (what the build and the real nodes run), by package.
COMMANDS = {
    "docker.io": "dockerd",
    "containerd": "containerd",
    "runc": "runc",
    "mmdebstrap": "mmdebstrap",
    "iptables": "iptables",
    "ipset": "ipset",
    "nftables": "nft",
    "iproute2": "ip",
}
#: containernetworking-plugins installs no command on PATH: the CNI plugin the nodes use.
CNI_BRIDGE = Path("usr/lib/cni/bridge")
SEARCH_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
APT_TIMEOUT_S = 900.0
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}


class PackageError(RuntimeError):
    """A package could not be installed; the message names the command and its error."""


def missing(root: Path = Path("/")) -> list[str]:
    """The packages of ``APT_PACKAGES`` whose command is not found under ``root``."""
    path = os.pathsep.join(str(root / d.lstrip("/")) for d in SEARCH_PATH)
    absent = [pkg for pkg, cmd in COMMANDS.items() if shutil.which(cmd, path=path) is None]
    if not (root / CNI_BRIDGE).is_file():
        absent.append("containernetworking-plugins")
    return sorted(absent, key=APT_PACKAGES.index)


def install_plan(absent: list[str]) -> list[list[str]]:
    """The apt commands that install the whole set when anything is absent (none otherwise)."""
    if not absent:
        return []
    return [
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES],
    ]


def in_root(root: Path, argv: list[str]) -> list[str]:
    """``argv`` run inside ``root``: chrooted, with a /proc of its own in a private mount
    namespace (maintainer scripts read it; nothing is left mounted afterwards)."""
    if root == Path("/"):
        return argv
    proc = root / "proc"
    return ["unshare", "--mount", "--pid", "--fork", "--kill-child", f"--mount-proc={proc}", "chroot", str(root), *argv]


def ensure_packages(root: Path = Path("/")) -> list[str]:
    """Install the packages when any is missing under ``root``; return what was missing."""
    absent = missing(root)
    plan = install_plan(absent)
    if not plan:
        return []
    if os.geteuid() != 0:
        raise PackageError(f"missing Debian packages {', '.join(absent)}: install them (as root) and retry")
    print(
        f"[drs packages] installing {' '.join(APT_PACKAGES)} with apt-get (missing: {', '.join(absent)})",
        file=sys.stderr,
        flush=True,
    )
    env = {**os.environ, **APT_ENV}
    for argv in plan:
        full = in_root(root, argv)
        out = subprocess.run(full, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S, check=False)
        if out.returncode != 0:
            raise PackageError(f"`{' '.join(full)}` failed:\n{out.stderr.strip()[-2000:]}")
    still = missing(root)
    if still:
        raise PackageError(
            f"apt-get installed {' '.join(APT_PACKAGES)} but {', '.join(still)} still lack their command"
        )
    return absent
