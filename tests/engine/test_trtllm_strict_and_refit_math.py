"""Strict mode against TensorRT-LLM's transcribed response models, and the refit arithmetic.

The response models are pydantic models built from ``trtllm/surface.json`` (``openai_models``,
``extra="forbid"`` as in TensorRT-LLM). The packing tests check NeMo RL's packed-broadcast layout
(``nemo_rl/utils/packed_tensor.py`` at the recorded commit) without torch.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from drs_engine.backends.trtllm.surface import openai_model_fields
from drs_engine.backends.trtllm.translate import check_worker_results, serialize_first_gen_log_probs
from drs_protocol.nemo_rl_refit import (
    RefitSpecError,
    TensorSpec,
    batch_bytes,
    checkpoint_files,
    dtype_name,
    packed_batches,
    parse_state_dict_info,
    target_packed_bytes,
    worker_rank,
)
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from .conftest import EngineFactory


def forbid(model: str) -> type[BaseModel]:
    """A permissive-typed, extra-forbidding model with exactly the transcribed fields."""
    fields: dict[str, Any] = {name: (Any, None) for name in openai_model_fields(model)}
    return create_model(model, __config__=ConfigDict(extra="forbid"), **fields)


def validate(body: dict[str, Any], *, chat: bool, stream: bool) -> None:
    """Validate a body the way TensorRT-LLM's models would (nested models checked too)."""
    top = (
        ("ChatCompletionStreamResponse" if stream else "ChatCompletionResponse")
        if chat
        else ("CompletionStreamResponse" if stream else "CompletionResponse")
    )
    choice_model = (
        ("ChatCompletionResponseStreamChoice" if stream else "ChatCompletionResponseChoice")
        if chat
        else ("CompletionResponseStreamChoice" if stream else "CompletionResponseChoice")
    )
    forbid(top).model_validate(body)
    for choice in body["choices"]:
        forbid(choice_model).model_validate(choice)
        if choice.get("disaggregated_params"):
            forbid("DisaggregatedParams").model_validate(choice["disaggregated_params"])
        if chat and "message" in choice:
            forbid("ChatMessage").model_validate(choice["message"])
        if chat and "delta" in choice:
            forbid("DeltaMessage").model_validate(choice["delta"])
    if body.get("usage"):
        forbid("UsageInfo").model_validate(body["usage"])


REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}),
]


@pytest.mark.parametrize("strict", [True, False], ids=["strict-validates", "default-carries-extra-fields"])
async def test_strict_answers_validate_against_trtllms_response_models(
    engine_factory: EngineFactory, strict: bool
) -> None:
    async with engine_factory(strictTrtllmResponses=strict) as engine, httpx.AsyncClient(timeout=30) as client:
        bodies: list[tuple[dict[str, Any], bool, bool]] = []
        for path, extra in REQUESTS:
            chat = "chat" in path
            base = {"model": "m", "max_tokens": 4, **extra}
            context = {
                **base,
                "disaggregated_params": {
                    "request_type": "context_only",
                    "disagg_request_id": 2**41 + 1,
                    "return_prompt_token_ids_b64": True,
                    "x_relayed": 1,
                },
            }
            for body in (base, context):
                answer = await client.post(engine.url + path, json=body)
                assert answer.status_code == 200, answer.text
                bodies.append((answer.json(), chat, False))
                if strict:  # the ids survive as the int list TensorRT-LLM's models have
                    assert answer.json()["prompt_token_ids"]
            streamed = await client.post(
                engine.url + path, json={**base, "stream": True, "stream_options": {"include_usage": True}}
            )
            for line in streamed.text.splitlines():
                if line.startswith("data: {"):
                    bodies.append((json.loads(line[6:]), chat, True))
        problems = []
        for body, chat, stream in bodies:
            try:
                validate(body, chat=chat, stream=stream)
            except ValidationError as exc:
                problems.append(str(exc).splitlines()[0])
        if strict:
            assert problems == []
        else:  # the default answers carry token_ids on chat choices and relayed fields: the check can fail
            assert problems


def test_first_gen_log_probs_are_serialised_as_trtllm_does() -> None:
    class Lp:
        def __init__(self, logprob: float, rank: int) -> None:
            self.logprob, self.rank = logprob, rank

    out = serialize_first_gen_log_probs([{7: Lp(-0.5, 1), 9: Lp(-2.0, 2)}, -0.25])
    assert out == [[{"token_id": 7, "logprob": -0.5, "rank": 1}, {"token_id": 9, "logprob": -2.0, "rank": 2}], -0.25]
    assert serialize_first_gen_log_probs(None) is None


def test_a_false_from_any_worker_is_a_failure_naming_the_ranks() -> None:
    check_worker_results("m", [True, None, 3])
    with pytest.raises(RuntimeError, match=r"m returned False on worker rank\(s\) \[1\] of 2"):
        check_worker_results("m", [True, False])


@pytest.mark.parametrize(
    ("value", "name"),
    [
        ("torch.bfloat16", "bfloat16"),
        ("bf16", "bfloat16"),
        ("float", "float32"),
        ("torch.float8_e4m3fn", "float8_e4m3fn"),
    ],
)
def test_dtype_names_normalise_to_torch_names(value: str, name: str) -> None:
    assert dtype_name(value) == name


@pytest.mark.parametrize(
    ("info", "message"),
    [
        ({"w": [[2], "fp7"]}, "state_dict_info['w']: unknown dtype"),
        ({"w": [[-1], "bfloat16"]}, "non-negative ints"),
        ({"w": "bfloat16"}, "must be [shape, dtype]"),
    ],
    ids=["unknown-dtype", "negative-dim", "not-a-pair"],
)
def test_bad_state_dict_info_is_refused_naming_the_tensor(info: dict[str, Any], message: str) -> None:
    with pytest.raises(RefitSpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_state_dict_info(info)


def test_the_packing_target_is_nemo_rls() -> None:
    assert target_packed_bytes(80 * 1024**3, 0.02) == int(80 * 1024**3 * 0.02)
    assert target_packed_bytes(1024**4, 0.02) == 5 * 1024**3


specs_strategy = st.lists(
    st.builds(
        TensorSpec,
        name=st.text(min_size=1, max_size=5),
        shape=st.lists(st.integers(0, 9), max_size=3).map(tuple),
        dtype=st.sampled_from(["bfloat16", "float32", "int8", "float64"]),
    ),
    max_size=40,
)


@given(specs=specs_strategy, target=st.integers(0, 400))
def test_packed_batches_cover_every_tensor_in_order_without_gaps(specs: list[TensorSpec], target: int) -> None:
    batches = packed_batches(specs, target)
    flat = [slot for batch in batches for slot in batch]
    assert [s.spec for s in flat] == specs
    for batch in batches:
        offset = 0
        for slot in batch:
            assert slot.offset == offset
            offset += slot.spec.nbytes
    for batch in batches[:-1]:  # a batch closes right after it first exceeds the target
        assert batch_bytes(batch) > target
        assert batch_bytes(batch[:-1]) <= target


def test_worker_ranks_follow_the_trainers() -> None:
    assert worker_rank(train_world_size=2, rank_prefix=4, local_rank=1) == 7
    with pytest.raises(ValueError):
        worker_rank(0, 0, 0)


def test_checkpoint_files_are_the_sorted_safetensors(tmp_path: Any) -> None:
    (tmp_path / "b.safetensors").write_bytes(b"")
    (tmp_path / "a.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text("{}")
    assert [p.name for p in checkpoint_files(tmp_path)] == ["a.safetensors", "b.safetensors"]
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        checkpoint_files(tmp_path / "nothing")
    (tmp_path / "a.safetensors").unlink()
    (tmp_path / "b.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \.safetensors files"):
        checkpoint_files(tmp_path)


def test_feature_detection_names_every_missing_feature_and_orders_sleep_tags() -> None:
    import dataclasses
    import enum

    from drs_engine.backends.trtllm.features import detect_features, sleep_tags

    @dataclasses.dataclass
    class OldParams:
        request_type: str | None = None

    class Memory(enum.StrEnum):
        KV = "kv_cache"
        INIT = "_no_capture_init_kv_cache"
        MODEL = "model"

    def old_generate(inputs: Any, sampling_params: Any = None) -> None: ...

    def new_generate(inputs: Any, conversation_params: Any = None, **kw: Any) -> None: ...

    old = detect_features(
        generate_async=old_generate,
        disaggregated_params=OldParams,
        conversation_params=None,
        sleep_config=None,
        memory_type=None,
    )
    assert set(old.degraded) == {
        "conversation_params_unsupported",
        "ctx_usage_unsupported",
        "schedule_style_unsupported",
        "sleep_config_unavailable",
    }
    assert not (old.conversation_params or old.ctx_usage or old.schedule_style or old.sleep)
    new = detect_features(
        generate_async=new_generate,
        disaggregated_params=dataclasses.make_dataclass("P", ["ctx_usage", "schedule_style"]),
        conversation_params=object,
        sleep_config=object,
        memory_type=Memory,
    )
    assert new.degraded == {} and new.memory_tags == ("model", "kv_cache")
    assert sleep_tags(["kv_cache", "model_weights", "_x"]) == ("model_weights", "kv_cache")
