"""Secret and ConfigMap volumes for the pod runner's local processes, as a kubelet projects them.

A pod's process runs on the host, so a ``volumeMount`` of a ``secret`` or ``configMap`` volume at ``mountPath``
becomes a directory under the pod's work directory (``<workdir>/volumes/<volume>``), and every
env value and argument that starts with ``mountPath`` is rewritten to that directory (the
processes of two pods never share a path). The files are written the kubelet's way: each
version in a directory of its own, an atomically swapped ``..data`` link to it, and one link per
key (``token -> ..data/token``), so a reader that goes through ``..data`` sees one version's keys
together (``drs_protocol.token_source``).

While the process runs the runner re-reads the objects every :data:`SYNC_S` seconds and writes a
changed one (a kubelet does this on its sync period, about a minute by default). An object that
is deleted leaves the files as they were (as the kubelet does); one that is missing when the
process would start keeps it from starting, unless the volume is ``optional``. A ConfigMap's
files are its ``data`` (UTF-8) and ``binaryData`` (base64) keys. Other volume kinds are not
projected (the process sees no files for them, as before).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

#: Seconds between two reads of a running pod's Secrets.
SYNC_S: Final = 1.0
DATA_LINK: Final = "..data"


@dataclass(frozen=True)
class SecretMount:
    """One ``secret`` or ``configMap`` volume mounted by the first container (``secret``: the
    object's name; ``kind``: ``secret`` or ``configmap``)."""

    volume: str
    secret: str
    mount_path: str
    local: Path
    optional: bool
    kind: str = "secret"


def secret_mounts(pod: Mapping[str, Any], workdir: Path) -> list[SecretMount]:
    """The first container's mounts of ``secret`` and ``configMap`` volumes, each with its local directory."""
    spec = pod.get("spec") or {}
    volumes = {str(v.get("name", "")): v for v in spec.get("volumes") or []}
    containers = spec.get("containers") or [{}]
    found = []
    for mount in containers[0].get("volumeMounts") or []:
        volume = volumes.get(str(mount.get("name", ""))) or {}
        kind, source = (
            ("secret", volume.get("secret")) if volume.get("secret") else ("configmap", volume.get("configMap"))
        )
        if not source:
            continue
        found.append(
            SecretMount(
                volume=str(volume["name"]),
                secret=str(source.get("secretName" if kind == "secret" else "name", "")),
                mount_path=str(mount.get("mountPath", "")).rstrip("/"),
                local=workdir / "volumes" / str(volume["name"]),
                optional=bool(source.get("optional", False)),
                kind=kind,
            )
        )
    return found


def localize(text: str, mounts: Sequence[SecretMount]) -> str:
    """``text`` with a leading mount path replaced by its local directory."""
    for mount in mounts:
        if mount.mount_path and (text == mount.mount_path or text.startswith(mount.mount_path + "/")):
            return str(mount.local) + text[len(mount.mount_path) :]
    return text


def secret_files(secret: Mapping[str, Any], kind: str = "secret") -> dict[str, bytes]:
    """A Secret's keys and decoded values (``data`` base64, as the API returns it); a ConfigMap's
    (``data`` as text, ``binaryData`` base64)."""
    files = {}
    if kind == "configmap":
        files = {str(key): str(value).encode() for key, value in (secret.get("data") or {}).items()}
    for key, raw in (secret.get("data" if kind == "secret" else "binaryData") or {}).items():
        try:
            files[str(key)] = base64.b64decode(str(raw), validate=True)
        except binascii.Error:
            continue
    return files


def current_files(local: Path) -> dict[str, bytes] | None:
    """What the directory holds now (None: nothing written yet)."""
    data = local / DATA_LINK
    if not data.exists():
        return None
    return {p.name: p.read_bytes() for p in data.resolve().iterdir() if p.is_file()}


def write_files(local: Path, files: Mapping[str, bytes]) -> bool:
    """Project ``files`` into ``local`` (versioned directory, ``..data`` swap, key links); False
    when it already held exactly them."""
    if current_files(local) == dict(files):
        return False
    local.mkdir(parents=True, exist_ok=True)
    version = local / f"..{time.time_ns()}"
    version.mkdir(mode=0o700)
    for key, value in files.items():
        (version / key).write_bytes(value)
    data = local / DATA_LINK
    old = data.resolve() if data.exists() else None
    staged = local / "..data_tmp"
    staged.unlink(missing_ok=True)
    staged.symlink_to(version.name)
    os.replace(staged, data)  # the one atomic step: readers see the old keys or the new ones
    for key in files:
        link = local / key
        if not link.is_symlink():
            link.symlink_to(f"{DATA_LINK}/{key}")
    for entry in local.iterdir():
        if entry.is_symlink() and entry.name not in files and not entry.name.startswith(".."):
            entry.unlink()  # a key the Secret no longer has
    if old is not None and old != version.resolve():
        shutil.rmtree(old, ignore_errors=True)
    return True


async def project(
    mounts: Sequence[SecretMount], read: Callable[[str, str], Awaitable[Mapping[str, Any] | None]], starting: bool
) -> list[str] | None:
    """Write each mounted object's files (``read``: an object by kind and name, None when it does
    not exist); a deleted one leaves them. The volumes whose files changed (none on the start), or
    None when ``starting`` and a required object is missing (the process must not start)."""
    changed = []
    for mount in mounts:
        secret = await read(mount.kind, mount.secret)
        if secret is None:
            if starting and not mount.optional and current_files(mount.local) is None:
                return None
            continue
        if await asyncio.to_thread(write_files, mount.local, secret_files(secret, mount.kind)) and not starting:
            changed.append(mount.volume)
    return changed
