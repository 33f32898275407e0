"""One pod's local process: its state across restarts, how it is spawned, signalled and probed.

A :class:`PodProcess` lives in the runner's memory only (a restarted runner starts every process
again). The process runs in its own session, so that :func:`kill_group` reaches everything it
started; :func:`spawn` writes a start line to the pod's log and is safe against a stop that
arrives mid-spawn; :func:`terminate` sends SIGTERM, then SIGKILL after the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import os
import signal
from pathlib import Path
from typing import IO, Any

from .runner_policy import ContainerRun, LastExit, Probe, Readiness, Reason, probe_succeeded

log = logging.getLogger("drs.pod-runner")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(eq=False)  # compared and hashed by identity
class PodProcess:
    """One pod's local process across its restarts (memory only)."""

    uid: str
    namespace: str
    name: str
    node: str
    pod: dict[str, Any]
    workdir: Path
    proc: asyncio.subprocess.Process | None = None
    started_at: str | None = None
    started_mono: float = 0.0
    restarts: int = 0
    consecutive_exits: int = 0
    last_exit: LastExit | None = None
    waiting: tuple[str, str] | None = None
    readiness: Readiness = dataclasses.field(default_factory=Readiness)
    probe: Probe | None = None
    supervisor: asyncio.Task[None] | None = None
    stopping: bool = False
    reported_problem: str | None = None

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


async def spawn(pp: PodProcess, argv: list[str], env: dict[str, str], out: IO[bytes]) -> asyncio.subprocess.Process:
    """Start ``argv`` in its own session in ``pp``'s workdir, output to ``out``; sets ``pp.proc``.

    Shielded: a stop (cancellation) that arrives mid-spawn still leaves ``pp.proc`` set, so the
    stop finds the process and ends it."""
    spawning = asyncio.create_task(
        asyncio.create_subprocess_exec(
            *argv,
            cwd=pp.workdir,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    )
    try:
        pp.proc = await asyncio.shield(spawning)
    except asyncio.CancelledError:
        with contextlib.suppress(OSError):
            pp.proc = await spawning
        raise
    return pp.proc


async def terminate(pp: PodProcess, why: str, grace_s: float) -> None:
    """SIGTERM ``pp``'s process group, SIGKILL after ``grace_s`` (and what is left after it exits)."""
    if pp.proc is None or pp.proc.returncode is not None:
        return
    log.info("%s: stopping pid %d (%s; grace %.0fs)", pp.label, pp.proc.pid, why, grace_s)
    kill_group(pp.proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(pp.proc.wait(), grace_s)
    except TimeoutError:
        log.warning("%s: pid %d ignored SIGTERM for %.0fs: SIGKILL", pp.label, pp.proc.pid, grace_s)
        kill_group(pp.proc.pid, signal.SIGKILL)
        await pp.proc.wait()
    kill_group(pp.proc.pid, signal.SIGKILL)


async def probe_once(http: Any, pp: PodProcess, probe: Probe) -> tuple[bool, str]:
    """One readiness probe of ``pp``'s process: ``(succeeded, what was seen)``; never raises."""
    pod_ip = str((pp.pod.get("status") or {}).get("podIP") or (pp.pod.get("status") or {}).get("hostIP"))
    if probe.kind == "tcp":
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(probe.host or pod_ip, probe.port), probe.timeout_s
            )
            writer.close()
            return True, f"tcp {probe.host or pod_ip}:{probe.port} open"
        except (OSError, TimeoutError) as exc:
            return False, f"tcp {probe.host or pod_ip}:{probe.port}: {exc or type(exc).__name__}"
    url = probe.url(pod_ip)
    try:
        resp = await http.get(url, headers=dict(probe.headers), timeout=probe.timeout_s)
    except Exception as exc:  # httpx.HTTPError and friends: a failed probe, never a crash
        return False, f"GET {url}: {type(exc).__name__}: {exc}"
    return probe_succeeded(resp.status_code), f"GET {url}: HTTP {resp.status_code}"


def container_run(pp: PodProcess) -> ContainerRun:
    """What the pod's container status must say about ``pp``'s process."""
    running = pp.alive and pp.started_at is not None
    ready = running and (pp.probe is None or pp.readiness.ready)
    reason, message = pp.waiting or (Reason.CRASH_LOOP.value, "")
    return ContainerRun(
        ready=ready,
        restart_count=pp.restarts,
        container_id=f"drs-runner://{pp.proc.pid}" if pp.proc is not None else "",
        started_at=pp.started_at if running else None,
        waiting_reason=None if running else reason,
        waiting_message=None if running or not message else message,
        last_exit=pp.last_exit,
    )


def kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
