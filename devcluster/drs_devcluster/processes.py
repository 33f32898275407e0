"""Start, track and stop the local processes of a dev cluster.

Each process runs in its own session (so it outlives ``drs dev up`` and a Ctrl-C in the terminal
does not reach it), logs to a file, and is recorded in a pid file with its executable path. Stopping
checks that the pid still runs that executable before signalling it, so a recycled pid is never
killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

STOP_GRACE_S = 10.0
STOP_POLL_S = 0.1


class PortInUseError(RuntimeError):
    """A port the dev cluster needs is taken by another process."""


@dataclasses.dataclass(frozen=True)
class Tracked:
    """One started process, as recorded in the pid file."""

    name: str
    pid: int
    exe: str
    log: str


def check_port_free(host: str, port: int, owner: str) -> None:
    """Raise PortInUseError naming ``owner`` and the port if something listens there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                raise PortInUseError(
                    f"port {host}:{port} (for {owner}) is already in use by another process; stop it, "
                    f"or pick another range with --port-base"
                ) from exc
            raise


def port_is_listening(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def start(
    name: str,
    argv: Sequence[str],
    log: Path,
    env: dict[str, str] | None = None,
    preexec: Callable[[], None] | None = None,
    exe: str | None = None,
) -> Tracked:
    """Start ``argv`` detached in its own session, output appended to ``log``.

    ``preexec`` runs in the child before exec (entering namespaces); ``exe`` is the executable
    the pid ends up running when ``argv[0]`` execs another one."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            close_fds=True,
            preexec_fn=preexec,
        )
    return Tracked(name=name, pid=proc.pid, exe=exe or str(argv[0]), log=str(log))


def is_running(t: Tracked) -> bool:
    """True when ``t.pid`` is alive and still runs ``t.exe`` (not a recycled pid, not a zombie)."""
    try:
        exe = os.readlink(f"/proc/{t.pid}/exe")
        with open(f"/proc/{t.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    if state == "Z":
        with contextlib.suppress(ChildProcessError):
            os.waitpid(t.pid, os.WNOHANG)
        return False
    return os.path.realpath(exe.removesuffix(" (deleted)")) == os.path.realpath(t.exe)


def state(t: Tracked) -> str:
    """What ``t`` is doing: its kernel state (``sleeping``, ``running``, ``disk sleep``, ``stopped``
    …) while it runs ``t.exe``, else ``exited``."""
    if not is_running(t):
        return "exited"
    try:
        with open(f"/proc/{t.pid}/status") as f:
            line = next(line for line in f if line.startswith("State:"))
    except (OSError, StopIteration):
        return "exited"
    return line.split("(", 1)[1].rstrip(")\n") if "(" in line else line.split()[1]


def stop(procs: Iterable[Tracked], grace_s: float = STOP_GRACE_S) -> list[str]:
    """SIGTERM every live process group, SIGKILL what is left after ``grace_s``; return the names stopped."""
    live = [t for t in procs if is_running(t)]
    for t in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(t.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(is_running(t) for t in live):
        for t in live:  # reap our own children so they do not linger as zombies
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(t.pid, os.WNOHANG)
        time.sleep(STOP_POLL_S)
    for t in live:
        if is_running(t):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(t.pid, signal.SIGKILL)
    for t in live:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(t.pid, 0)
    return [t.name for t in live]


def save(path: Path, procs: Iterable[Tracked]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([dataclasses.asdict(t) for t in procs], indent=2))
    tmp.replace(path)


def load(path: Path) -> list[Tracked]:
    if not path.is_file():
        return []
    return [Tracked(**item) for item in json.loads(path.read_text())]


def log_tail(path: Path | str, lines: int = 15) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:])
