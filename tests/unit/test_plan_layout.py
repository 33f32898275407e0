"""plan(): slots, ports, node ids, replica count, TensorRT-LLM kwargs, tiling."""

from __future__ import annotations

from typing import Any

import pytest
from drs_engine.backends.trtllm.translate import build_llm_kwargs
from drs_operator.api import DisaggReplicaSetSpec
from drs_operator.api.constants import Role
from drs_operator.manifests.engines import build_engine_config
from drs_operator.plan import PlanError, plan, replica_count, tiling_problem
from hypothesis import given, settings
from hypothesis import strategies as st

REFERENCE: dict[str, Any] = {
    "replicas": 2,
    "model": {"path": "/m"},
    "prefill": {"engines": 1, "tensorParallelSize": 4, "moeTensorParallelSize": 2, "moeExpertParallelSize": 2},
    "decode": {"engines": 2, "tensorParallelSize": 2, "moeTensorParallelSize": 1, "moeExpertParallelSize": 2},
    "frontend": {"workers": 2, "basePort": 8300},
    "trtllm": {"kwargs": {"cache_transceiver_config": {"backend": "NIXL"}}},
}


def spec(**changes: Any) -> DisaggReplicaSetSpec:
    return DisaggReplicaSetSpec.model_validate({**REFERENCE, **changes})


def test_the_reference_plan_lays_out_replicas_prefill_first_and_same_role_contiguous() -> None:
    p = plan(spec(), "ref")
    assert p.replica_width == 8 and p.gpus == 16 and len(p.replicas) == 2
    assert [(e.replica, str(e.role), e.ordinal, e.width) for e in p.engines] == [
        (0, "prefill", 0, 4),
        (0, "decode", 0, 2),
        (0, "decode", 1, 2),
        (1, "prefill", 0, 4),
        (1, "decode", 0, 2),
        (1, "decode", 1, 2),
    ]
    assert [e.index for e in p.engines] == list(range(6))
    assert [e.name for e in p.replicas[1].engines] == ["ref-r1-prefill-0", "ref-r1-decode-0", "ref-r1-decode-1"]
    assert all(e.port == 8000 for e in p.engines)
    assert p.replica_widths == (4, 2, 2)


def test_frontends_get_base_port_plus_r_times_f_plus_f_and_node_id_r_times_f_plus_f() -> None:
    p = plan(spec(), "ref")
    assert [(f.replica, f.index, f.port, f.node_id, f.name) for f in p.frontends] == [
        (0, 0, 8300, 0, "ref-r0-f0"),
        (0, 1, 8301, 1, "ref-r0-f1"),
        (1, 0, 8302, 2, "ref-r1-f0"),
        (1, 1, 8303, 3, "ref-r1-f1"),
    ]


def test_host_networking_gives_every_engine_its_own_port() -> None:
    p = plan(spec(network={"hostNetwork": True}, trtllm={"enginePort": 9000}), "ref")
    assert [e.port for e in p.engines] == [9000, 9001, 9002, 9003, 9004, 9005]


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        pytest.param({"replicas": 3}, 3, id="replicas counts replicas"),
        pytest.param({"replicas": None, "inferenceGPUs": 32}, 4, id="inferenceGPUs 32 over width 8 gives 4"),
        pytest.param({"replicas": 0}, 0, id="zero replicas is a valid plan with no slots"),
    ],
)
def test_the_replica_count(changes: dict[str, Any], expected: int) -> None:
    assert replica_count(spec(**changes)) == expected
    assert len(plan(spec(**changes), "x").replicas) == expected


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({"replicas": None, "inferenceGPUs": 12}, id="inferenceGPUs 12 is not a multiple of width 8"),
        pytest.param({"replicas": 2, "inferenceGPUs": 16}, id="both replicas and inferenceGPUs"),
        pytest.param({"replicas": None}, id="neither replicas nor inferenceGPUs"),
    ],
)
def test_no_plan_without_a_replica_count(changes: dict[str, Any]) -> None:
    with pytest.raises(PlanError):
        plan(spec(**changes), "x")


def test_role_kwargs_deep_merge_over_the_shared_kwargs_and_typed_knobs_win() -> None:
    s = spec(
        model={"path": "/m", "maxModelLen": 4096, "precision": "bfloat16"},
        trtllm={
            "kwargs": {
                "kv_cache_config": {"enable_block_reuse": True},
                "cache_transceiver_config": {"backend": "NIXL"},
                "x": [1],
            }
        },
        decode={
            **REFERENCE["decode"],
            "gpuMemoryUtilization": 0.8,
            "maxBatchSize": 64,
            "trtllmKwargs": {"kv_cache_config": {"dtype": "fp8"}, "x": [2]},
        },
    )
    p = plan(s, "ref")
    assert p.role(Role.DECODE).trtllm_kwargs["kv_cache_config"] == {"enable_block_reuse": True, "dtype": "fp8"}
    decode = build_llm_kwargs(build_engine_config(s, p, Role.DECODE))  # the one derivation the engine runs
    assert decode["kv_cache_config"] == {"enable_block_reuse": True, "dtype": "fp8", "free_gpu_memory_fraction": 0.8}
    assert decode["x"] == [2], "lists are replaced, not appended"
    assert decode["cache_transceiver_config"] == {"backend": "NIXL"}
    assert (decode["tensor_parallel_size"], decode["moe_tensor_parallel_size"], decode["moe_expert_parallel_size"]) == (
        2,
        1,
        2,
    )
    assert (decode["max_batch_size"], decode["max_seq_len"], decode["dtype"]) == (64, 4096, "bfloat16")
    prefill = build_llm_kwargs(build_engine_config(s, p, Role.PREFILL))
    assert prefill["kv_cache_config"] == {"enable_block_reuse": True} and prefill["x"] == [1]
    assert prefill["max_batch_size"] == 256 and prefill["tensor_parallel_size"] == 4  # the engine default


def test_a_pre_quantized_precision_leaves_dtype_to_the_checkpoint() -> None:
    s = spec(model={"path": "/m", "precision": "fp8"})
    assert build_llm_kwargs(build_engine_config(s, plan(s, "ref"), Role.PREFILL))["dtype"] == "auto"


@pytest.mark.parametrize(
    ("widths", "node_size", "boundary"),
    [
        pytest.param((4, 2, 2), 8, None, id="4+2+2 tiles 8-GPU nodes"),
        pytest.param((4, 2, 2), 4, None, id="4+2+2 tiles 4-GPU nodes"),
        pytest.param((4, 2, 2), 6, 18, id="4+2+2 on 6-GPU nodes: the third replica's prefill crosses GPU 18"),
        pytest.param((4, 4), 6, 6, id="4+4 on 6-GPU nodes: the first decode crosses GPU 6"),
        pytest.param((16, 8, 8), 8, None, id="TP16 on 8-GPU nodes takes two whole nodes"),
        pytest.param((12,), 8, 16, id="TP12 on 8-GPU nodes is not whole nodes: it ends short of GPU 16"),
        pytest.param((2, 8), 8, 8, id="a TP8 after a TP2 crosses GPU 8"),
        pytest.param((2, 16), 8, 8, id="a TP16 after a TP2 would start mid-node, across GPU 8"),
        pytest.param((1, 1, 1), 8, None, id="three TP1 engines tile anything"),
    ],
)
def test_tiling(widths: tuple[int, ...], node_size: int, boundary: int | None) -> None:
    problem = tiling_problem(widths, node_size)
    if boundary is None:
        assert problem is None
    else:
        assert problem is not None and problem.boundary == boundary and f"{node_size}-GPU nodes" in str(problem)


# --- properties -----------------------------------------------------------------------------
@st.composite
def valid_specs(draw: st.DrawFn) -> DisaggReplicaSetSpec:
    workers = draw(st.integers(1, 4))
    prefill = {"engines": draw(st.integers(1, 3)), "tensorParallelSize": draw(st.sampled_from([1, 2, 4, 8]))}
    decode = {"engines": draw(st.integers(1, 4)), "tensorParallelSize": draw(st.sampled_from([1, 2, 4]))}
    data: dict[str, Any] = {
        "model": {"path": "/m"},
        "prefill": prefill,
        "decode": decode,
        "frontend": {"workers": workers},
    }
    if draw(st.booleans()):
        data["replicas"] = draw(st.integers(0, 6))
    else:
        width = prefill["engines"] * prefill["tensorParallelSize"] + decode["engines"] * decode["tensorParallelSize"]
        data["inferenceGPUs"] = width * draw(st.integers(1, 6))
    data["network"] = {"hostNetwork": draw(st.booleans())}
    return DisaggReplicaSetSpec.model_validate(data)


@settings(max_examples=200, deadline=None)
@given(valid_specs())
def test_plan_invariants(s: DisaggReplicaSetSpec) -> None:
    p = plan(s, "drs")
    n, f = len(p.replicas), s.frontend.workers
    assert [e.index for e in p.engines] == list(range(n * (s.prefill.engines + s.decode.engines)))
    assert len({e.name for e in p.engines}) == len(p.engines)
    assert p.gpus == sum(e.width for e in p.engines) == n * s.replica_width
    for rep in p.replicas:
        roles = [e.role for e in rep.engines]
        assert roles == [Role.PREFILL] * s.prefill.engines + [Role.DECODE] * s.decode.engines
    assert [fr.port for fr in p.frontends] == list(range(s.frontend.base_port, s.frontend.base_port + n * f))
    assert [fr.node_id for fr in p.frontends] == list(range(n * f))
    if s.network.host_network:
        assert len({e.port for e in p.engines}) == len(p.engines)
