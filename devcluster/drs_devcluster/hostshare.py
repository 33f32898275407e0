"""What every dev cluster with real nodes on this machine shares, and who restores it.

Two things cannot be made per cluster: the kernel settings the kubelet sets at start
(``vm.overcommit_memory``, ``kernel.panic``, …: machine-wide, not per namespace) and the empty
directories the nodes' bind mounts need as mount points (``nodeconfig.NODE_BINDS``). The first
cluster to come records the settings' values and which of those directories it made; every
cluster registers as a holder; the last holder to leave restores the values and removes the
directories. A holder whose host record is gone (its state directory was deleted) no longer
counts. The record lives in /run (cleared at boot, as the settings are); changes are made under
an exclusive lock on /run itself, so nothing but the record is ever left there.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RECORD = Path("/run/drs-dev-real-nodes.json")
LOCK_DIR = Path("/run")
#: What the kubelet sets at start (its kernel tunables), as sysctl names.
KUBELET_SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
)


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctl(name: str) -> str | None:
    try:
        return _sysctl_path(name).read_text().strip()
    except OSError:
        return None


def write_sysctl(name: str, value: str) -> None:
    _sysctl_path(name).write_text(value + "\n")


@contextlib.contextmanager
def _locked(record: Path) -> Iterator[dict[str, Any]]:
    fd = os.open(LOCK_DIR, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            data: dict[str, Any] = json.loads(record.read_text())
        except (OSError, ValueError):
            data = {}
        yield data
        if data:
            tmp = record.with_name(record.name + ".tmp")
            tmp.write_text(json.dumps(data, indent=2))
            tmp.replace(record)
        else:
            record.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _make_dirs(targets: list[Path]) -> list[str]:
    """Create the missing ``targets``; return every directory made, outermost first."""
    made: list[str] = []
    for target in targets:
        missing = [p for p in [target, *target.parents] if not p.exists()]
        for d in reversed(missing):
            d.mkdir()
            made.append(str(d))
    return made


def acquire(holder: Path, mount_points: list[Path], record: Path = RECORD) -> None:
    """Register ``holder`` (a cluster's host record path); the first records and prepares."""
    with _locked(record) as data:
        holders = [h for h in data.get("holders", []) if Path(h).exists() and h != str(holder)]
        if not holders:
            data.clear()
            data["sysctls"] = {n: v for n in KUBELET_SYSCTLS if (v := read_sysctl(n)) is not None}
            data["madeDirs"] = []
        data["madeDirs"] = [*data.get("madeDirs", []), *_make_dirs(mount_points)]
        data["holders"] = [*holders, str(holder)]


def release(holder: Path, record: Path = RECORD) -> list[str]:
    """Unregister ``holder``; the last one out restores the settings and removes the directories.
    Returns what was restored or removed (for the log)."""
    undone: list[str] = []
    with _locked(record) as data:
        if not data:
            return undone
        holders = [h for h in data.get("holders", []) if Path(h).exists() and h != str(holder)]
        data["holders"] = holders
        if holders:
            return undone
        for name, value in (data.get("sysctls") or {}).items():
            if read_sysctl(name) != value:
                with contextlib.suppress(OSError):
                    write_sysctl(name, value)
                    undone.append(f"{name}={value}")
        for d in sorted(data.get("madeDirs", []), key=len, reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(d)
                undone.append(f"rmdir {d}")
        data.clear()
    return undone
