"""Validation of a DisaggReplicaSet: every problem at once, each with its field path.

``validate_spec(spec)`` is the one pure function holding the cross-field rules (the single-field
rules are the models' own). ``validate_manifest(data)`` is what ``drs plan`` and the operator call
on raw input: it runs the models' validation and the cross-field rules together, so a person sees
every problem in one go. When some blocks of the spec fail to parse, the cross-field rules still
run over the blocks that did parse (each rule runs when all of its inputs parsed).

Rules (paths are reported under ``spec.``; the CEL twins of the first ones live in
``drs_operator.api.rules`` with the same message text):

* per role: ``moeTensorParallelSize * moeExpertParallelSize == tensorParallelSize`` (each must
  divide it when only one is set); ``precision``, ``maxModelLen`` and ``parsers`` are rejected;
* exactly one of ``replicas`` and ``inferenceGPUs``; the replica width divides ``inferenceGPUs``;
* ``N * F <= 256``; frontend ports ``basePort .. basePort + N*F - 1`` stay ≤ 65535 and do not
  overlap the engine ports (``enginePort``, or with host networking ``enginePort + i`` for every
  engine ``i``, which must stay ≤ 65535 too);
* ``engine.simOptions`` (deprecated) is exclusive with ``engine.sim`` and must parse as it;
* with ``engine.backend: torch`` every role's ``tensorParallelSize`` (and MoE size) is 1;
* ``frontend.groupHoldSeconds`` above 0 needs ``frontend.groupRouting``;
* ``metadata.name`` is a DNS label of at most 40 characters (so every child name fits);
* beyond CEL: with ``topology.gpusPerNode`` the engine widths must tile nodes of that size
  (``plan.tiling_problem``); TensorRT-LLM kwargs may not set what a typed field owns (for
  example ``tensor_parallel_size``, ``max_seq_len``, ``dtype``), and their
  ``cache_transceiver_config`` must parse as the engine config's ``cacheTransceiver``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from drs_protocol.engine_config import CacheTransceiverSpec, SimSpec
from drs_protocol.validation_errors import field_problems
from pydantic import ValidationError

from drs_operator.api import rules
from drs_operator.api.constants import (
    API_VERSION,
    KIND,
    MAX_FRONTENDS,
    MAX_NAME_LENGTH,
    MAX_PORT,
    ROLES,
    EngineBackend,
    Role,
)
from drs_operator.api.resource import DisaggReplicaSet
from drs_operator.api.spec import (
    DisaggReplicaSetSpec,
    EngineSpec,
    FrontendSpec,
    NetworkPolicySpec,
    NetworkSpec,
    RoleSpec,
    TopologySpec,
    TrtllmSpec,
)
from drs_operator.plan import tiling_problem


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the input: where (a dotted field path) and which rule."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


#: TensorRT-LLM arguments that typed fields own: kwargs key -> where to set it instead.
OWNED_KWARGS: Mapping[str, str] = {
    "tensor_parallel_size": "the role's tensorParallelSize",
    "moe_tensor_parallel_size": "the role's moeTensorParallelSize",
    "moe_expert_parallel_size": "the role's moeExpertParallelSize",
    "pipeline_parallel_size": "nowhere: an engine's width is its tensorParallelSize (TensorRT-LLM serves with pp=1)",
    "max_batch_size": "the role's maxBatchSize",
    "max_num_tokens": "the role's maxNumTokens",
    "max_seq_len": "spec.model.maxModelLen",
    "dtype": "spec.model.precision",
}
OWNED_KV_CACHE_KWARGS: Mapping[str, str] = {"free_gpu_memory_fraction": "the role's gpuMemoryUtilization"}


# --- entry points ---------------------------------------------------------------------------
def validate_spec(spec: DisaggReplicaSetSpec, path: str = "spec") -> list[Problem]:
    """Every cross-field problem of a parsed ``spec`` (empty when valid)."""
    return _cross_field(_Parts.of(spec), path)


def validate_name(name: str, path: str = "metadata.name") -> list[Problem]:
    """The name rule (a DNS label of at most ``MAX_NAME_LENGTH`` characters)."""
    if len(name) > MAX_NAME_LENGTH or not re.fullmatch(rules.NAME_PATTERN, name):
        return [Problem(path, f"{rules.MSG_NAME} (got {name!r}, {len(name)} characters)")]
    return []


def validate_manifest(data: Any) -> tuple[DisaggReplicaSet | None, list[Problem]]:
    """Parse a DisaggReplicaSet manifest; return it (``None`` if anything is wrong) and every problem."""
    if not isinstance(data, Mapping):
        return None, [Problem("<root>", f"expected a {KIND} object, got {type(data).__name__}")]
    problems: list[Problem] = []
    resource: DisaggReplicaSet | None = None
    try:
        resource = DisaggReplicaSet.model_validate(data)
    except ValidationError as exc:
        problems.extend(problems_from_pydantic(exc))
    if data.get("apiVersion") is None or data.get("kind") is None:
        problems.append(Problem("apiVersion/kind", f"expected apiVersion: {API_VERSION} and kind: {KIND}"))
    metadata = data.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    if isinstance(name, str):
        problems.extend(validate_name(name))
    raw_spec = data.get("spec")
    if resource is not None:
        problems.extend(validate_spec(resource.spec))
    elif isinstance(raw_spec, Mapping):
        problems.extend(_cross_field(_Parts.parse(raw_spec), "spec"))
    problems = _dedupe(problems)
    return (resource if not problems else None), problems


def validate_spec_data(data: Any, path: str = "spec") -> tuple[DisaggReplicaSetSpec | None, list[Problem]]:
    """Like :func:`validate_manifest` for a bare spec."""
    try:
        spec = DisaggReplicaSetSpec.model_validate(data)
    except ValidationError as exc:
        problems = problems_from_pydantic(exc, path)
        if isinstance(data, Mapping):
            problems.extend(_cross_field(_Parts.parse(data), path))
        return None, _dedupe(problems)
    problems = validate_spec(spec, path)
    return (spec if not problems else None), problems


def problems_from_pydantic(exc: ValidationError, prefix: str = "") -> list[Problem]:
    """Pydantic errors as problems with dotted camelCase paths (``spec.prefill.engines``, ``…[0]``)."""
    out: list[Problem] = []
    for err in field_problems(exc.errors(), prefix):
        if err.kind == "missing":
            message = "required field is missing"
        elif err.kind == "extra_forbidden":
            message = "unknown field (not part of the DisaggReplicaSet API)"
        else:
            message = err.message
            if not isinstance(err.value, Mapping | list):
                message += f" (got {err.value!r})"
        out.append(Problem(err.path or "<root>", message))
    return out


# --- the rules ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Parts:
    """The spec's top-level blocks that parsed (``None``: missing input for a rule)."""

    replicas: int | None
    inference_gpus: int | None
    counts_ok: bool  # both replicas and inferenceGPUs parsed (each may be absent)
    engine: EngineSpec | None
    prefill: RoleSpec | None
    decode: RoleSpec | None
    frontend: FrontendSpec | None
    trtllm: TrtllmSpec | None
    network: NetworkSpec | None
    topology: TopologySpec | None
    network_policy: NetworkPolicySpec | None

    @classmethod
    def of(cls, spec: DisaggReplicaSetSpec) -> _Parts:
        return cls(
            spec.replicas,
            spec.inference_gpus,
            True,
            spec.engine,
            spec.prefill,
            spec.decode,
            spec.frontend,
            spec.trtllm,
            spec.network,
            spec.topology,
            spec.network_policy,
        )

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> _Parts:
        """Parse each block on its own, keeping those that validate (see :func:`_parse_block`)."""
        parsed: dict[str, Any] = {}
        failed: set[str] = set()
        for name in DisaggReplicaSetSpec.model_fields:
            if name != "model":
                parsed[name], ok = _parse_block(name, data)
                if not ok:
                    failed.add(name)
        return cls(
            parsed["replicas"],
            parsed["inference_gpus"],
            not ({"replicas", "inference_gpus"} & failed),
            parsed["engine"],
            parsed["prefill"],
            parsed["decode"],
            parsed["frontend"],
            parsed["trtllm"],
            parsed["network"],
            parsed["topology"],
            parsed["network_policy"],
        )


#: Fields inside a block that cross-field rules read: a block failing on one of them sits out.
_RULE_INPUTS = frozenset(
    {
        "engines",
        "tensorParallelSize",
        "moeTensorParallelSize",
        "moeExpertParallelSize",
        "precision",
        "maxModelLen",
        "parsers",
        "workers",
        "basePort",
        "enginePort",
        "hostNetwork",
        "gpusPerNode",
        "enabled",
        "standby",
        "groupRouting",
        "groupHoldSeconds",
    }
)


def _parse_block(name: str, data: Mapping[str, Any]) -> tuple[Any, bool]:
    """``(value, parsed)`` of spec field ``name`` validated alone (beside a stand-in model).

    A block whose only invalid fields are ones no cross-field rule reads is parsed again without
    them, so its other rules still run (pydantic has already reported those fields).
    """
    key = DisaggReplicaSetSpec.model_fields[name].alias or name
    if key not in data:
        return getattr(DisaggReplicaSetSpec.model_validate({"model": {"path": "-"}}), name), True
    value = data[key]
    for attempt in range(2):
        try:
            return getattr(DisaggReplicaSetSpec.model_validate({"model": {"path": "-"}, key: value}), name), True
        except ValidationError as exc:
            locs = [err["loc"] for err in exc.errors()]
            bad = {loc[1] for loc in locs if len(loc) >= 2}
            if attempt or not isinstance(value, Mapping) or any(len(loc) < 2 for loc in locs) or bad & _RULE_INPUTS:
                return None, False
            value = {k: v for k, v in value.items() if k not in bad}
    return None, False


def _cross_field(p: _Parts, path: str) -> list[Problem]:
    problems: list[Problem] = []
    if p.network_policy is not None and p.network_policy.enabled and p.network is not None and p.network.host_network:
        problems.append(Problem(f"{path}.networkPolicy.enabled", rules.MSG_POLICY_HOST_NETWORK))
    if p.engine is not None:
        problems.extend(_engine_problems(p.engine, f"{path}.engine"))
    if p.frontend is not None and p.frontend.standby and p.network is not None and p.network.host_network:
        problems.append(Problem(f"{path}.frontend.standby", rules.MSG_STANDBY_HOST_NETWORK))
    if p.frontend is not None and not p.frontend.group_routing and p.frontend.group_hold_seconds:
        hold = p.frontend.group_hold_seconds
        problems.append(
            Problem(f"{path}.frontend.groupHoldSeconds", f"{rules.MSG_GROUP_HOLD_ROUTING} (it is {hold:g})")
        )
    for role in ROLES:
        block = p.prefill if role == Role.PREFILL else p.decode
        if block is not None:
            problems.extend(_role_problems(block, f"{path}.{role}"))
            if p.engine is not None and p.engine.backend is EngineBackend.TORCH:
                problems.extend(_torch_width_problems(block, f"{path}.{role}"))
    if p.trtllm is not None:
        problems.extend(_kwargs_problems(p.trtllm.kwargs, f"{path}.trtllm.kwargs"))
    if p.prefill is None or p.decode is None:
        return problems
    width = p.prefill.engines * p.prefill.width + p.decode.engines * p.decode.width
    n = _replica_count(p, width, path, problems)
    if p.topology is not None and p.topology.gpus_per_node is not None:
        widths = [p.prefill.width] * p.prefill.engines + [p.decode.width] * p.decode.engines
        tiling = tiling_problem(widths, p.topology.gpus_per_node)
        if tiling is not None:
            problems.append(Problem(f"{path}.topology.gpusPerNode", str(tiling)))
    if n is None or p.frontend is None:
        return problems
    nf = n * p.frontend.workers
    if nf > MAX_FRONTENDS:
        problems.append(
            Problem(f"{path}.frontend.workers", f"{rules.MSG_FRONTEND_COUNT}; got {n} * {p.frontend.workers} = {nf}")
        )
    last_frontend = p.frontend.base_port + nf - 1
    if last_frontend > MAX_PORT:
        problems.append(
            Problem(
                f"{path}.frontend.basePort",
                f"{rules.MSG_FRONTEND_PORT_RANGE}; got {p.frontend.base_port} + {nf} - 1 = {last_frontend}",
            )
        )
    if p.trtllm is None or p.network is None:
        return problems
    engines = n * (p.prefill.engines + p.decode.engines)
    first_engine = p.trtllm.engine_port
    last_engine = first_engine + (engines if p.network.host_network else 1) - 1
    if nf > 0 and not (last_engine < p.frontend.base_port or first_engine > last_frontend):
        engine_range = f"{first_engine}" if last_engine == first_engine else f"{first_engine}-{last_engine}"
        problems.append(
            Problem(
                f"{path}.trtllm.enginePort",
                f"{rules.MSG_ENGINE_PORT_COLLISION}; engine ports {engine_range} overlap frontend ports {p.frontend.base_port}-{last_frontend}",
            )
        )
    if p.network.host_network and first_engine + engines - 1 > MAX_PORT:
        problems.append(
            Problem(
                f"{path}.trtllm.enginePort",
                f"{rules.MSG_ENGINE_PORT_RANGE}; got {first_engine} + {engines} - 1 = {first_engine + engines - 1}",
            )
        )
    return problems


def _replica_count(p: _Parts, width: int, path: str, problems: list[Problem]) -> int | None:
    if not p.counts_ok:
        return None
    if (p.replicas is None) == (p.inference_gpus is None):
        both = "both are set" if p.replicas is not None else "neither is set"
        problems.append(Problem(f"{path}.replicas", f"{rules.MSG_REPLICAS_XOR}; {both}"))
        return None
    if p.replicas is not None:
        return p.replicas
    assert p.inference_gpus is not None
    if p.inference_gpus % width:
        problems.append(
            Problem(
                f"{path}.inferenceGPUs",
                f"{rules.MSG_INFERENCE_GPUS_DIVISIBLE}; {p.inference_gpus} is not a multiple of {width}",
            )
        )
        return None
    return p.inference_gpus // width


def _engine_problems(engine: EngineSpec, path: str) -> list[Problem]:
    """The deprecated ``simOptions``: exclusive with ``sim``, and checked as ``sim`` would be."""
    if engine.sim_options is None:
        return []
    if engine.sim is not None:
        return [Problem(f"{path}.simOptions", rules.MSG_SIM_OPTIONS_ALIAS)]
    try:
        SimSpec.model_validate(engine.sim_options)
    except ValidationError as exc:
        return problems_from_pydantic(exc, f"{path}.simOptions")
    return []


def _torch_width_problems(role: RoleSpec, path: str) -> list[Problem]:
    """The torch backend's engines are one GPU wide (``EngineConfig`` refuses anything else)."""
    sizes = {
        "tensorParallelSize": role.tensor_parallel_size,
        "moeTensorParallelSize": role.moe_tensor_parallel_size,
        "moeExpertParallelSize": role.moe_expert_parallel_size,
    }
    return [
        Problem(f"{path}.{name}", f"{rules.MSG_TORCH_WIDTH}; got {size}")
        for name, size in sizes.items()
        if size is not None and size != 1
    ]


def _role_problems(role: RoleSpec, path: str) -> list[Problem]:
    out: list[Problem] = []
    tp, mtp, mep = role.tensor_parallel_size, role.moe_tensor_parallel_size, role.moe_expert_parallel_size
    if mtp is not None and mep is not None and mtp * mep != tp:
        out.append(
            Problem(
                f"{path}.moeExpertParallelSize",
                f"{rules.MSG_MOE_SPLIT}; got {mtp} * {mep} = {mtp * mep}, tensorParallelSize is {tp}",
            )
        )
    if mtp is not None and tp % mtp:
        out.append(Problem(f"{path}.moeTensorParallelSize", f"{rules.MSG_MOE_TP_DIVIDES}; {mtp} does not divide {tp}"))
    if mep is not None and tp % mep:
        out.append(Problem(f"{path}.moeExpertParallelSize", f"{rules.MSG_MOE_EP_DIVIDES}; {mep} does not divide {tp}"))
    if role.precision is not None:
        out.append(Problem(f"{path}.precision", rules.MSG_ROLE_PRECISION))
    if role.max_model_len is not None:
        out.append(Problem(f"{path}.maxModelLen", rules.MSG_ROLE_MAX_MODEL_LEN))
    if role.parsers is not None:
        out.append(Problem(f"{path}.parsers", rules.MSG_ROLE_PARSERS))
    out.extend(_kwargs_problems(role.trtllm_kwargs or {}, f"{path}.trtllmKwargs"))
    return out


def _kwargs_problems(kwargs: Mapping[str, Any], path: str) -> list[Problem]:
    out = [
        Problem(f"{path}.{key}", f"owned by a typed field: set {where} instead")
        for key, where in OWNED_KWARGS.items()
        if key in kwargs
    ]
    transceiver = kwargs.get("cache_transceiver_config")
    if isinstance(transceiver, Mapping):  # rendered as the engine config's typed cacheTransceiver
        try:
            CacheTransceiverSpec.model_validate(dict(transceiver))
        except ValidationError as exc:
            out.extend(problems_from_pydantic(exc, f"{path}.cache_transceiver_config"))
    kv = kwargs.get("kv_cache_config")
    if isinstance(kv, Mapping):
        out.extend(
            Problem(f"{path}.kv_cache_config.{key}", f"owned by a typed field: set {where} instead")
            for key, where in OWNED_KV_CACHE_KWARGS.items()
            if key in kv
        )
    return out


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen: set[Problem] = set()
    out: list[Problem] = []
    for problem in problems:
        if problem not in seen:
            seen.add(problem)
            out.append(problem)
    return out
