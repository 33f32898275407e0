"""The gang of this pod (from its environment) and the ``ray start`` command lines it runs.

Pure functions, unit-tested. The Ray processes are kept as small as Ray allows, because a node may
run several of them beside the engine: no dashboard, no log monitor, no usage stats, a small
object store, one CPU per GPU (TensorRT-LLM's default bundles ask for as many), and every address
bound to the pod's own (``--node-ip-address``). The head gets its own ``--port`` and ``--temp-dir``
(two leaders on one machine never share a session), and a short health-check period so a lost
rank is noticed in seconds; a joining node gives up quickly when its head is gone, so the whole
gang restarts together.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from drs_protocol import env
from drs_protocol import gang as contract

from drs_engine.config import BackendName, EngineConfig

#: Exit status of an engine process whose gang is lost (its pod restarts, and the gang with it).
EXIT_GANG_LOST: Final = 4
#: Object store per Ray node (bytes): the engine moves no objects through Ray.
OBJECT_STORE_BYTES: Final = 80 * 1024 * 1024
#: Environment of every Ray process we start (``RAY_<config>`` are Ray's own configuration knobs).
RAY_ENV: Final[Mapping[str, str]] = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # the head notices a dead node within ~3 s (default: 3 s x 5 after a 5 s delay)
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    # a joined node whose head is gone exits after 5 s (default 60 s): its rank restarts with the gang
    "RAY_gcs_rpc_server_reconnect_timeout_s": "5",
    # no idle Python workers started ahead of need; no memory monitor killing workers on a shared host
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
    "RAY_memory_monitor_refresh_ms": "0",
}


SOCKET_ROOT: Final = Path("/tmp")


class GangSpecError(ValueError):
    """A gang variable is missing or wrong; the message names it and the rule."""


@dataclass(frozen=True)
class GangSpec:
    """This pod's place in its engine."""

    rank: int
    world_size: int
    leader_address: str
    ray_port: int
    rank_gpus: int

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def ray_address(self) -> str:
        host = f"[{self.leader_address}]" if ":" in self.leader_address else self.leader_address
        return f"{host}:{self.ray_port}"


def gang_from_env(environ: Mapping[str, str]) -> GangSpec | None:
    """The gang of this pod, or ``None`` for an engine of one pod (no or a 1 ``DRS_WORLD_SIZE``)."""
    world = _int(environ, env.WORLD_SIZE, default=1, minimum=1)
    if world == 1:
        return None
    rank = _int(environ, env.RANK, default=None, minimum=0)
    if rank >= world:
        raise GangSpecError(f"{env.RANK}={rank} must be below {env.WORLD_SIZE}={world}")
    leader = environ.get(env.LEADER_ADDRESS, "").strip()
    if not leader:
        raise GangSpecError(f"{env.LEADER_ADDRESS} must name the leader's address when {env.WORLD_SIZE} > 1")
    port = _int(environ, env.RAY_PORT, default=contract.DEFAULT_RAY_PORT, minimum=1)
    if port > contract.MAX_PORT:
        raise GangSpecError(f"{env.RAY_PORT}={port} must be at most {contract.MAX_PORT}")
    gpus = _int(environ, env.RANK_GPUS, default=None, minimum=1)
    return GangSpec(rank=rank, world_size=world, leader_address=leader, ray_port=port, rank_gpus=gpus)


def _int(environ: Mapping[str, str], name: str, *, default: int | None, minimum: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        if default is None:
            raise GangSpecError(f"{name} is required for an engine wider than a node")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise GangSpecError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise GangSpecError(f"{name} must be at least {minimum}, got {value}")
    return value


def ray_executable() -> str:
    """The ``ray`` command of this Python (the one the engine runs under)."""
    return str(Path(sys.executable).parent / "ray")


def head_temp_dir(host: str, port: int) -> Path:
    """The head's session root: unique per leader, and under ``/tmp`` whatever ``$TMPDIR`` says,
    because Ray's Unix sockets live ~70 characters below it and a socket path has at most 107."""
    return SOCKET_ROOT / f"drs-ray-{host}-{port}"


def _common(spec: GangSpec, host: str) -> list[str]:
    return [
        "--block",
        f"--node-ip-address={host}",
        f"--num-cpus={spec.rank_gpus}",
        f"--num-gpus={spec.rank_gpus}",
        f"--resources={json.dumps({contract.rank_resource(spec.rank): 1})}",
        f"--object-store-memory={OBJECT_STORE_BYTES}",
        "--disable-usage-stats",
        "--include-log-monitor=false",
        "--log-style=record",
        "--log-color=false",
    ]


def head_argv(spec: GangSpec, host: str, temp_dir: Path) -> list[str]:
    """``ray start --head`` of the leader, on its own address and port."""
    return [
        ray_executable(),
        "start",
        "--head",
        f"--port={spec.ray_port}",
        f"--temp-dir={temp_dir}",
        "--include-dashboard=false",
        *_common(spec, host),
    ]


def worker_argv(spec: GangSpec, host: str) -> list[str]:
    """``ray start --address=<leader>`` of a rank > 0, declaring its node slice's GPUs."""
    return [ray_executable(), "start", f"--address={spec.ray_address}", *_common(spec, host)]


def for_gang(config: EngineConfig) -> EngineConfig:
    """The engine config of a gang's leader: TensorRT-LLM runs its workers through Ray
    (``orchestrator_type: ray``, unless ``trtllmKwargs`` chose otherwise), attaching to the gang's
    cluster (``RAY_ADDRESS``) and placing them across its nodes. The sim ignores the kwargs."""
    if config.backend is not BackendName.TRTLLM or "orchestrator_type" in config.trtllm_kwargs:
        return config
    return config.model_copy(update={"trtllm_kwargs": {**config.trtllm_kwargs, "orchestrator_type": "ray"}})


def ray_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a Ray process: ``base`` (default: ours) with :data:`RAY_ENV` over it."""
    return {**(dict(os.environ) if base is None else dict(base)), **RAY_ENV}
