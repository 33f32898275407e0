"""The numbers a frontend and its engines must agree on, derived once (drs_protocol.limits,
EngineConfig.tokens_per_block) and rendered by the operator to both sides alike."""

from __future__ import annotations

import json
from typing import Any

import pytest
from drs_frontend.shaping import build_context_request, build_generation_request
from drs_frontend.wire_json import dumps
from drs_protocol import enums, limits
from drs_protocol.config import render
from drs_protocol.engine_config import EngineConfig
from drs_protocol.frontend_config import FrontendConfig
from drs_protocol.routes import Endpoint
from drs_protocol.token_ids import encode_token_ids_b64
from drs_protocol.trtllm_kwargs import tokens_per_block_of
from hypothesis import example, given, settings
from hypothesis import strategies as st


@given(st.integers(min_value=0, max_value=5000))
def test_the_ids_bound_is_the_encoded_length(tokens: int) -> None:
    field = f'"prompt_token_ids_b64":"{encode_token_ids_b64([2**31 - 1] * tokens)}",'
    assert limits.token_ids_b64_bytes(tokens) == len(field)


@given(st.integers(min_value=0, max_value=1 << 30), st.integers(min_value=1, max_value=1 << 22))
def test_the_engine_limit_covers_the_frontends_plus_the_ids(frontend: int, max_model_len: int) -> None:
    engine = limits.engine_max_request_bytes(frontend, max_model_len)
    assert engine >= frontend + limits.token_ids_b64_bytes(max_model_len) + limits.FORWARD_OVERHEAD_BYTES
    assert limits.engine_max_request_bytes(frontend + 1, max_model_len) > engine
    assert limits.engine_max_request_bytes(frontend, max_model_len + 3) > engine


def test_bad_arguments_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        limits.engine_max_request_bytes(1024, 0)
    with pytest.raises(ValueError, match="tokens"):
        limits.token_ids_b64_bytes(-1)


def _chat(padding: int, conversation_id: str) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "x" * padding}],
        "max_tokens": 8,
        "conversation_id": conversation_id,
    }


@settings(max_examples=30, deadline=None)
@given(
    padding=st.integers(min_value=0, max_value=200_000),
    max_model_len=st.integers(min_value=2, max_value=40_000),
    conversation=st.integers(min_value=0, max_value=limits.MAX_REQUEST_HEAD_BYTES),
)
@example(padding=0, max_model_len=40_000, conversation=limits.MAX_REQUEST_HEAD_BYTES)  # the largest growth
def test_any_body_a_frontend_accepts_fits_the_engines_once_forwarded(
    padding: int, max_model_len: int, conversation: int
) -> None:
    """The frontend's own shaping of both legs, with the longest prompt ids an engine serves and a
    conversation id as long as a request head, stays within the derived engine limit."""
    body = _chat(padding, "c" * conversation)
    frontend_limit = len(dumps(body))
    engine_limit = limits.engine_max_request_bytes(frontend_limit, max_model_len)
    ids = encode_token_ids_b64([151_000] * (max_model_len - 1))
    ctx = build_context_request(
        body,
        disagg_request_id=2**63 - 1,
        conversation_id="c" * conversation,
        tokids_ctxbytes=True,
        prompt_token_ids_b64=ids,
    )
    assert len(dumps(ctx)) <= engine_limit
    answer = {
        "choices": [
            {
                "disaggregated_params": {
                    "ctx_request_id": 2**63 - 1,
                    "disagg_request_id": 2**63 - 1,
                    **ctx["disaggregated_params"],
                }
            }
        ],
        "usage": {"prompt_tokens": max_model_len, "completion_tokens": 1, "total_tokens": max_model_len + 1},
        "prompt_token_ids_b64": ids,
    }
    gen = build_generation_request(body, answer, endpoint=Endpoint.CHAT, strip_history=False)
    assert len(dumps(gen)) <= engine_limit


def test_the_default_limits_agree() -> None:
    engine = EngineConfig.model_validate({"model": {"path": "m"}})
    frontend = FrontendConfig.model_validate({"prefill": ["http://e:1"], "decode": ["http://e:2"]})
    assert engine.request_bytes_limit() == frontend.limits.forward_limit() == limits.DEFAULT_ENGINE_MAX_REQUEST_BYTES
    assert engine.request_bytes_limit() > frontend.limits.max_request_bytes == limits.FRONTEND_MAX_REQUEST_BYTES
    longer = EngineConfig.model_validate({"model": {"path": "m", "maxModelLen": 1 << 20}})
    assert longer.request_bytes_limit() == limits.engine_max_request_bytes(limits.FRONTEND_MAX_REQUEST_BYTES, 1 << 20)


def _spec(backend: str, **extra: Any) -> Any:
    from drs_operator.api.spec import DisaggReplicaSetSpec

    data: dict[str, Any] = {
        "replicas": 1,
        "model": {"path": "/models/m", "maxModelLen": 65536},
        "engine": {"backend": backend},
    }
    for key, value in extra.items():
        data.setdefault(key, {}).update(value)
    return DisaggReplicaSetSpec.model_validate(data)


SPECS = {
    "sim": _spec("sim"),
    "sim, 16-token blocks": _spec("sim", engine={"simOptions": {"speed": 0, "tokensPerBlock": 16}}),
    "torch": _spec("torch"),
    "trtllm": _spec("trtllm"),
    "trtllm, 64-token blocks": _spec("trtllm", trtllm={"kwargs": {"kv_cache_config": {"tokens_per_block": 64}}}),
}


def _engine_block(config: EngineConfig) -> int:
    """The block size the engine process itself uses (what its backend builds its cache with)."""
    if config.backend is enums.EngineBackend.TRTLLM:
        from drs_engine.backends.trtllm.translate import build_llm_kwargs

        return tokens_per_block_of(build_llm_kwargs(config))
    return config.sim.tokens_per_block if config.backend is enums.EngineBackend.SIM else config.torch.tokens_per_block


@pytest.mark.parametrize("name", list(SPECS))
def test_the_operator_renders_the_frontend_the_engines_block_size_and_limit(name: str) -> None:
    from drs_devcluster.profiles import build_nodes
    from drs_engine.config import build_config
    from drs_frontend.config import load_config
    from drs_operator.manifests.engines import build_engine_config
    from drs_operator.manifests.frontends import build_frontend_config
    from drs_operator.nodepool import nodes_from_manifests
    from drs_operator.placement import place
    from drs_operator.plan import plan

    spec = SPECS[name]
    fleet = plan(spec, "fleet")
    placement = place(fleet, nodes_from_manifests(build_nodes("hgx", 1)), None)
    frontend = load_config(
        None,
        {},
        json.loads(render(build_frontend_config(spec, fleet, fleet.replicas[0], placement.replica(0), "ns", {}))),
    )
    for role in enums.Role:
        engine = build_config(json.loads(render(build_engine_config(spec, fleet, role))))
        assert frontend.prefix_block_tokens == _engine_block(engine), role
        assert frontend.limits.forward_limit() == engine.request_bytes_limit(), role
    assert frontend.limits.forward_limit() == limits.engine_max_request_bytes(frontend.limits.max_request_bytes, 65536)


def test_the_backends_defaults_differ_so_the_check_above_can_fail() -> None:
    blocks = {
        name: _engine_block(EngineConfig.model_validate({"model": {"path": "m"}, "backend": b}))
        for name, b in (("sim", "sim"), ("torch", "torch"), ("trtllm", "trtllm"))
    }
    assert len(set(blocks.values())) > 1, blocks
