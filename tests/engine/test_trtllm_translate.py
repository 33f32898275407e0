"""The trtllm backend's translation to and from TensorRT-LLM's LLM API, without tensorrt_llm.

TensorRT-LLM cannot be installed here (no GPU). The small dataclasses below STAND IN for its
result types — ``RequestOutput`` (``outputs``, ``finished``, ``cached_tokens``),
``CompletionOutput`` (``token_ids``, ``logprobs``, ``finish_reason``, ``stop_reason``,
``disaggregated_params``), ``Logprob`` (``logprob``, ``rank``) and the LLM API
``DisaggregatedParams`` (``opaque_state`` bytes) — shaped after the recorded surface (trtllm/surface.json); test_trtllm_contract.py runs the whole
backend against the strict contract double.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import pytest
from drs_engine.backends.base import TokenStep
from drs_engine.backends.trtllm.translate import (
    build_control_rpc,
    build_conversation_params_kwargs,
    build_disaggregated_params_kwargs,
    build_llm_kwargs,
    build_sampling_params_kwargs,
    dtype_for,
    finished_from_output,
    token_steps_from_output,
)
from drs_engine.config import build_config
from drs_engine.errors import BadRequestError
from drs_engine.wire import ChatCompletionRequest, CompletionRequest, DisaggregatedParams
from drs_protocol.trtllm_kwargs import deep_merge, tokens_per_block_of


@dataclass
class Logprob:  # stands in for tensorrt_llm.executor.result.Logprob
    logprob: float
    rank: int | None = None


@dataclass
class LlmDisaggregatedParams:  # stands in for tensorrt_llm.disaggregated_params.DisaggregatedParams
    request_type: str | None = None
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None
    first_gen_log_probs: list[Any] | None = None


@dataclass
class CompletionOutput:  # stands in for tensorrt_llm.executor.result.CompletionOutput
    token_ids: list[int]
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    disaggregated_params: LlmDisaggregatedParams | None = None


@dataclass
class RequestOutput:  # stands in for tensorrt_llm.llmapi.RequestOutput
    outputs: list[CompletionOutput]
    finished: bool = False
    cached_tokens: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)


def config(**data: Any) -> Any:
    return build_config({"backend": "trtllm", "model": {"path": "/models/qwen3", "maxModelLen": 16384}, **data})


def test_llm_kwargs_carry_parallelism_limits_memory_and_the_kv_transceiver() -> None:
    kwargs = build_llm_kwargs(
        config(
            tensorParallelSize=4,
            moeTensorParallelSize=2,
            moeExpertParallelSize=2,
            gpuMemoryUtilization=0.85,
            maxBatchSize=128,
            maxNumTokens=4096,
            cacheTransceiver={"backend": "NIXL", "maxTokensInBuffer": 8192},
        )
    )
    assert kwargs["model"] == kwargs["tokenizer"] == "/models/qwen3"
    assert kwargs["backend"] == "pytorch"
    assert (kwargs["tensor_parallel_size"], kwargs["moe_tensor_parallel_size"], kwargs["moe_expert_parallel_size"]) == (
        4,
        2,
        2,
    )
    assert kwargs["kv_cache_config"] == {"enable_block_reuse": True, "free_gpu_memory_fraction": 0.85}
    assert (kwargs["max_batch_size"], kwargs["max_num_tokens"], kwargs["max_seq_len"]) == (128, 4096, 16384)
    assert kwargs["cache_transceiver_config"] == {"backend": "NIXL", "max_tokens_in_buffer": 8192}
    assert kwargs["dtype"] == "bfloat16"
    assert kwargs["max_input_len"] == 16384  # not TensorRT-LLM's 1024 default: long RL prompts fit
    assert kwargs["ray_worker_extension_cls"] == "drs_engine.trtllm_worker.extension.DrsWorkerExtension"
    assert kwargs["sleep_config"] == {"restore_modes": {"kv_cache": "NONE"}}


def test_llm_kwargs_use_only_recorded_names() -> None:
    from drs_engine.backends.trtllm.surface import llm_kwarg_names

    assert set(build_llm_kwargs(config())) <= llm_kwarg_names()


def test_an_engine_without_transceiver_config_still_gets_the_default_backend() -> None:
    kwargs = build_llm_kwargs(config())
    assert kwargs["cache_transceiver_config"] == {"backend": "DEFAULT"}
    assert "moe_tensor_parallel_size" not in kwargs
    assert "free_gpu_memory_fraction" not in kwargs["kv_cache_config"]


def test_merged_trtllm_kwargs_win_and_nested_blocks_merge_key_by_key() -> None:
    kwargs = build_llm_kwargs(
        config(
            gpuMemoryUtilization=0.5,
            trtllmKwargs={
                "kv_cache_config": {"tokens_per_block": 64, "enable_block_reuse": False},
                "enable_attention_dp": True,
                "max_batch_size": 7,
            },
        )
    )
    assert kwargs["kv_cache_config"] == {
        "enable_block_reuse": False,
        "free_gpu_memory_fraction": 0.5,
        "tokens_per_block": 64,
    }
    assert kwargs["enable_attention_dp"] is True
    assert kwargs["max_batch_size"] == 7
    assert tokens_per_block_of(kwargs) == 64
    assert tokens_per_block_of(build_llm_kwargs(config())) == 32


def test_deep_merge_does_not_modify_its_inputs() -> None:
    base = {"a": {"b": 1}}
    merged = deep_merge(base, {"a": {"c": 2}})
    assert merged == {"a": {"b": 1, "c": 2}}
    assert base == {"a": {"b": 1}}


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("bf16", "bfloat16"), ("float16", "float16"), ("auto", "auto"), ("fp8", "auto"), ("NVFP4", "auto")],
)
def test_quantized_precisions_leave_the_dtype_to_the_checkpoint(precision: str, dtype: str) -> None:
    assert dtype_for(precision) == dtype


def test_sampling_params_follow_trtllms_to_sampling_params() -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "temperature": 0.7,
            "top_k": 20,
            "seed": 3,
            "stop": ["END"],
            "stop_token_ids": [7],
            "logprobs": True,
            "top_logprobs": 5,
            "min_tokens": 2,
        }
    )
    kwargs = build_sampling_params_kwargs(request, max_tokens=64)
    assert kwargs["max_tokens"] == 64
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"], kwargs["seed"]) == (0.7, 1.0, 20, 3)
    assert kwargs["stop"] == ["END"] and kwargs["stop_token_ids"] == [7]
    assert kwargs["logprobs"] == 5
    assert kwargs["min_tokens"] == 2
    assert kwargs["add_special_tokens"] is False
    assert kwargs["detokenize"] is False


def test_sampling_params_without_logprobs_ask_for_none() -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    kwargs = build_sampling_params_kwargs(request, max_tokens=5)
    assert "logprobs" not in kwargs
    assert kwargs["temperature"] == 1.0
    assert kwargs["add_special_tokens"] is True


def test_disaggregated_params_decode_the_opaque_state_and_drop_relayed_extras() -> None:
    dp = DisaggregatedParams.model_validate(
        {
            "request_type": "generation_only",
            "first_gen_tokens": [11],
            "ctx_request_id": 2**41,
            "encoded_opaque_state": base64.b64encode(b"\x00state").decode(),
            "disagg_request_id": 2**41,
            "ctx_dp_rank": 1,
            "ctx_info_endpoint": "ucx://10.0.0.1:1234",
            "schedule_style": "context_first",
            "ctx_usage": {"prompt_tokens": 9, "total_tokens": 10, "completion_tokens": 1},
            "conversation_id": "conv-1",
            "a_future_field": 1,
        }
    )
    kwargs = build_disaggregated_params_kwargs(dp)
    assert kwargs is not None
    assert kwargs["request_type"] == "generation_only"
    assert kwargs["opaque_state"] == b"\x00state"
    assert kwargs["schedule_style"] == 0
    assert kwargs["ctx_usage"]["prompt_tokens"] == 9
    assert "encoded_opaque_state" not in kwargs and "a_future_field" not in kwargs and "conversation_id" not in kwargs
    assert build_disaggregated_params_kwargs(None) is None


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"encoded_opaque_state": "@@"}, "disaggregated_params.encoded_opaque_state"),
        ({"schedule_style": "sideways"}, "disaggregated_params.schedule_style"),
    ],
    ids=["invalid-base64-opaque-state", "unknown-schedule-style"],
)
def test_bad_disaggregated_params_are_a_400_naming_the_field(changes: dict[str, Any], param: str) -> None:
    dp = DisaggregatedParams.model_validate({"request_type": "generation_only", **changes})
    with pytest.raises(BadRequestError) as caught:
        build_disaggregated_params_kwargs(dp)
    assert caught.value.param == param


def test_the_conversation_id_is_passed_on_for_attention_dp() -> None:
    assert build_conversation_params_kwargs("conv-7") == {"conversation_id": "conv-7"}
    assert build_conversation_params_kwargs(None) is None


def test_streamed_outputs_become_only_the_new_token_steps() -> None:
    partial = RequestOutput(outputs=[CompletionOutput(token_ids=[5, 6], logprobs=[-0.5, -1.0])])
    later = RequestOutput(outputs=[CompletionOutput(token_ids=[5, 6, 7], logprobs=[-0.5, -1.0, -0.25])])
    assert token_steps_from_output(partial, 0) == [TokenStep(5, -0.5), TokenStep(6, -1.0)]
    assert token_steps_from_output(later, 2) == [TokenStep(7, -0.25)]


def test_top_logprob_dicts_become_ranked_alternatives() -> None:
    entry = {9: Logprob(-2.0, rank=2), 7: Logprob(-0.1, rank=1)}
    output = RequestOutput(outputs=[CompletionOutput(token_ids=[9], logprobs=[entry])])
    (step,) = token_steps_from_output(output, 0)
    assert step.token_id == 9 and step.logprob == -2.0
    assert step.top_logprobs == ((7, -0.1), (9, -2.0))


def test_a_running_output_is_not_finished() -> None:
    assert (
        finished_from_output(RequestOutput(outputs=[CompletionOutput([1])]), prompt_tokens=3, prefix_lookup=True)
        is None
    )


def test_a_finished_context_output_becomes_a_handoff_with_base64_opaque_state() -> None:
    params = LlmDisaggregatedParams(
        request_type="context_only",
        first_gen_tokens=[42],
        ctx_request_id=2**41 + 1,
        opaque_state=b"\x01\x02",
        ctx_dp_rank=3,
        ctx_info_endpoint=None,
    )
    output = RequestOutput(
        outputs=[CompletionOutput([42], finish_reason="length", disaggregated_params=params)],
        finished=True,
        cached_tokens=64,
    )
    finished = finished_from_output(output, prompt_tokens=100, prefix_lookup=True)
    assert finished is not None
    assert (finished.finish_reason, finished.cached_tokens, finished.prefix_query_tokens) == ("length", 64, 100)
    assert finished.handoff is not None
    assert finished.handoff.ctx_request_id == 2**41 + 1
    assert finished.handoff.first_gen_tokens == [42]
    assert base64.b64decode(finished.handoff.encoded_opaque_state or "") == b"\x01\x02"
    assert finished.handoff.ctx_dp_rank == 3


def test_a_finished_generation_output_did_no_prefix_lookup() -> None:
    output = RequestOutput(outputs=[CompletionOutput([1, 2], finish_reason="stop", stop_reason=2)], finished=True)
    finished = finished_from_output(output, prompt_tokens=10, prefix_lookup=False)
    assert finished is not None
    assert (finished.finish_reason, finished.stop_reason, finished.prefix_query_tokens, finished.handoff) == (
        "stop",
        2,
        0,
        None,
    )


@pytest.mark.parametrize(
    ("op", "method"),
    [
        ("load_weights", "load_weights_from_path"),
        ("init_collective", "init_collective"),
        ("prepare_refit_info", "prepare_refit_info"),
        ("update_weights_from_collective", "update_weights_from_collective"),
        ("reset_prefix_cache", "reset_prefix_cache"),
        ("start_profile", "start_profile"),
        ("stop_profile", "stop_profile"),
        ("weights_digest", "weights_digest"),
    ],
)
def test_each_control_op_maps_to_one_worker_rpc(op: str, method: str) -> None:
    assert build_control_rpc(op, {"x": 1}) == (method, {"x": 1})


def test_an_unknown_control_op_has_no_rpc() -> None:
    with pytest.raises(KeyError):
        build_control_rpc("format_disk")
