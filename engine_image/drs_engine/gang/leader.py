"""Rank 0 of an engine wider than a node: the Ray head, the wait for every rank, and the watch.

Sequence (``GET /v1/gang`` shows it while it happens; ``/health`` is 503 until ``serving``):

1. ``starting``: ``ray start --head --block`` as a child process on the pod's address, its own
   port and temp dir; this process attaches to it as a driver once its port answers;
2. ``joining``: every rank's Ray node is alive (each declares its rank's resource);
3. ``loading``: the engine comes up on the whole gang — the sim backend places one actor per GPU
   across the joined nodes (:mod:`.shards`); TensorRT-LLM's Ray orchestrator finds the cluster
   through ``RAY_ADDRESS`` and places its own workers;
4. ``serving``: watched every second: the head process, every rank's node, every shard.

Anything lost after step 1 ends the gang: ``failed``, with the reason, and the process stops (the
pod's container exits non-zero; its kubelet restarts it with back-off and an Event). The other
ranks see the head go and exit too, so the engine always restarts as a whole and never serves
half-formed. Waiting for ranks has no deadline (the pods may be rescheduled); the report says who
is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Callable
from typing import Final

from drs_protocol.gang import GangReport, RankReport

from drs_engine.gang import raycluster, shards
from drs_engine.gang.spec import GangSpec, head_argv, head_temp_dir, ray_env

log = logging.getLogger("drs_engine.gang")

HEAD_START_TIMEOUT_S: Final = 120.0
CONNECT_TIMEOUT_S: Final = 60.0
JOIN_POLL_S: Final = 0.5
WATCH_PERIOD_S: Final = 1.0
#: Placing the shards' group and starting every shard.
SHARDS_START_TIMEOUT_S: Final = 180.0
SHARD_PING_TIMEOUT_S: Final = 5.0
HEAD_STOP_GRACE_S: Final = 5.0


class GangLeader:
    """The gang of one leader process (see the module docstring)."""

    def __init__(self, spec: GangSpec, host: str, *, shard_workers: bool, on_failure: Callable[[str], None]) -> None:
        self.spec = spec
        self.host = host
        self.session = uuid.uuid4().hex[:12]
        self.phase = "starting"
        self.reason = "starting the Ray head"
        self.shard_workers = shard_workers
        self.on_failure = on_failure
        self.joined: dict[int, raycluster.JoinedNode] = {}
        self.workers_alive: dict[int, int] = {}
        self.head: asyncio.subprocess.Process | None = None
        self.shards: shards.Shards | None = None
        self.connected = False
        self.failure: str | None = None
        self._watch: asyncio.Task[None] | None = None

    # ---- the report ------------------------------------------------------------------------
    def report(self) -> GangReport:
        ranks = [
            RankReport(
                rank=r,
                node_ip=self.joined[r].node_ip if r in self.joined else None,
                joined=r in self.joined,
                gpus=self.joined[r].gpus if r in self.joined else 0,
                workers_alive=self.workers_alive.get(r, 0),
            )
            for r in range(self.spec.world_size)
        ]
        return GangReport(
            world_size=self.spec.world_size,
            session=self.session,
            ray_address=f"{self.host}:{self.spec.ray_port}",
            phase=self.phase,
            ranks=ranks,
            reason=self.reason,
        )

    @property
    def serving(self) -> bool:
        return self.phase == "serving"

    # ---- bring-up ----------------------------------------------------------------------------
    async def bring_up(self) -> None:
        """Steps 1-3; on return the caller loads the engine, then calls :meth:`serve`."""
        await self._start_head()
        self.phase, self.reason = "joining", f"waiting for ranks 1..{self.spec.world_size - 1} to join"
        await self._wait_for_ranks()
        self.phase, self.reason = "loading", "every rank joined; starting the engine on the gang"
        if self.shard_workers:
            self.shards = await asyncio.to_thread(
                shards.start_shards, self.spec.world_size, self.spec.rank_gpus, SHARDS_START_TIMEOUT_S
            )
            self.workers_alive = self.shards.alive_per_rank([True] * len(self.shards.actors))
            log.info("gang: %d shards placed: %s", len(self.shards.actors), self.shards.infos)
        os.environ["RAY_ADDRESS"] = f"{self.host}:{self.spec.ray_port}"  # TensorRT-LLM's RayExecutor attaches here

    def serve(self) -> None:
        """Step 4: the engine is up on the whole gang; watch it from now on."""
        self.phase, self.reason = "serving", f"all {self.spec.world_size} ranks joined and the engine is up"
        log.info("gang: serving (%s)", self.reason)
        self._watch = asyncio.create_task(self._watch_loop(), name="gang-watch")

    async def _start_head(self) -> None:
        temp_dir = head_temp_dir(self.host, self.spec.ray_port)
        shutil.rmtree(temp_dir, ignore_errors=True)  # an earlier incarnation's session of this leader
        argv = head_argv(self.spec, self.host, temp_dir)
        log.info("gang: %s", " ".join(argv))
        self.head = await asyncio.create_subprocess_exec(
            *argv, env=ray_env(), stdin=asyncio.subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr
        )
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while not await _port_open(self.host, self.spec.ray_port):
            self._check_head()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Ray head did not listen on {self.host}:{self.spec.ray_port} within {HEAD_START_TIMEOUT_S:.0f}s"
                )
            await asyncio.sleep(JOIN_POLL_S)
        address = f"{self.host}:{self.spec.ray_port}"
        await asyncio.wait_for(asyncio.to_thread(raycluster.connect, address, self.host), CONNECT_TIMEOUT_S)
        self.connected = True

    def _check_head(self) -> None:
        if self.head is not None and self.head.returncode is not None:
            raise RuntimeError(f"the Ray head exited with code {self.head.returncode}")

    async def _wait_for_ranks(self) -> None:
        while True:
            self._check_head()
            self.joined = await asyncio.to_thread(raycluster.joined_nodes, self.spec.world_size)
            missing = [r for r in range(self.spec.world_size) if r not in self.joined]
            if not missing:
                return
            self.reason = f"waiting for rank(s) {', '.join(map(str, missing))} to join {self.host}:{self.spec.ray_port}"
            await asyncio.sleep(JOIN_POLL_S)

    # ---- the watch ---------------------------------------------------------------------------
    async def _watch_loop(self) -> None:
        try:
            while True:
                await asyncio.sleep(WATCH_PERIOD_S)
                problem = await self._check_once()
                if problem is not None:
                    self.fail(problem)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken driver connection is a lost gang as well
            self.fail(f"watching the gang failed: {type(exc).__name__}: {exc}")

    async def _check_once(self) -> str | None:
        if self.head is not None and self.head.returncode is not None:
            return f"the Ray head exited with code {self.head.returncode}"
        before = self.joined
        self.joined = await asyncio.to_thread(raycluster.joined_nodes, self.spec.world_size)
        lost = [
            r
            for r in range(self.spec.world_size)
            if r not in self.joined or self.joined[r].node_id != before[r].node_id
        ]
        if lost:
            return f"rank(s) {', '.join(map(str, lost))} left the gang (their Ray node is gone)"
        if self.shards is not None:
            alive = await asyncio.to_thread(shards.ping_all, self.shards, SHARD_PING_TIMEOUT_S)
            self.workers_alive = self.shards.alive_per_rank(alive)
            dead = [i for i, ok in enumerate(alive) if not ok]
            if dead:
                return f"engine worker(s) {', '.join(map(str, dead))} of {len(alive)} died"
        return None

    def fail(self, reason: str) -> None:
        """The gang is lost: report it and end this process's serving (the pod restarts, the gang with it)."""
        if self.failure is not None:
            return
        self.failure = reason
        self.phase, self.reason = "failed", reason
        log.error("gang failed: %s; stopping so that the whole engine restarts", reason)
        self.on_failure(reason)

    # ---- shutdown ----------------------------------------------------------------------------
    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch
        if self.shards is not None and self.failure is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.to_thread(shards.stop_shards, self.shards), SHARD_PING_TIMEOUT_S)
        if self.connected:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.to_thread(raycluster.disconnect), SHARD_PING_TIMEOUT_S)
        await stop_process(self.head)
        shutil.rmtree(head_temp_dir(self.host, self.spec.ray_port), ignore_errors=True)


async def _port_open(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def stop_process(proc: asyncio.subprocess.Process | None) -> None:
    """SIGTERM, then SIGKILL after the grace (``ray start --block`` takes its processes with it)."""
    if proc is None or proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), HEAD_STOP_GRACE_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
