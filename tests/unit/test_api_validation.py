"""Cross-field validation: every rule, its field path, and every problem reported at once."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_operator.api import rules
from drs_operator.validation import Problem, validate_manifest, validate_spec_data

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

BASE: dict[str, Any] = {
    "apiVersion": "disagg.dev/v1alpha1",
    "kind": "DisaggReplicaSet",
    "metadata": {"name": "drs"},
    "spec": {
        "replicas": 2,
        "model": {"path": "/models/m"},
        "prefill": {"engines": 1, "tensorParallelSize": 4, "moeTensorParallelSize": 2, "moeExpertParallelSize": 2},
        "decode": {"engines": 2, "tensorParallelSize": 2, "moeTensorParallelSize": 1, "moeExpertParallelSize": 2},
        "frontend": {"workers": 2, "basePort": 8300},
    },
}


def manifest(spec: dict[str, Any] | None = None, drop: tuple[str, ...] = (), name: str = "drs") -> dict[str, Any]:
    """BASE with ``spec`` deep-merged into its spec and the top-level spec keys in ``drop`` removed."""
    out = copy.deepcopy(BASE)
    out["metadata"]["name"] = name
    for key in drop:
        out["spec"].pop(key)

    def merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
        for k, v in src.items():
            if isinstance(v, dict) and isinstance(dst.get(k), dict):
                merge(dst[k], v)
            else:
                dst[k] = v

    merge(out["spec"], spec or {})
    return out


def problems_of(data: dict[str, Any]) -> list[Problem]:
    resource, problems = validate_manifest(data)
    assert (resource is None) == bool(problems)
    return problems


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: f"example {p.name} is valid")
def test_examples_are_valid(path: Path) -> None:
    assert problems_of(yaml.safe_load(path.read_text())) == []


def test_the_base_manifest_is_valid() -> None:
    assert problems_of(manifest()) == []


#: (id, spec overlay, dropped spec keys, name, expected path, expected message start)
CASES = [
    (
        "MoE split of prefill does not multiply to its TP",
        {"prefill": {"moeTensorParallelSize": 2, "moeExpertParallelSize": 1}},
        (),
        "drs",
        "spec.prefill.moeExpertParallelSize",
        rules.MSG_MOE_SPLIT,
    ),
    (
        "MoE TP of decode does not divide its TP",
        {"decode": {"tensorParallelSize": 4, "moeTensorParallelSize": 3, "moeExpertParallelSize": None}},
        (),
        "drs",
        "spec.decode.moeTensorParallelSize",
        rules.MSG_MOE_TP_DIVIDES,
    ),
    (
        "MoE EP of decode does not divide its TP",
        {"decode": {"tensorParallelSize": 4, "moeTensorParallelSize": None, "moeExpertParallelSize": 3}},
        (),
        "drs",
        "spec.decode.moeExpertParallelSize",
        rules.MSG_MOE_EP_DIVIDES,
    ),
    (
        "precision inside a role",
        {"prefill": {"precision": "bfloat16"}},
        (),
        "drs",
        "spec.prefill.precision",
        rules.MSG_ROLE_PRECISION,
    ),
    (
        "maxModelLen inside a role",
        {"decode": {"maxModelLen": 4096}},
        (),
        "drs",
        "spec.decode.maxModelLen",
        rules.MSG_ROLE_MAX_MODEL_LEN,
    ),
    (
        "parsers inside a role",
        {"decode": {"parsers": {"tool": "qwen3"}}},
        (),
        "drs",
        "spec.decode.parsers",
        rules.MSG_ROLE_PARSERS,
    ),
    ("both replicas and inferenceGPUs", {"inferenceGPUs": 16}, (), "drs", "spec.replicas", rules.MSG_REPLICAS_XOR),
    ("neither replicas nor inferenceGPUs", {}, ("replicas",), "drs", "spec.replicas", rules.MSG_REPLICAS_XOR),
    (
        "inferenceGPUs not divisible by the replica width",
        {"inferenceGPUs": 20},
        ("replicas",),
        "drs",
        "spec.inferenceGPUs",
        rules.MSG_INFERENCE_GPUS_DIVISIBLE,
    ),
    (
        "N x F = 257 frontends (257 replicas from inferenceGPUs, 1 frontend each)",
        {"inferenceGPUs": 257 * 8, "frontend": {"workers": 1}},
        ("replicas",),
        "drs",
        "spec.frontend.workers",
        rules.MSG_FRONTEND_COUNT,
    ),
    (
        "a frontend port beyond 65535",
        {"frontend": {"basePort": 65533}},
        (),
        "drs",
        "spec.frontend.basePort",
        rules.MSG_FRONTEND_PORT_RANGE,
    ),
    (
        "the engine port inside the frontend port range",
        {"trtllm": {"enginePort": 8302}},
        (),
        "drs",
        "spec.trtllm.enginePort",
        rules.MSG_ENGINE_PORT_COLLISION,
    ),
    (
        "host-network engine ports running into the frontend ports",
        {"network": {"hostNetwork": True}, "trtllm": {"enginePort": 8295}},
        (),
        "drs",
        "spec.trtllm.enginePort",
        rules.MSG_ENGINE_PORT_COLLISION,
    ),
    (
        "host-network engine ports beyond 65535",
        {"network": {"hostNetwork": True}, "trtllm": {"enginePort": 65532}},
        (),
        "drs",
        "spec.trtllm.enginePort",
        rules.MSG_ENGINE_PORT_RANGE,
    ),
    (
        "per-replica NetworkPolicies with host networking",
        {"network": {"hostNetwork": True}, "networkPolicy": {"enabled": True}},
        (),
        "drs",
        "spec.networkPolicy.enabled",
        rules.MSG_POLICY_HOST_NETWORK,
    ),
    (
        "a standby frontend with host networking",
        {"network": {"hostNetwork": True}, "frontend": {"standby": True}},
        (),
        "drs",
        "spec.frontend.standby",
        rules.MSG_STANDBY_HOST_NETWORK,
    ),
    (
        "a sibling hold without group routing",
        {"frontend": {"groupRouting": False, "groupHoldSeconds": 5}},
        (),
        "drs",
        "spec.frontend.groupHoldSeconds",
        rules.MSG_GROUP_HOLD_ROUTING,
    ),
    ("a name longer than 40 characters", {}, (), "a" * 41, "metadata.name", rules.MSG_NAME),
    ("a name with a dot", {}, (), "a.b", "metadata.name", rules.MSG_NAME),
    (
        "widths 4+2+2 on 6-GPU nodes (the third back-to-back replica crosses GPU 18)",
        {"topology": {"gpusPerNode": 6}},
        (),
        "drs",
        "spec.topology.gpusPerNode",
        "engine widths 4+2+2 do not tile 6-GPU nodes",
    ),
    (
        "TP12 on 8-GPU nodes (wider than a node, not whole nodes)",
        {
            "prefill": {"tensorParallelSize": 12, "moeTensorParallelSize": None, "moeExpertParallelSize": None},
            "topology": {"gpusPerNode": 8},
        },
        (),
        "drs",
        "spec.topology.gpusPerNode",
        "engine widths 12+2+2 do not tile 8-GPU nodes",
    ),
    (
        "tensor_parallel_size in the shared TensorRT-LLM kwargs",
        {"trtllm": {"kwargs": {"tensor_parallel_size": 8}}},
        (),
        "drs",
        "spec.trtllm.kwargs.tensor_parallel_size",
        "owned by a typed field: set the role's tensorParallelSize",
    ),
    (
        "max_seq_len in a role's TensorRT-LLM kwargs",
        {"decode": {"trtllmKwargs": {"max_seq_len": 8}}},
        (),
        "drs",
        "spec.decode.trtllmKwargs.max_seq_len",
        "owned by a typed field: set spec.model.maxModelLen",
    ),
    (
        "the KV memory fraction in a role's kwargs",
        {"prefill": {"trtllmKwargs": {"kv_cache_config": {"free_gpu_memory_fraction": 0.5}}}},
        (),
        "drs",
        "spec.prefill.trtllmKwargs.kv_cache_config.free_gpu_memory_fraction",
        "owned by a typed field: set the role's gpuMemoryUtilization",
    ),
]


@pytest.mark.parametrize(
    ("overlay", "drop", "name", "path", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_each_rule_is_reported_at_its_field_path(
    overlay: dict[str, Any], drop: tuple[str, ...], name: str, path: str, message: str
) -> None:
    problems = problems_of(manifest(overlay, drop, name))
    assert any(p.path == path and p.message.startswith(message) for p in problems), problems


@pytest.mark.parametrize(
    ("frontend", "words"),
    [({"groupHoldSeconds": 601}, "600"), ({"groupHoldSeconds": -1}, "0"), ({"groupRouting": "sometimes"}, "bool")],
    ids=["a sibling hold over 600 s", "a negative sibling hold", "a groupRouting that is not a boolean"],
)
def test_the_group_routing_fields_are_bounded_and_typed(frontend: dict[str, Any], words: str) -> None:
    problems = problems_of(manifest({"frontend": frontend}, (), "drs"))
    field = next(iter(frontend))
    assert any(p.path == f"spec.frontend.{field}" and words in p.message for p in problems), problems


def test_every_cel_rule_has_a_python_twin_exercised_above() -> None:
    covered = {c[5] for c in CASES}
    cel_messages = {r.message for r in (*rules.ROLE_RULES, *rules.SPEC_RULES, *rules.RESOURCE_RULES)}
    assert cel_messages <= covered


def test_the_tiling_message_names_the_boundary_it_would_cross() -> None:
    (problem,) = problems_of(manifest({"topology": {"gpusPerNode": 6}}))
    assert "GPUs 16-19" in problem.message and "node boundary at GPU 18" in problem.message


def test_n_times_f_of_257_names_both_numbers() -> None:
    (problem,) = problems_of(manifest({"inferenceGPUs": 257 * 8, "frontend": {"workers": 1}}, ("replicas",)))
    assert problem.message.endswith("got 257 * 1 = 257")


def test_every_problem_is_reported_at_once() -> None:
    data = manifest(
        {
            "replicas": "two",  # a type error
            "bogus": 1,  # an unknown field
            "prefill": {"moeTensorParallelSize": 2, "moeExpertParallelSize": 1, "precision": "bfloat16"},
            "decode": {"maxBatchSize": -1},  # a bound, in a block whose other rules still run
            "trtllm": {"enginePort": 8301, "kwargs": {"dtype": "float16"}},
            "topology": {"gpusPerNode": 6},
        },
        name="Bad.Name",
    )
    paths = {p.path for p in problems_of(data)}
    assert paths >= {
        "spec.replicas",
        "spec.bogus",
        "spec.prefill.moeExpertParallelSize",
        "spec.prefill.precision",
        "spec.decode.maxBatchSize",
        "spec.trtllm.kwargs.dtype",
        "spec.topology.gpusPerNode",
        "metadata.name",
    }


def test_a_valid_count_with_invalid_blocks_still_checks_frontends_and_ports() -> None:
    data = manifest({"model": {"path": 7}, "frontend": {"basePort": 65533}, "decode": {"template": "not-an-object"}})
    paths = {p.path for p in problems_of(data)}
    assert {"spec.model.path", "spec.decode.template", "spec.frontend.basePort"} <= paths


def test_a_bare_spec_is_validated_the_same_way() -> None:
    spec, problems = validate_spec_data({**BASE["spec"], "trtllm": {"enginePort": 8300}})
    assert spec is None and [p.path for p in problems] == ["spec.trtllm.enginePort"]
    spec, problems = validate_spec_data(BASE["spec"])
    assert spec is not None and problems == []


def test_problems_read_as_path_colon_rule() -> None:
    assert str(Problem("spec.replicas", "must be set")) == "spec.replicas: must be set"
