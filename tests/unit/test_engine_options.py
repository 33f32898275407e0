"""Per-backend engine options in the spec: ``engine.sim`` and ``engine.torch`` typed by the engine
config's own models, the deprecated ``engine.simOptions`` still accepted, and every bad value a
``Valid=False`` problem naming its field (never an exception inside the manifest builder)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from drs_operator.api import rules
from drs_operator.api.constants import Role
from drs_operator.crd import build_crd
from drs_operator.manifests.engines import build_engine_config
from drs_operator.plan import plan
from drs_operator.validation import Problem, validate_spec_data
from drs_protocol import enums
from drs_protocol.config import render
from drs_protocol.engine_config import EngineConfig, ModelSpec, SimSpec, TorchSpec
from pydantic import ValidationError


def _spec(engine: dict[str, Any]) -> dict[str, Any]:
    return {"replicas": 1, "model": {"path": "/m"}, "engine": engine}


def _rendered(engine: dict[str, Any]) -> dict[str, Any]:
    spec, problems = validate_spec_data(_spec(engine))
    assert spec is not None, problems
    config: dict[str, Any] = json.loads(render(build_engine_config(spec, plan(spec, "fleet"), Role.DECODE)))
    return config


def _problems(engine: dict[str, Any]) -> list[Problem]:
    spec, problems = validate_spec_data(_spec(engine))
    assert spec is None and problems
    return problems


def test_engine_sim_is_rendered_into_the_engine_config() -> None:
    config = _rendered({"backend": "sim", "sim": {"speed": 0, "tokensPerBlock": 16}})
    assert config["sim"] == {"speed": 0.0, "tokensPerBlock": 16}
    assert EngineConfig.model_validate(config).tokens_per_block() == 16


def test_the_deprecated_sim_options_render_exactly_as_before() -> None:
    """The same config text (so the same hash: no pod rolls on upgrade) as ``engine.sim``."""
    assert _rendered({"backend": "sim", "simOptions": {"speed": 0}}) == _rendered(
        {"backend": "sim", "sim": {"speed": 0}}
    )
    assert "sim" not in _rendered({"backend": "sim", "simOptions": {}})


def test_engine_torch_is_rendered_with_its_transport_enum() -> None:
    config = _rendered({"backend": "torch", "torch": {"kvTransport": "http", "maxDecodeBatch": 8}})
    assert config["torch"] == {"kvTransport": "http", "maxDecodeBatch": 8}
    parsed = EngineConfig.model_validate(config)
    assert parsed.torch.kv_transport is enums.KvTransport.HTTP


def test_no_backend_block_renders_nothing_for_it() -> None:
    config = _rendered({"backend": "trtllm"})
    assert "sim" not in config and "torch" not in config


@pytest.mark.parametrize(
    ("engine", "path"),
    [
        pytest.param({"simOptions": {"speed": -1}}, "spec.engine.simOptions.speed", id="a negative simOptions speed"),
        pytest.param({"simOptions": {"sped": 1}}, "spec.engine.simOptions.sped", id="an unknown simOptions field"),
        pytest.param({"simOptions": {"speed": "fast"}}, "spec.engine.simOptions.speed", id="a simOptions string"),
        pytest.param({"sim": {"speed": -1}}, "spec.engine.sim.speed", id="a negative sim speed"),
        pytest.param({"torch": {"kvTransport": "nvlink"}}, "spec.engine.torch.kvTransport", id="an unknown transport"),
        pytest.param(
            {"sim": {"speed": 0}, "simOptions": {"speed": 0}}, "spec.engine.simOptions", id="both sim and simOptions"
        ),
    ],
)
def test_a_bad_option_is_a_problem_naming_its_field(engine: dict[str, Any], path: str) -> None:
    assert path in {p.path for p in _problems(engine)}


def test_both_spellings_are_refused_with_the_cel_rules_words() -> None:
    problems = _problems({"sim": {}, "simOptions": {}})
    assert Problem("spec.engine.simOptions", rules.MSG_SIM_OPTIONS_ALIAS) in problems


def test_other_problems_are_reported_with_a_bad_sim_options() -> None:
    spec = _spec({"simOptions": {"speed": -1}})
    spec["prefill"] = {"precision": "bfloat16"}
    paths = {p.path for p in validate_spec_data(spec)[1]}
    assert {"spec.engine.simOptions.speed", "spec.prefill.precision"} <= paths


def test_the_crd_types_the_backend_blocks_from_the_engine_models() -> None:
    engine = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "engine"
    ]["properties"]
    assert engine["torch"]["properties"]["kvTransport"]["enum"] == enums.choices(enums.KvTransport)
    assert list(engine["sim"]["properties"]) == [f.alias for f in SimSpec.model_fields.values()]
    assert list(engine["torch"]["properties"]) == [f.alias for f in TorchSpec.model_fields.values()]
    assert engine["simOptions"].get("x-kubernetes-preserve-unknown-fields") is True


@pytest.mark.parametrize(
    ("given", "precision"),
    [
        ("bfloat16", enums.Precision.BFLOAT16),
        ("bf16", enums.Precision.BFLOAT16),
        ("BF16", enums.Precision.BFLOAT16),
        ("torch.float16", enums.Precision.FLOAT16),
        ("fp32", enums.Precision.FLOAT32),
        ("fp8", enums.Precision.FP8),
        ("auto", enums.Precision.AUTO),
    ],
    ids=lambda v: str(v),
)
def test_the_engine_configs_precision_is_the_precision_enum(given: str, precision: enums.Precision) -> None:
    assert ModelSpec.model_validate({"path": "/m", "precision": given}).precision is precision


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(ValidationError, match="precision"):
        ModelSpec.model_validate({"path": "/m", "precision": "int3"})


@pytest.mark.parametrize(
    ("role", "width", "field"),
    [
        ("prefill", {"tensorParallelSize": 2}, "spec.prefill.tensorParallelSize"),
        ("decode", {"tensorParallelSize": 4, "moeExpertParallelSize": 4}, "spec.decode.moeExpertParallelSize"),
    ],
    ids=["a TP2 prefill engine", "a decode engine with MoE EP4"],
)
def test_a_torch_engine_wider_than_one_gpu_is_invalid_not_an_exception(
    role: str, width: dict[str, int], field: str
) -> None:
    spec = _spec({"backend": "torch"})
    spec[role] = width
    parsed, problems = validate_spec_data(spec)
    assert parsed is None and field in {p.path for p in problems}
    assert all(rules.MSG_TORCH_WIDTH in p.message for p in problems if p.path == field)


def test_a_one_gpu_torch_fleet_is_valid_and_renders() -> None:
    assert _rendered({"backend": "torch"})["backend"] == "torch"


@pytest.mark.parametrize(
    ("where", "path"),
    [
        ({"trtllm": {"kwargs": {"cache_transceiver_config": {"max_tokens_in_buffer": 0}}}}, "spec.trtllm.kwargs"),
        ({"decode": {"trtllmKwargs": {"cache_transceiver_config": {"backend": 7}}}}, "spec.decode.trtllmKwargs"),
    ],
    ids=["a zero transceiver buffer in the shared kwargs", "a numeric transceiver backend in a role's kwargs"],
)
def test_a_bad_cache_transceiver_config_is_a_problem_not_an_exception(where: dict[str, Any], path: str) -> None:
    spec = {**_spec({"backend": "trtllm"}), **where}
    parsed, problems = validate_spec_data(spec)
    assert parsed is None
    assert any(p.path.startswith(f"{path}.cache_transceiver_config.") for p in problems), problems


def test_flex_slot_attention_with_slots_not_a_multiple_of_its_key_block_is_a_problem_naming_both_fields() -> None:
    spec = _spec({"backend": "torch", "torch": {"slotAttention": "flex", "decodeSlotTokens": 1000}})
    parsed, problems = validate_spec_data(spec)
    assert parsed is None
    assert any("decodeSlotTokens" in p.message and "slotAttention flex" in p.message for p in problems), problems
    ok = _spec({"backend": "torch", "torch": {"slotAttention": "flex", "decodeSlotTokens": 1024}})
    assert validate_spec_data(ok)[0] is not None


@pytest.mark.parametrize(
    ("given", "tokens", "device", "resolved"),
    [
        ("auto", 2048, "cuda", "flex"),
        ("auto", 2048, "cpu", "sdpa"),
        ("auto", 1000, "cuda", "sdpa"),  # auto never refuses: sdpa where flex cannot run
        ("sdpa", 2048, "cuda", "sdpa"),
        ("flex", 2048, "cpu", "flex"),  # asked for by name: eager FlexAttention on the CPU
    ],
)
def test_slot_attention_auto_is_flex_on_cuda_where_the_slots_allow(
    given: str, tokens: int, device: str, resolved: str
) -> None:
    spec = TorchSpec.model_validate({"slotAttention": given, "decodeSlotTokens": tokens})
    assert spec.slot_attention_on(device) is enums.SlotAttention(resolved)
