"""``drs dev run-pods``: run, as local processes, the pods that kwok only pretends to run.

kwok marks every pod on a simulated node Running and Ready. For our own pods (first container's
``command[0]`` is ``drs``, bound to a ``disagg.dev/dev-node=true`` node, ``hostNetwork: true``) this
runner makes that true: it runs the container's command line, with the environment a kubelet would
build (``runner_env``), as a process of this machine that binds its node's loopback address.

One asyncio loop:

1. list pods bound to a node, then watch them from the list's resourceVersion; a watch that ends
   resumes from the last resourceVersion it saw, a ``410 Gone`` or an error re-lists (pods that
   vanished in between are stopped);
2. each pod event is classified (``runner_policy.classify``): RUN starts a supervisor for the pod's
   UID, anything else stops it; a refused pod (not hostNetwork) gets one Warning Event;
3. a supervisor resolves env and argv (reading the Secrets and ConfigMaps it names), projects
   the pod's ``secret`` volumes into its work directory and keeps them in sync while it runs
   (``runner_volumes``: paths under a mount are rewritten to that directory), starts the
   process in its own session under ``<state>/pods/<ns>_<name>_<uid8>/`` (``log`` there), probes
   its readiness, and writes the truth to the pod's status; when the process exits on its own it
   is restarted after CrashLoopBackOff (1 s doubling to 30 s) with an Event and a restart count;
4. on SIGTERM/SIGINT, or when the control plane's processes are gone, every process is stopped.

Invariants: processes are keyed by pod UID; a process is stopped with SIGTERM to its process group,
SIGKILL after the pod's grace period (capped at 8 s); a new process never starts on a node while a
stopped process of that node is still exiting (a replacement binds the same address and port);
every live process, and the runner itself as ``pod-runner``, is in ``<state>/runner-pids.json``
(``runner_daemon.PidFile``) so that ``drs dev down`` stops them. The runner never deletes a
pod: kwok's pod-delete stage does. Process memory holds only what is safe to lose: a restarted
runner stops the processes its predecessor left and starts them again.

By concern: this module is the watch loop and the supervision, and :func:`run_foreground` (``drs
dev run-pods --foreground``); ``runner_process`` one pod's process (spawn, signals, probe);
``runner_api`` the raw API reads; ``runner_daemon`` the pid file and starting/stopping the runner
process from outside (it never imports this module); ``runner_policy`` and ``runner_env`` the
pure decisions; ``runner_volumes`` the Secret volumes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from . import processes
from .cluster import DevCluster, DevClusterError
from .runner_api import API_CALL_TIMEOUT_S, LIST_TIMEOUT_S, ApiError, Gone, describe, read_json, watch_lines
from .runner_daemon import RUNNER_NAME, PidFile
from .runner_env import NODE_IP_ENV, EnvResolutionError, first_container, local_argv, referenced_objects, resolve
from .runner_policy import (
    NOT_HOST_NETWORK_MESSAGE,
    Action,
    LastExit,
    Probe,
    ProbeSpecError,
    Readiness,
    Reason,
    classify,
    event_body,
    next_consecutive_exits,
    readiness_probe,
    restart_delay_s,
    status_patch,
    stop_grace_s,
    workdir_name,
)
from .runner_process import PodProcess, container_run, kill_group, now, probe_once, spawn, terminate
from .runner_volumes import SYNC_S as SECRET_SYNC_S
from .runner_volumes import SecretMount, localize, project, secret_mounts

DEV_NODE_SELECTOR: Final = "disagg.dev/dev-node=true"
BOUND_PODS: Final = "spec.nodeName!="
#: The apiserver ends each watch after this long; the runner resumes from the last resourceVersion.
WATCH_SERVER_TIMEOUT_S: Final = 240
#: No byte on the watch for this long (bookmarks come about every minute) → reconnect.
WATCH_READ_TIMEOUT_S: Final = 150.0
RETRY_DELAY_S: Final = 1.0
NODE_CACHE_TTL_S: Final = 30.0
CONTROL_PLANE_CHECK_S: Final = 2.0
ENV_RETRY_S: Final = 5.0
NODE_QUIET_POLL_S: Final = 0.1
#: Variables of the runner's own environment a pod process inherits (a container would get its image's).
#: ``PYTHONPATH`` too: a pod runs the same ``drs`` source tree as whoever started the runner (a
#: worktree's tests set it to their own sources; without it the pods would import the editable
#: install's tree, another checkout's code).
INHERITED_ENV: Final = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TMPDIR", "TZ", "PYTHONPATH")

log = logging.getLogger("drs.pod-runner")


class PodRunner:
    """The watch loop and the supervisors of one dev cluster's pods."""

    def __init__(self, cluster: DevCluster) -> None:
        self.layout = cluster.layout
        self.python = sys.executable
        self.drs_script = str(Path(sys.executable).parent / "drs")
        self.pods_dir = self.layout.state_dir / "pods"
        self.pid_file = PidFile(self.layout.state_dir, self.layout.log(RUNNER_NAME))
        self.by_uid: dict[str, PodProcess] = {}
        self.stopping: set[PodProcess] = set()
        self.refused: set[str] = set()
        self.waiting_logged: set[str] = set()
        self.node_cache: dict[str, tuple[bool, float]] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.shutdown = asyncio.Event()
        self.core: Any = None
        self.http: Any = None

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        import httpx
        from kubernetes_asyncio import client, config

        self.pid_file.take_over()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.shutdown.set)
        api = await config.new_client_from_config(config_file=str(self.layout.kubeconfig))
        self.core = client.CoreV1Api(api)
        self.http = httpx.AsyncClient(verify=False, follow_redirects=False, trust_env=False)
        watcher = asyncio.create_task(self._watch_pods(), name="watch-pods")
        guard = asyncio.create_task(self._watch_control_plane(), name="control-plane")
        try:
            await self.shutdown.wait()
        finally:
            await self._stop_everything(watcher, guard)
            await self.http.aclose()
            await api.close()

    async def _stop_everything(self, *loops: asyncio.Task[None]) -> None:
        """Stop the loops, then every process (in parallel, each within its grace); never raises."""
        log.info("shutting down: stopping %d processes", len(self.by_uid))
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        stops = [self._stop(pp, "the runner is stopping") for pp in list(self.by_uid.values())]
        for failure in await asyncio.gather(*stops, return_exceptions=True):
            if isinstance(failure, BaseException):
                log.error("stopping a process failed: %r", failure)
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for pp in list(self.stopping):  # only after a failure above
            if pp.proc is not None:
                kill_group(pp.proc.pid, signal.SIGKILL)
        self.pid_file.clear()
        log.info("stopped")

    def _save_pids(self) -> None:
        self.pid_file.save(
            processes.Tracked(f"pod {pp.label}", pp.proc.pid, self.python, str(pp.workdir / "log"))
            for pp in [*self.by_uid.values(), *self.stopping]
            if pp.proc is not None and pp.proc.returncode is None
        )

    async def _watch_control_plane(self) -> None:
        """Stop everything when the cluster's own processes are gone (``drs dev down``)."""
        while self._control_plane_running():
            await asyncio.sleep(CONTROL_PLANE_CHECK_S)

    def _control_plane_running(self) -> bool:
        components = processes.load(self.layout.pids_file)
        if components and all(processes.is_running(t) for t in components):
            return True
        if not self.shutdown.is_set():
            log.warning("the control plane of %s is not running: stopping", self.layout.state_dir)
            self.shutdown.set()
        return False

    # ------------------------------------------------------------------ list + watch
    async def _watch_pods(self) -> None:
        while True:
            try:
                version = await self._relist()
                if not self.pid_file.ready_file.exists():
                    self.pid_file.mark_ready()  # the first list is done: start_runner may return
                    log.info("watching pods (resourceVersion %s)", version)
                while True:
                    version = await self._watch_from(version)
            except Gone:
                log.info("watch expired (410 Gone): re-listing")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the apiserver restarts, times out, refuses: retry from a list
                log.warning("pod watch failed (%s); re-listing in %.0fs", describe(exc), RETRY_DELAY_S)
                await asyncio.sleep(RETRY_DELAY_S)

    async def _relist(self) -> str:
        resp = await self.core.list_pod_for_all_namespaces(
            field_selector=BOUND_PODS, _preload_content=False, _request_timeout=LIST_TIMEOUT_S
        )
        body = await read_json(resp)
        pods = body.get("items") or []
        seen = {p["metadata"]["uid"] for p in pods}
        for uid in [u for u in self.by_uid if u not in seen]:
            await self._stop(self.by_uid[uid], "the pod is gone")
        for pod in pods:
            await self._on_pod(pod)
        return str(body["metadata"]["resourceVersion"])

    async def _watch_from(self, version: str) -> str:
        import aiohttp

        resp = await self.core.list_pod_for_all_namespaces(
            field_selector=BOUND_PODS,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_SERVER_TIMEOUT_S,
            _preload_content=False,
            _request_timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=API_CALL_TIMEOUT_S, sock_read=WATCH_READ_TIMEOUT_S
            ),
        )
        try:
            if resp.status == 410:
                raise Gone()
            if resp.status >= 300:
                raise ApiError(resp.status, (await resp.read()).decode(errors="replace"))
            async for line in watch_lines(resp):
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise ApiError(int(obj.get("code") or 0), str(obj.get("message")))
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind == "DELETED":
                    uid = obj["metadata"]["uid"]
                    self.refused.discard(uid)
                    self.waiting_logged.discard(uid)
                    pp = self.by_uid.get(uid)
                    if pp is not None:
                        await self._stop(pp, "the pod was deleted")
                elif kind in ("ADDED", "MODIFIED"):
                    await self._on_pod(obj)
        finally:
            resp.release()
        return version

    async def _on_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = str(meta["uid"])
        decision = classify(pod, await self._is_dev_node(str(pod["spec"].get("nodeName", ""))))
        pp = self.by_uid.get(uid)
        if decision.action is Action.RUN:
            if pp is None:
                self._start_supervisor(pod)
            else:
                pp.pod = pod
            return
        if pp is not None:
            await self._stop(pp, decision.why)
        if decision.action is Action.REFUSE and uid not in self.refused:
            self.refused.add(uid)
            log.warning("%s/%s: %s", meta.get("namespace"), meta.get("name"), NOT_HOST_NETWORK_MESSAGE)
            await self._event(pod, Reason.NOT_HOST_NETWORK, NOT_HOST_NETWORK_MESSAGE, warning=True)
        elif decision.action is Action.WAIT and uid not in self.waiting_logged:
            self.waiting_logged.add(uid)
            log.info("%s/%s: waiting: %s", meta.get("namespace"), meta.get("name"), decision.why)

    async def _is_dev_node(self, name: str) -> bool:
        if not name:
            return False
        cached = self.node_cache.get(name)
        if cached is not None and time.monotonic() - cached[1] < NODE_CACHE_TTL_S:
            return cached[0]
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            node = await self.core.read_node(name, _request_timeout=API_CALL_TIMEOUT_S)
            key, _, value = DEV_NODE_SELECTOR.partition("=")
            is_dev = (node.metadata.labels or {}).get(key) == value
        except ApiException as exc:
            if exc.status != 404:
                raise
            is_dev = False
        self.node_cache[name] = (is_dev, time.monotonic())
        return is_dev

    # ------------------------------------------------------------------ supervision
    def _start_supervisor(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        pp = PodProcess(
            uid=str(meta["uid"]),
            namespace=str(meta["namespace"]),
            name=str(meta["name"]),
            node=str(pod["spec"]["nodeName"]),
            pod=pod,
            workdir=self.pods_dir / workdir_name(pod),
        )
        self.by_uid[pp.uid] = pp
        pp.supervisor = asyncio.create_task(self._supervise(pp), name=f"supervise {pp.label}")

    async def _supervise(self, pp: PodProcess) -> None:
        while True:
            try:
                await self._supervise_once(pp)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not leave a pod unsupervised
                log.exception("%s: supervisor failed; retrying in %.0fs", pp.label, RETRY_DELAY_S)
                await asyncio.sleep(RETRY_DELAY_S)

    async def _supervise_once(self, pp: PodProcess) -> None:
        """One start of the process and, after it exits on its own, the back-off before the next."""
        await self._wait_node_quiet(pp)
        if not self._control_plane_running():  # a process killed by `drs dev down` is not restarted
            await asyncio.Event().wait()  # until the shutdown cancels this supervisor
        try:
            argv, env = await self._command_line(pp)
            pp.probe = readiness_probe(first_container(pp.pod))
        except (EnvResolutionError, ProbeSpecError) as exc:
            await self._report_problem(pp, str(exc))
            await asyncio.sleep(ENV_RETRY_S)
            return
        pp.reported_problem = None
        exit_code = await self._run_once(pp, argv, env)
        if self.shutdown.is_set():  # killed with the runner: not a crash
            return
        pp.restarts += 1
        ran_for = time.monotonic() - pp.started_mono
        pp.consecutive_exits = next_consecutive_exits(pp.consecutive_exits, ran_for)
        delay = restart_delay_s(pp.consecutive_exits)
        message = f"runner: process exited with code {exit_code}; restarting in {delay:.0f}s"
        log.warning("%s: %s", pp.label, message)
        pp.waiting = (Reason.CRASH_LOOP.value, message)
        self._save_pids()
        await self._event(pp.pod, Reason.BACK_OFF, message, warning=True)
        await self._sync_status(pp)
        await asyncio.sleep(delay)

    async def _command_line(self, pp: PodProcess) -> tuple[list[str], dict[str, str]]:
        container = first_container(pp.pod)
        refs = referenced_objects(container)
        secrets = {n: o for n in refs.secrets if (o := await self._read_object("secret", pp.namespace, n)) is not None}
        config_maps = {
            n: o for n in refs.config_maps if (o := await self._read_object("configmap", pp.namespace, n)) is not None
        }
        host_ip = str((pp.pod.get("status") or {}).get("hostIP", ""))
        resolved = resolve(pp.pod, secrets, config_maps, extra_env={NODE_IP_ENV: host_ip})
        mounts = secret_mounts(pp.pod, pp.workdir)
        if not await self._project_secrets(pp, mounts, starting=True):
            missing = [f"volume {m.volume!r}: {m.kind} {m.secret!r} not found" for m in mounts if not m.optional]
            raise EnvResolutionError(missing)
        base = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
        env = {**base, "PYTHONUNBUFFERED": "1", **{k: localize(v, mounts) for k, v in resolved.env.items()}}
        argv = [localize(a, mounts) for a in resolved.argv]
        return local_argv(argv, self.python, self.drs_script), env

    async def _project_secrets(self, pp: PodProcess, mounts: list[SecretMount], starting: bool = False) -> bool:
        """``runner_volumes.project`` with this pod's Secrets read from the API."""
        changed = await project(mounts, lambda kind, name: self._read_object(kind, pp.namespace, name), starting)
        for volume in changed or []:
            log.info("%s: its Secret volume %s changed: files updated", pp.label, volume)
        return changed is not None

    async def _sync_secrets(self, pp: PodProcess) -> None:
        """Re-project the pod's Secrets every ``SYNC_S`` while its process runs (the kubelet's sync)."""
        mounts = secret_mounts(pp.pod, pp.workdir)
        while mounts:
            await asyncio.sleep(SECRET_SYNC_S)
            try:
                await self._project_secrets(pp, mounts)
            except Exception as exc:  # the API or the disk: the next round tries again
                log.warning("%s: syncing its Secret volumes failed: %s", pp.label, describe(exc))

    async def _read_object(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        read = self.core.read_namespaced_secret if kind == "secret" else self.core.read_namespaced_config_map
        resp = await read(name, namespace, _preload_content=False, _request_timeout=API_CALL_TIMEOUT_S)
        if resp.status == 404:
            resp.release()
            return None
        return await read_json(resp)

    async def _run_once(self, pp: PodProcess, argv: list[str], env: dict[str, str]) -> int:
        """Start the process, probe it while it runs, return its exit code."""
        pp.workdir.mkdir(parents=True, exist_ok=True)
        logfile = pp.workdir / "log"
        with logfile.open("ab") as out:
            out.write(f"--- {now()} runner: starting (restart {pp.restarts}): {' '.join(argv)}\n".encode())
            out.flush()
            try:
                proc = await spawn(pp, argv, env, out)
            except OSError as exc:
                out.write(f"--- runner: cannot start: {exc}\n".encode())
                pp.started_mono = time.monotonic()
                return 127
        pp.started_at, pp.started_mono, pp.waiting = now(), time.monotonic(), None
        pp.readiness = Readiness()
        self._save_pids()
        log.info("%s: started pid %d on %s", pp.label, proc.pid, pp.node)
        await self._event(pp.pod, Reason.STARTED, f"runner: started pid {proc.pid}: drs {' '.join(argv[2:])}")
        await self._sync_status(pp)
        probing = asyncio.create_task(self._probe_loop(pp, pp.probe)) if pp.probe else None
        syncing = asyncio.create_task(self._sync_secrets(pp))
        try:
            code = await proc.wait()
        finally:
            for task in (probing, syncing):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
        kill_group(proc.pid, signal.SIGKILL)  # what the exited process left behind in its group
        started = pp.started_at or now()
        pp.last_exit, pp.started_at = LastExit(code, started, now()), None
        pp.readiness = Readiness()
        return code

    async def _wait_node_quiet(self, pp: PodProcess) -> None:
        """Wait while a stopped process on the same node is still exiting (it may hold our port)."""
        while any(other.node == pp.node and other.alive for other in self.stopping):
            await asyncio.sleep(NODE_QUIET_POLL_S)

    async def _stop(self, pp: PodProcess, why: str) -> None:
        """Stop the supervisor, then the process group: SIGTERM, SIGKILL after the grace period."""
        if pp.stopping:
            return
        pp.stopping = True
        self.by_uid.pop(pp.uid, None)
        self.stopping.add(pp)
        if pp.supervisor is not None:
            pp.supervisor.cancel()
            await asyncio.gather(pp.supervisor, return_exceptions=True)
        task = asyncio.create_task(self._terminate(pp, why), name=f"stop {pp.label}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _terminate(self, pp: PodProcess, why: str) -> None:
        try:
            await terminate(pp, why, stop_grace_s(pp.pod))
        finally:
            self.stopping.discard(pp)
            self._save_pids()

    # ------------------------------------------------------------------ readiness and status
    async def _probe_loop(self, pp: PodProcess, probe: Probe) -> None:
        await asyncio.sleep(probe.initial_delay_s)
        while True:
            ok, detail = await probe_once(self.http, pp, probe)
            before = pp.readiness.ready
            pp.readiness = pp.readiness.observe(ok, probe)
            if pp.readiness.ready != before:
                log.info("%s: %s (%s)", pp.label, "ready" if pp.readiness.ready else "not ready", detail)
                if not pp.readiness.ready:
                    await self._event(pp.pod, Reason.UNHEALTHY, f"runner: readiness probe failed: {detail}", True)
                await self._sync_status(pp)
            await asyncio.sleep(probe.period_s)

    async def _sync_status(self, pp: PodProcess) -> None:
        """Patch the pod's status when it does not already tell the process's truth."""
        from kubernetes_asyncio.client.exceptions import ApiException

        patch = status_patch(pp.pod, container_run(pp), now())
        if patch is None:
            return
        try:
            resp = await self.core.patch_namespaced_pod_status(
                pp.name, pp.namespace, patch, _preload_content=False, _request_timeout=API_CALL_TIMEOUT_S
            )
            pp.pod = await read_json(resp)
        except (ApiError, ApiException) as exc:
            if exc.status not in (404, 409):  # gone or replaced: nothing to tell
                log.warning("%s: status patch failed: %s", pp.label, describe(exc))
        except Exception as exc:
            log.warning("%s: status patch failed: %s", pp.label, describe(exc))

    async def _report_problem(self, pp: PodProcess, problem: str) -> None:
        if problem != pp.reported_problem:
            pp.reported_problem = problem
            log.warning("%s: cannot start: %s", pp.label, problem)
            await self._event(pp.pod, Reason.CONFIG_ERROR, f"runner: {problem}", warning=True)

    async def _event(self, pod: Mapping[str, Any], reason: str, message: str, warning: bool = False) -> None:
        """Record an Event on the pod; a failure to record is logged, never raised."""
        namespace = str(pod["metadata"]["namespace"])
        try:
            await self.core.create_namespaced_event(
                namespace, event_body(pod, reason, message, warning, now()), _request_timeout=API_CALL_TIMEOUT_S
            )
        except Exception as exc:
            log.warning("event %s on %s/%s not recorded: %s", reason, namespace, pod["metadata"]["name"], describe(exc))


def run_foreground(cluster: DevCluster) -> int:
    """Run the runner in this process until SIGTERM/SIGINT or the control plane stops; return an exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per readiness probe otherwise
    if not cluster.layout.kubeconfig.is_file():
        raise DevClusterError(f"no dev cluster in {cluster.layout.state_dir}: run `drs dev up` first")
    asyncio.run(PodRunner(cluster).run())
    return 0
