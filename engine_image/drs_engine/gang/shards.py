"""The sim backend's multi-rank mode: one Ray actor per GPU, placed across the joined nodes.

The leader asks Ray for a placement group of one bundle per GPU, each bundle pinned to its rank's
node by the rank's custom resource (``drs_protocol.gang.rank_resource``), and starts one
:class:`SimShard` actor in each bundle. The engine serves only once every shard answered, and the
leader's watch pings them: a shard that dies (its node's pod was killed, its node lost) fails the
gang. This is the shape of TensorRT-LLM's Ray orchestrator (a placement group, one GPU worker actor
per rank); the sim shards do no model work, they are the test double of those workers.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass
from typing import Any, Final

from drs_protocol.gang import rank_resource

#: A bundle asks this much of its rank's resource (any positive amount pins it to that node).
PIN: Final = 0.001


class SimShard:
    """One GPU's engine worker (a Ray actor): where it runs and which GPU Ray gave it."""

    def __init__(self, rank: int, local_index: int) -> None:
        self.rank = rank
        self.local_index = local_index

    def info(self) -> dict[str, Any]:
        ray = _ray()
        return {
            "rank": self.rank,
            "local_index": self.local_index,
            "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
        }

    def ping(self) -> int:
        return self.rank


def bundles(world_size: int, rank_gpus: int) -> list[dict[str, float]]:
    """One bundle per GPU in rank order, each pinned to its rank's node."""
    return [{"GPU": 1.0, rank_resource(r): PIN} for r in range(world_size) for _ in range(rank_gpus)]


@dataclass
class Shards:
    """The placement group and its actors (handles are Ray objects)."""

    placement_group: Any
    actors: list[Any]
    infos: list[dict[str, Any]]

    def alive_per_rank(self, alive: list[bool]) -> dict[int, int]:
        out: dict[int, int] = {}
        for info, ok in zip(self.infos, alive, strict=True):
            out[int(info["rank"])] = out.get(int(info["rank"]), 0) + int(ok)
        return out


def start_shards(world_size: int, rank_gpus: int, timeout_s: float) -> Shards:
    """Place the group and start every shard; raise when either does not happen within ``timeout_s``."""
    ray = _ray()
    pg_module = importlib.import_module("ray.util.placement_group")
    placement_group, remove_placement_group = pg_module.placement_group, pg_module.remove_placement_group
    scheduling = importlib.import_module("ray.util.scheduling_strategies").PlacementGroupSchedulingStrategy

    pg = placement_group(bundles(world_size, rank_gpus), strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
        actor_class = ray.remote(num_cpus=0, num_gpus=1)(SimShard)
        actors = [
            actor_class.options(
                scheduling_strategy=scheduling(placement_group=pg, placement_group_bundle_index=i),
            ).remote(i // rank_gpus, i % rank_gpus)
            for i in range(world_size * rank_gpus)
        ]
        infos = ray.get([a.info.remote() for a in actors], timeout=timeout_s)
    except BaseException:
        remove_placement_group(pg)
        raise
    return Shards(placement_group=pg, actors=actors, infos=list(infos))


def ping_all(shards: Shards, timeout_s: float) -> list[bool]:
    """Which shards answer within ``timeout_s`` (a dead actor or node: ``False``)."""
    ray = _ray()
    refs = [a.ping.remote() for a in shards.actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    out = []
    for ref in refs:
        if ref not in done:
            out.append(False)
            continue
        try:
            ray.get(ref, timeout=0)
            out.append(True)
        except Exception:  # RayActorError, ActorDiedError, node died: the shard is gone
            out.append(False)
    return out


def stop_shards(shards: Shards) -> None:
    ray = _ray()
    for actor in shards.actors:
        with contextlib.suppress(Exception):  # already dead with its node
            ray.kill(actor)
    with contextlib.suppress(Exception):
        importlib.import_module("ray.util.placement_group").remove_placement_group(shards.placement_group)


def _ray() -> Any:
    """``ray``, imported on first use (an engine of one pod never imports it)."""
    return importlib.import_module("ray")
