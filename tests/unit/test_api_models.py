"""The API models: wire names, defaults, strictness, child names, and the purity of the core."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from drs_operator.api import DisaggReplicaSet, DisaggReplicaSetSpec, DisaggReplicaSetStatus, names
from drs_operator.api.constants import (
    API_VERSION,
    KIND,
    LABEL_REPLICA,
    LABEL_REPLICASET,
    LABEL_ROLE,
    MAX_ENGINES_PER_ROLE,
    MAX_FRONTENDS,
    MAX_NAME_LENGTH,
    MAX_TENSOR_PARALLEL,
    ROLES,
    CtxRouter,
    EngineBackend,
    Role,
)
from pydantic import ValidationError

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def test_a_minimal_spec_gets_every_default() -> None:
    spec = DisaggReplicaSetSpec.model_validate({"replicas": 1, "model": {"path": "/m"}})
    assert (spec.prefill.engines, spec.prefill.tensor_parallel_size) == (1, 1)
    assert (spec.decode.engines, spec.decode.tensor_parallel_size) == (1, 1)
    assert spec.frontend.workers == 1 and spec.frontend.base_port == 8300 and spec.frontend.tokenize
    assert spec.router.ctx is CtxRouter.CONVERSATION and spec.router.gen_tokids_ctxbytes
    assert spec.trtllm.engine_port == 8000 and spec.trtllm.kwargs == {}
    assert spec.engine.backend is EngineBackend.TRTLLM
    assert spec.topology.segment_label == "nvidia.com/gpu.clique"
    assert not spec.network.host_network
    assert spec.replica_width == 2


def test_wire_names_are_camel_case_and_inference_gpus_is_spelled_out() -> None:
    data = {
        "inferenceGPUs": 16,
        "model": {"path": "/m", "maxModelLen": 1024},
        "prefill": {"tensorParallelSize": 4, "moeTensorParallelSize": 2, "moeExpertParallelSize": 2},
        "frontend": {"basePort": 9000, "tokenizeShadowRate": 0.5},
        "router": {"genTokidsCtxbytes": False, "genStripMessageHistory": False},
        "trtllm": {"enginePort": 7000},
        "network": {"hostNetwork": True},
        "topology": {"gpusPerNode": 8, "nodeSelector": {"a": "b"}},
    }
    spec = DisaggReplicaSetSpec.model_validate(data)
    assert spec.inference_gpus == 16 and spec.prefill.moe_expert_parallel_size == 2
    dumped = spec.model_dump(mode="json", exclude_none=True)
    assert dumped["inferenceGPUs"] == 16
    assert dumped["prefill"]["tensorParallelSize"] == 4
    assert dumped["router"]["genTokidsCtxbytes"] is False
    assert DisaggReplicaSetSpec.model_validate(dumped) == spec


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(
            {"replicas": 1, "model": {"path": "/m"}, "replica": 2}, id="a misspelt top-level field is rejected"
        ),
        pytest.param(
            {"replicas": 1, "model": {"path": "/m"}, "prefill": {"tp": 2}}, id="an unknown role field is rejected"
        ),
        pytest.param({"replicas": 1}, id="a spec without a model is rejected"),
        pytest.param({"replicas": 1, "model": {"path": ""}}, id="an empty model path is rejected"),
        pytest.param(
            {"replicas": 1, "model": {"path": "/m"}, "router": {"ctx": "random"}}, id="an unknown router is rejected"
        ),
        pytest.param(
            {"replicas": 1, "model": {"path": "/m"}, "engine": {"backend": "vllm"}},
            id="an unknown engine backend is rejected",
        ),
        pytest.param(
            {"replicas": 1, "model": {"path": "/m"}, "frontend": {"basePort": 70000}},
            id="a port above 65535 is rejected",
        ),
        pytest.param(
            {"replicas": 1, "model": {"path": "/m"}, "decode": {"gpuMemoryUtilization": 0}},
            id="a zero memory fraction is rejected",
        ),
    ],
)
def test_single_field_rules_live_on_the_models(data: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        DisaggReplicaSetSpec.model_validate(data)


def test_the_resource_literals_match_the_constants() -> None:
    resource = DisaggReplicaSet.model_validate(
        {"metadata": {"name": "x"}, "spec": {"replicas": 1, "model": {"path": "/m"}}}
    )
    assert (resource.api_version, resource.kind) == (API_VERSION, KIND)
    assert resource.to_manifest()["apiVersion"] == API_VERSION


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: f"example {p.name} parses as a DisaggReplicaSet")
def test_examples_parse(path: Path) -> None:
    DisaggReplicaSet.model_validate(yaml.safe_load(path.read_text()))


def test_status_ignores_fields_it_does_not_know_and_round_trips() -> None:
    status = DisaggReplicaSetStatus.model_validate(
        {
            "replicas": 2,
            "readyReplicas": 1,
            "fieldFromTheFuture": True,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": "ReplicasNotReady",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ],
            "replicaStatuses": [{"index": 0, "engines": [{"name": "a", "role": "prefill", "ordinal": 0, "width": 4}]}],
            "weights": {"version": "step-7"},
        }
    )
    assert status.ready_replicas == 1 and status.replica_statuses[0].engines[0].role is Role.PREFILL
    dumped = status.model_dump(mode="json", exclude_none=True)
    assert "fieldFromTheFuture" not in dumped and dumped["readyReplicas"] == 1
    assert DisaggReplicaSetStatus.model_validate(dumped) == status


def test_role_wire_names_are_ctx_and_gen() -> None:
    assert [r.wire_name for r in ROLES] == ["ctx", "gen"]


# --- names ----------------------------------------------------------------------------------
def test_child_names_follow_the_documented_scheme() -> None:
    assert names.engine_name("drs", 1, Role.DECODE, 0) == "drs-r1-decode-0"
    assert names.engine_pod_name("drs", 1, Role.DECODE, 0, rank=0) == "drs-r1-decode-0"
    assert names.engine_pod_name("drs", 1, Role.DECODE, 0, rank=2) == "drs-r1-decode-0-w2"
    assert names.engines_service_name("drs") == "drs-engines"
    assert names.engine_host("drs", "ns", "drs-r0-prefill-0") == "drs-r0-prefill-0.drs-engines.ns.svc"
    assert names.frontend_name("drs", 3, 1) == "drs-r3-f1"
    assert names.frontend_deployment_name("drs", 3, 1) == "drs-r3-f1"
    assert names.frontend_deployment_name("drs", 3, 1, process=1) == "drs-r3-f1-standby"
    assert names.frontend_host("drs", "ns", 3, 1) == "drs-r3-f1.ns.svc"
    assert names.engine_config_name("drs", Role.PREFILL) == "drs-prefill-config"
    assert names.frontend_config_name("drs", 0) == "drs-r0-frontend-config"
    assert names.control_secret_name("drs") == "drs-control"
    assert names.url("10.0.0.1", 80) == "http://10.0.0.1:80"
    assert names.url("fd00::1", 80) == "http://[fd00::1]:80"


def test_every_child_name_of_the_longest_allowed_name_is_a_dns_label() -> None:
    drs = "a" * MAX_NAME_LENGTH
    last_replica, last_ordinal, last_rank = MAX_FRONTENDS - 1, MAX_ENGINES_PER_ROLE - 1, MAX_TENSOR_PARALLEL - 1
    worst = [
        names.engine_pod_name(drs, last_replica, Role.PREFILL, last_ordinal, rank=last_rank),
        names.engines_service_name(drs),
        names.frontend_name(drs, last_replica, MAX_FRONTENDS - 1),
        names.frontend_deployment_name(drs, last_replica, MAX_FRONTENDS - 1, process=1),
        names.engine_config_name(drs, Role.PREFILL),
        names.frontend_config_name(drs, last_replica),
        names.control_secret_name(drs),
    ]
    for name in worst:
        assert len(name) <= names.DNS_LABEL_MAX and DNS_LABEL.match(name), name
    assert len(worst[0]) > names.DNS_LABEL_MAX - 5, "the bound is tight: keep MAX_NAME_LENGTH in step with the names"


def test_labels_name_the_replicaset_the_replica_and_the_role() -> None:
    labels = names.labels("drs", role="frontend", replica=3)
    assert labels[LABEL_REPLICASET] == "drs" and labels[LABEL_REPLICA] == "3" and labels[LABEL_ROLE] == "frontend"
    assert labels["app.kubernetes.io/managed-by"] == "drs-operator"
    assert names.selector("drs") == f"{LABEL_REPLICASET}=drs"


# --- purity ---------------------------------------------------------------------------------
PURE_MODULES = [
    "drs_operator.api",
    "drs_operator.api.names",
    "drs_operator.api.rules",
    "drs_operator.validation",
    "drs_operator.plan",
    "drs_operator.placement",
    "drs_operator.nodepool",
    "drs_operator.layout",
    "drs_operator.crd",
    "drs_operator.manifests",
    "drs_operator.rollout",
    "drs_operator.conditions",
    "drs_operator.decide",
    "drs_operator.profiles",
]


def test_the_pure_core_imports_neither_kopf_nor_a_kubernetes_client() -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {PURE_MODULES!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('kopf', 'kubernetes', 'kubernetes_asyncio'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
