"""Linux namespaces of the real nodes: start a process inside the cluster's network namespace and
a node's mount namespace.

A node's mount namespace is held by a small holder process (``unshare --mount --propagation
slave`` then ``sleep``), created with the node's directories bind-mounted over the machine-wide
paths the kubelet, containerd and CNI fix. Every other process of the node enters it (and the
cluster's network namespace) between fork and exec, so the pid recorded is the real binary's.
Mounts made there (pod volumes, container root filesystems, pod network namespaces) never
propagate to the host and vanish with the last process of the namespace.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(path: str, nstype: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, nstype) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def entering(netns: Path | None = None, mount_of_pid: int | None = None) -> Callable[[], None]:
    """A ``preexec_fn`` that enters ``netns`` (a /run/netns path) and the mount namespace of the
    process ``mount_of_pid``, in the forked child, before exec."""
    mnt = f"/proc/{mount_of_pid}/ns/mnt" if mount_of_pid is not None else None

    def enter() -> None:
        if netns is not None:
            _setns(str(netns), CLONE_NEWNET)
        if mnt is not None:
            _setns(mnt, CLONE_NEWNS)

    return enter


def sleep_binary() -> str:
    """The holder's final executable (what its pid runs once the mounts are made)."""
    found = shutil.which("sleep")
    if found is None:
        raise FileNotFoundError("`sleep` is not on PATH (coreutils)")
    return os.path.realpath(found)


def holder_argv(binds: dict[Path, Path]) -> list[str]:
    """``unshare`` a mount namespace (slave: host mounts still reach it, none of its own leave it),
    bind ``source`` over ``target`` for each entry, then ``exec sleep`` to hold it."""
    mounts = " && ".join(f"mount --bind {shlex.quote(str(src))} {shlex.quote(str(dst))}" for dst, src in binds.items())
    script = f"{mounts} && exec {shlex.quote(sleep_binary())} infinity"
    return ["unshare", "--mount", "--propagation", "slave", "--", "sh", "-c", script]
