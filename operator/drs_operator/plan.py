"""``plan(spec, name)``: the engine and frontend slots of a DisaggReplicaSet, before placement.

The plan is the single source of truth every other decision derives from (placement, child
objects, status, URLs). It is a pure function of the spec and the resource's name.

Algorithm
    * Replica count N = ``spec.replicas``, or ``spec.inferenceGPUs / replica width`` (which must
      divide; exactly one of the two is set), where replica width = M·prefill width + K·decode
      width and an engine's width is its role's ``tensorParallelSize``.
    * Engine slots are laid out replica by replica, prefill before decode, same-role engines
      contiguous: ``[prefill×M, decode×K, prefill×M, decode×K, …]``. Slot ``i`` (global index) of
      replica ``r`` is named ``<drs>-r<r>-<role>-<ordinal>``; its port is ``trtllm.enginePort``,
      or with host networking ``enginePort + i`` (engines sharing a node need distinct ports).
    * Frontend ``f`` of replica ``r`` listens on ``basePort + r·F + f`` and has snowflake node id
      ``r·F + f``.
    * Each role's TensorRT-LLM arguments are ``spec.trtllm.kwargs`` deep-merged with the role's
      ``trtllmKwargs`` (a nested block such as ``kv_cache_config`` adds to the shared block; any
      other value replaces). The typed knobs (parallelism, batch limits, memory fraction, the
      model's maxModelLen and precision) travel as typed fields of the engine config; the one
      derivation of ``LLM(...)`` kwargs from both is ``drs_engine.backends.trtllm.translate.build_llm_kwargs``.

Invariants (tested, including by hypothesis): slot indices are 0..N·(M+K)-1 in order; names are
unique; frontend ports and node ids are unique and replica-major; the plan uses N × replica width
GPUs. ``tiling_problem`` states when a layout packs node by node without crossing a boundary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from drs_protocol.trtllm_kwargs import deep_merge

from drs_operator.api import names
from drs_operator.api.constants import ROLES, Role
from drs_operator.api.spec import DisaggReplicaSetSpec


class PlanError(ValueError):
    """The spec has no plan (the replica count cannot be derived). ``validation`` says why, with paths."""


@dataclass(frozen=True)
class EngineSlot:
    """One engine of the plan."""

    index: int  #: position in the plan, 0-based over all replicas
    replica: int
    role: Role
    ordinal: int  #: position among the replica's engines of this role
    width: int  #: GPUs
    name: str  #: stable name, also the rank-0 pod's name
    port: int  #: HTTP port of the engine server


@dataclass(frozen=True)
class FrontendSlot:
    """One frontend of the plan."""

    replica: int
    index: int  #: f, within the replica
    port: int  #: basePort + r*F + f
    node_id: int  #: r*F + f, unique over all N×F frontends
    name: str  #: Deployment and Service name


@dataclass(frozen=True)
class ReplicaPlan:
    index: int
    engines: tuple[EngineSlot, ...]  #: prefill engines first, then decode
    frontends: tuple[FrontendSlot, ...]

    @property
    def width(self) -> int:
        return sum(e.width for e in self.engines)

    def role_engines(self, role: Role) -> tuple[EngineSlot, ...]:
        return tuple(e for e in self.engines if e.role is role)


@dataclass(frozen=True)
class RolePlan:
    """What every engine of one role looks like."""

    role: Role
    engines: int  #: per replica
    width: int
    #: The user's TensorRT-LLM arguments of this role, merged (JSON-ready; do not mutate).
    trtllm_kwargs: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class Plan:
    """The slots of a DisaggReplicaSet named ``name``."""

    name: str
    replica_width: int
    replicas: tuple[ReplicaPlan, ...]
    roles: tuple[RolePlan, ...]  #: prefill, decode
    frontends_per_replica: int
    host_network: bool
    gpus_per_node: int | None  #: ``spec.topology.gpusPerNode``

    @property
    def engines(self) -> tuple[EngineSlot, ...]:
        return tuple(e for r in self.replicas for e in r.engines)

    @property
    def frontends(self) -> tuple[FrontendSlot, ...]:
        return tuple(f for r in self.replicas for f in r.frontends)

    @property
    def gpus(self) -> int:
        return self.replica_width * len(self.replicas)

    @property
    def replica_widths(self) -> tuple[int, ...]:
        """Engine widths of one replica in slot order (the same for every replica)."""
        return tuple(r.width for r in self.roles for _ in range(r.engines))

    def role(self, role: Role) -> RolePlan:
        return next(r for r in self.roles if r.role is role)


def replica_count(spec: DisaggReplicaSetSpec) -> int:
    """N: ``replicas``, or ``inferenceGPUs / replica width``. Raises :class:`PlanError`."""
    if (spec.replicas is None) == (spec.inference_gpus is None):
        raise PlanError("set exactly one of replicas and inferenceGPUs")
    if spec.replicas is not None:
        return spec.replicas
    assert spec.inference_gpus is not None
    if spec.inference_gpus % spec.replica_width:
        raise PlanError(
            f"inferenceGPUs {spec.inference_gpus} is not a multiple of the replica width {spec.replica_width}"
        )
    return spec.inference_gpus // spec.replica_width


def plan(spec: DisaggReplicaSetSpec, name: str) -> Plan:
    """The plan of DisaggReplicaSet ``name`` with ``spec`` (see the module docstring)."""
    n = replica_count(spec)
    f_count = spec.frontend.workers
    roles = tuple(
        RolePlan(
            role=role,
            engines=spec.role(role).engines,
            width=spec.role(role).width,
            trtllm_kwargs=merged_kwargs(spec, role),
        )
        for role in ROLES
    )
    replicas: list[ReplicaPlan] = []
    index = 0
    for r in range(n):
        engines: list[EngineSlot] = []
        for role_plan in roles:
            for ordinal in range(role_plan.engines):
                port = spec.trtllm.engine_port + index if spec.network.host_network else spec.trtllm.engine_port
                engines.append(
                    EngineSlot(
                        index=index,
                        replica=r,
                        role=role_plan.role,
                        ordinal=ordinal,
                        width=role_plan.width,
                        name=names.engine_name(name, r, role_plan.role, ordinal),
                        port=port,
                    )
                )
                index += 1
        frontends = tuple(
            FrontendSlot(
                replica=r,
                index=f,
                port=spec.frontend.base_port + r * f_count + f,
                node_id=r * f_count + f,
                name=names.frontend_name(name, r, f),
            )
            for f in range(f_count)
        )
        replicas.append(ReplicaPlan(index=r, engines=tuple(engines), frontends=frontends))
    return Plan(
        name=name,
        replica_width=spec.replica_width,
        replicas=tuple(replicas),
        roles=roles,
        frontends_per_replica=f_count,
        host_network=spec.network.host_network,
        gpus_per_node=spec.topology.gpus_per_node,
    )


# --- TensorRT-LLM arguments -----------------------------------------------------------------
def merged_kwargs(spec: DisaggReplicaSetSpec, role: Role) -> dict[str, Any]:
    """``spec.trtllm.kwargs`` deep-merged with the role's ``trtllmKwargs``."""
    return deep_merge(spec.trtllm.kwargs, spec.role(role).trtllm_kwargs or {})


# --- tiling ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TilingProblem:
    """Why engine widths do not tile nodes of ``node_size`` GPUs."""

    node_size: int
    widths: tuple[int, ...]
    repeat: int  #: which back-to-back copy of the replica (0-based) hits the problem
    engine: int  #: the engine's position in the replica
    width: int
    offset: int  #: first GPU of the engine when packed
    boundary: int  #: the node boundary (a GPU index) it would cross, or fall short of

    def __str__(self) -> str:
        seq = "+".join(map(str, self.widths))
        last = self.offset + self.width - 1
        who = f"engine {self.engine} (width {self.width}) of replica copy {self.repeat}, at GPUs {self.offset}-{last},"
        if self.width > self.node_size and self.offset % self.node_size == 0:
            what = f"is wider than a node but not whole nodes: it would end short of the node boundary at GPU {self.boundary}"
        elif self.width > self.node_size:
            what = f"is wider than a node but would start mid-node, across the node boundary at GPU {self.boundary}"
        else:
            what = f"would cross the node boundary at GPU {self.boundary}"
        return (
            f"engine widths {seq} do not tile {self.node_size}-GPU nodes: packing replicas back to back "
            f"node by node, {who} {what}"
        )


def tiling_problem(widths: Sequence[int], node_size: int) -> TilingProblem | None:
    """The first engine that breaks tiling when replicas of ``widths`` are packed node by node.

    Replicas are packed back to back from GPU 0 on nodes of ``node_size`` GPUs, enough copies that
    every phase a replica can start at occurs (``node_size / gcd(replica width, node_size)``
    copies). An engine no wider than a node must lie inside one node; a wider one must start on a
    node boundary and be a whole number of nodes. A layout that passes packs any number of
    replicas with no engine straddling a node and no GPU stranded, so the answer does not depend
    on the replica count. ``None`` means the widths tile.
    """
    total = sum(widths)
    if total <= 0:
        return None
    copies = node_size // math.gcd(total, node_size)
    offset = 0
    for c in range(copies):
        for i, w in enumerate(widths):
            start_node = offset // node_size
            if w > node_size and offset % node_size:
                boundary = (start_node + 1) * node_size
            elif w > node_size and w % node_size:
                boundary = -(-(offset + w) // node_size) * node_size
            elif w <= node_size and (offset + w - 1) // node_size != start_node:
                boundary = (start_node + 1) * node_size
            else:
                offset += w
                continue
            return TilingProblem(node_size, tuple(widths), c, i, w, offset, boundary)
    return None
