"""Starting, finding and stopping the pod runner process, and its pid file.

The runner runs detached as ``python -m drs_devcluster.cli run-pods --foreground`` (the same click
command a person runs) with its log at ``<state>/logs/pod-runner.log``; :func:`start_runner`
returns once it has listed the pods (it writes :data:`READY_FILE`). Every live pod process, and the
runner itself as :data:`RUNNER_NAME`, is in :data:`PIDS_FILE` (the format of ``processes.save``)
so that ``drs dev down`` stops them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from . import processes
from .cluster import DevCluster, DevClusterError

RUNNER_NAME: Final = "pod-runner"
PIDS_FILE: Final = "runner-pids.json"
READY_FILE: Final = "pod-runner.ready"
START_TIMEOUT_S: Final = 30.0
START_POLL_S: Final = 0.1

log = logging.getLogger("drs.pod-runner")


class PidFile:
    """``<state>/runner-pids.json``: the runner and the pod processes it runs."""

    def __init__(self, state_dir: Path, runner_log: Path) -> None:
        self.state_dir = state_dir
        self.path = state_dir / PIDS_FILE
        self.ready_file = state_dir / READY_FILE
        self.python = sys.executable
        self.runner_log = str(runner_log)

    def take_over(self) -> None:
        """Refuse when another runner is alive; stop what a dead one left; record this one."""
        previous = processes.load(self.path)
        other = [t for t in previous if t.name == RUNNER_NAME and t.pid != os.getpid() and processes.is_running(t)]
        if other:
            raise DevClusterError(f"a pod runner already runs for {self.state_dir} (pid {other[0].pid})")
        leftovers = [t for t in previous if t.name != RUNNER_NAME]
        stopped = processes.stop(leftovers)
        if stopped:
            log.info("stopped %d processes left by an earlier runner: %s", len(stopped), ", ".join(stopped))
        self.ready_file.unlink(missing_ok=True)
        self.save([])

    def save(self, children: Iterable[processes.Tracked]) -> None:
        """Record this runner and ``children`` (the live pod processes)."""
        if not self.state_dir.is_dir():  # removed by `drs dev down`: never create it again
            return
        me = processes.Tracked(RUNNER_NAME, os.getpid(), self.python, self.runner_log)
        processes.save(self.path, [me, *children])

    def mark_ready(self) -> None:
        """The first list is done: :func:`start_runner` may return."""
        if not self.ready_file.exists():
            self.ready_file.write_text(str(os.getpid()))

    def clear(self) -> None:
        self.ready_file.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)


def running_runner(cluster: DevCluster) -> processes.Tracked | None:
    """The live pod runner of this cluster, if any."""
    tracked = processes.load(cluster.layout.state_dir / PIDS_FILE)
    return next((t for t in tracked if t.name == RUNNER_NAME and processes.is_running(t)), None)


def start_runner(cluster: DevCluster, timeout_s: float = START_TIMEOUT_S) -> processes.Tracked:
    """Start the runner detached (log ``<state>/logs/pod-runner.log``); return once it watches pods."""
    lay = cluster.layout
    if not lay.kubeconfig.is_file():
        raise DevClusterError(f"no dev cluster in {lay.state_dir}: run `drs dev up` first")
    existing = running_runner(cluster)
    if existing is not None:
        raise DevClusterError(f"a pod runner already runs for {lay.state_dir} (pid {existing.pid}, log {existing.log})")
    ready = lay.state_dir / READY_FILE
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "drs_devcluster.cli", "run-pods", "--foreground", "--state-dir", str(lay.state_dir)]
    tracked = processes.start(RUNNER_NAME, argv, lay.log(RUNNER_NAME))
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            if ready.read_text().strip() == str(tracked.pid):
                return tracked
        if not processes.is_running(tracked):
            raise DevClusterError(
                f"the pod runner exited during start-up; last lines of {tracked.log}:\n{processes.log_tail(tracked.log)}"
            )
        if time.monotonic() > deadline:
            processes.stop([tracked])
            raise DevClusterError(
                f"the pod runner did not start watching within {timeout_s:.0f}s; last lines of {tracked.log}:\n"
                f"{processes.log_tail(tracked.log)}"
            )
        time.sleep(START_POLL_S)


def stop_runner(cluster: DevCluster) -> list[str]:
    """Stop the runner and every process it recorded; return the names stopped."""
    pids_file = cluster.layout.state_dir / PIDS_FILE
    stopped = processes.stop(processes.load(pids_file))
    pids_file.unlink(missing_ok=True)
    return stopped
