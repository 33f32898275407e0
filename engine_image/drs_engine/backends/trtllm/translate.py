"""Translation between this server and TensorRT-LLM's LLM API, as plain functions.

Nothing here imports ``tensorrt_llm``: these functions build the keyword arguments of
``LLM(...)`` (:func:`build_llm_kwargs`: the one derivation from the engine config; the operator
renders the typed fields and the user's merged kwargs and derives nothing itself),
``SamplingParams(...)``, ``DisaggregatedParams(...)`` and ``ConversationParams(...)``
from our config and requests, and read TensorRT-LLM's result objects (``RequestOutput`` with its
``outputs[0]`` ``CompletionOutput``) by attribute into backend events. They run in the unit
tests without TensorRT-LLM; :mod:`.engine` applies them to the real classes on a GPU machine.

Names are the recorded surface of the pinned release (``trtllm/surface.json``): ``tensorrt_llm/llmapi/llm_args.py`` (LLM kwargs),
``tensorrt_llm/sampling_params.py``, ``tensorrt_llm/disaggregated_params.py``
(``request_type``, ``first_gen_tokens``, ``ctx_request_id``, ``opaque_state`` bytes,
``draft_tokens``, ``disagg_request_id``, ``ctx_dp_rank``, ``ctx_info_endpoint``,
``schedule_style``, ``ctx_usage``), and ``tensorrt_llm/serve/openai_protocol.py``
(``to_llm_disaggregated_params``: ``encoded_opaque_state`` is base64 of ``opaque_state``).
"""

from __future__ import annotations

import base64
import binascii
import copy
from collections.abc import Mapping, Sequence
from typing import Any, Final

from drs_protocol.enums import Precision
from drs_protocol.trtllm_kwargs import deep_merge

from drs_engine.backends.base import ContextHandoff, LegFinished, TokenStep
from drs_engine.backends.trtllm.surface import worker_extension_class
from drs_engine.config import EngineConfig
from drs_engine.errors import BadRequestError, ContextLengthError, EngineError
from drs_engine.wire import ChatCompletionRequest, DisaggregatedParams, EngineRequest

#: Precisions that are a torch dtype; anything else (fp8, nvfp4, w4a16 …) is a quantized
#: checkpoint whose dtype TensorRT-LLM reads from the checkpoint ("auto").
_DTYPE_ALIASES: Final = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_PLAIN_DTYPES: Final = frozenset({Precision.AUTO, Precision.BFLOAT16, Precision.FLOAT16, Precision.FLOAT32})

#: ``DisaggScheduleStyle`` (an IntEnum in TensorRT-LLM) by wire name.
SCHEDULE_STYLES: Final = {"context_first": 0, "generation_first": 1}

#: The LLM class the backend constructs: TensorRT-LLM's RL-capable AsyncLLM (Ray orchestrator),
#: which offers release/resume/update_weights/collective_rpc.
LLM_CLASS: Final = "tensorrt_llm._torch.async_llm.AsyncLLM"

#: ``SleepConfig(**DEFAULT_SLEEP_CONFIG)`` (keys are ``ExecutorMemoryType`` values), as NeMo RL.
DEFAULT_SLEEP_CONFIG: Final[dict[str, Any]] = {"restore_modes": {"kv_cache": "NONE"}}


def dtype_for(precision: str) -> str:
    """TensorRT-LLM's ``dtype`` for a precision: a plain dtype, else ``auto`` (the checkpoint's)."""
    p = precision.strip().lower()
    p = _DTYPE_ALIASES.get(p, p)
    return p if p in _PLAIN_DTYPES else "auto"


def build_llm_kwargs(config: EngineConfig) -> dict[str, Any]:
    """Keyword arguments of ``LLM(...)`` for one engine; ``trtllmKwargs`` (already merged by the
    operator) win over everything derived here, nested blocks merging key by key."""
    kv_cache_config: dict[str, Any] = {"enable_block_reuse": True}
    if config.gpu_memory_utilization is not None:
        kv_cache_config["free_gpu_memory_fraction"] = config.gpu_memory_utilization
    transceiver = config.cache_transceiver
    cache_transceiver_config: dict[str, Any] = {"backend": "DEFAULT"}
    if transceiver is not None:
        cache_transceiver_config = {"backend": transceiver.backend}
        if transceiver.max_tokens_in_buffer is not None:
            cache_transceiver_config["max_tokens_in_buffer"] = transceiver.max_tokens_in_buffer
        cache_transceiver_config.update(transceiver.model_extra or {})
    derived: dict[str, Any] = {
        "model": config.model.path,
        "tokenizer": config.model.tokenizer or config.model.path,
        "backend": "pytorch",
        "dtype": dtype_for(config.model.precision),
        "tensor_parallel_size": config.tensor_parallel_size,
        "max_batch_size": config.max_batch_size,
        "max_num_tokens": config.max_num_tokens,
        "max_seq_len": config.model.max_model_len,
        # TensorRT-LLM's default max_input_len (1024) rejects long RL prompts; NeMo RL sets it to
        # the context window for the same reason.
        "max_input_len": config.model.max_model_len,
        "kv_cache_config": kv_cache_config,
        # Present even when not configured: backend DEFAULT is what makes an engine disaggregated.
        "cache_transceiver_config": cache_transceiver_config,
        # Our worker extension: load from a path, NeMo RL's collective refit (trtllm_worker/).
        "ray_worker_extension_cls": worker_extension_class(),
        # release()/resume() need sleep mode; the KV cache is not restored (it is reset before a
        # release), the weights keep TensorRT-LLM's default restore mode.
        "sleep_config": copy.deepcopy(DEFAULT_SLEEP_CONFIG),
    }
    if config.moe_tensor_parallel_size is not None:
        derived["moe_tensor_parallel_size"] = config.moe_tensor_parallel_size
    if config.moe_expert_parallel_size is not None:
        derived["moe_expert_parallel_size"] = config.moe_expert_parallel_size
    return deep_merge(derived, config.trtllm_kwargs)


def build_sampling_params_kwargs(request: EngineRequest, max_tokens: int) -> dict[str, Any]:
    """Keyword arguments of ``SamplingParams(...)``, as TensorRT-LLM's ``to_sampling_params`` builds
    them for the PyTorch backend. Text is detokenized by this server, so ``detokenize`` is off."""
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "n": request.n,
        "temperature": request.temperature if request.temperature is not None else 1.0,
        "top_p": request.top_p if request.top_p is not None else 1.0,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "seed": request.seed,
        "stop": request.stop,
        "stop_token_ids": list(request.stop_token_ids or []),
        "ignore_eos": request.ignore_eos,
        "min_tokens": request.min_tokens,
        "repetition_penalty": request.repetition_penalty,
        "frequency_penalty": request.frequency_penalty,
        "presence_penalty": request.presence_penalty,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "skip_special_tokens": request.skip_special_tokens,
        "spaces_between_special_tokens": request.spaces_between_special_tokens,
        "use_beam_search": request.use_beam_search,
        "add_special_tokens": request.add_special_tokens,
        "detokenize": False,
    }
    if request.best_of is not None:
        kwargs["best_of"] = request.best_of
    if request.length_penalty is not None:
        kwargs["length_penalty"] = request.length_penalty
    if request.truncate_prompt_tokens is not None:
        kwargs["truncate_prompt_tokens"] = request.truncate_prompt_tokens
    if request.wants_logprobs():
        # PyTorch backend: ``logprobs=k`` returns the sampled token plus the top k.
        kwargs["logprobs"] = request.top_logprobs_count() or 1
    if isinstance(request, ChatCompletionRequest) and request.top_p_min > 0:
        kwargs["top_p_min"] = request.top_p_min
    return kwargs


def build_disaggregated_params_kwargs(
    dp: DisaggregatedParams | None, *, ctx_request_id: int | None = None
) -> dict[str, Any] | None:
    """Keyword arguments of ``tensorrt_llm.DisaggregatedParams(...)`` (``None``: no disaggregation).

    Relayed fields this engine does not know stay on the wire model; the LLM API dataclass is
    ``slots=True`` and takes only its own names. ``schedule_style`` is passed as its int value.
    """
    if dp is None:
        return None
    kwargs: dict[str, Any] = {"request_type": dp.request_type.value}
    for name in ("first_gen_tokens", "draft_tokens", "disagg_request_id", "ctx_dp_rank", "ctx_info_endpoint"):
        value = getattr(dp, name)
        if value is not None:
            kwargs[name] = value
    request_id = dp.ctx_request_id if dp.ctx_request_id is not None else ctx_request_id
    if request_id is not None:
        kwargs["ctx_request_id"] = request_id
    if dp.encoded_opaque_state is not None:
        try:
            kwargs["opaque_state"] = base64.b64decode(dp.encoded_opaque_state, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise BadRequestError(
                f"disaggregated_params.encoded_opaque_state: invalid base64 ({exc})",
                param="disaggregated_params.encoded_opaque_state",
            ) from exc
    if dp.schedule_style is not None:
        kwargs["schedule_style"] = _schedule_style(dp.schedule_style)
    if dp.ctx_usage is not None:
        kwargs["ctx_usage"] = dp.ctx_usage.model_dump()
    return kwargs


def _schedule_style(value: str | int) -> int:
    if isinstance(value, int):
        if value in SCHEDULE_STYLES.values():
            return value
    elif value.lower() in SCHEDULE_STYLES:
        return SCHEDULE_STYLES[value.lower()]
    raise BadRequestError(
        f"disaggregated_params.schedule_style: unknown value {value!r} (context_first | generation_first)",
        param="disaggregated_params.schedule_style",
    )


def build_conversation_params_kwargs(conversation_id: str | None) -> dict[str, Any] | None:
    """Keyword arguments of ``tensorrt_llm.llmapi.ConversationParams(...)``: the id keeps a
    conversation on one attention-DP rank."""
    return None if not conversation_id else {"conversation_id": conversation_id}


def token_steps_from_output(output: Any, already_emitted: int) -> list[TokenStep]:
    """The new tokens of a (cumulative) ``RequestOutput`` since ``already_emitted`` tokens.

    ``outputs[0].logprobs`` is, per token, either a float or ``{token_id: Logprob(logprob, rank)}``
    (PyTorch backend with ``logprobs=k``); the chosen token's entry is its logprob, the rest are
    alternatives ordered by rank.
    """
    completion = output.outputs[0]
    token_ids: Sequence[int] = list(completion.token_ids or [])
    logprobs: Sequence[Any] = list(completion.logprobs or [])
    steps: list[TokenStep] = []
    for index in range(already_emitted, len(token_ids)):
        token = int(token_ids[index])
        entry = logprobs[index] if index < len(logprobs) else None
        steps.append(_token_step(token, entry))
    return steps


def _token_step(token: int, entry: Any) -> TokenStep:
    if entry is None:
        return TokenStep(token_id=token)
    if isinstance(entry, int | float):
        return TokenStep(token_id=token, logprob=float(entry))
    if isinstance(entry, Mapping):
        ranked = sorted(entry.items(), key=lambda kv: (getattr(kv[1], "rank", None) or 0, -_lp(kv[1])))
        alternatives = tuple((int(tid), _lp(lp)) for tid, lp in ranked)
        chosen = entry.get(token)
        return TokenStep(token_id=token, logprob=_lp(chosen) if chosen is not None else None, top_logprobs=alternatives)
    return TokenStep(token_id=token)


def _lp(value: Any) -> float:
    raw = getattr(value, "logprob", value)
    return float(raw)


def serialize_first_gen_log_probs(value: Any) -> list[Any] | None:
    """``first_gen_log_probs`` as TensorRT-LLM's OpenAI layer writes it (``to_disaggregated_params``):
    per position a float, or a list of ``{token_id, logprob, rank}`` from ``dict[int, Logprob]``."""
    if value is None:
        return None
    out: list[Any] = []
    for position in value:
        if isinstance(position, int | float):
            out.append(float(position))
        elif isinstance(position, Mapping):
            out.append(
                [
                    {"token_id": int(tid), "logprob": _lp(lp), "rank": getattr(lp, "rank", None)}
                    for tid, lp in position.items()
                ]
            )
        else:
            raise TypeError(f"first_gen_log_probs: a position must be a float or a dict, got {type(position).__name__}")
    return out


def finished_from_output(output: Any, *, prompt_tokens: int, prefix_lookup: bool) -> LegFinished | None:
    """The :class:`LegFinished` of a finished ``RequestOutput`` (``None`` while it runs).

    Recorded attributes are read directly (no ``getattr`` defaults), so a renamed attribute fails
    loudly against the contract double instead of silently reading a default.

    A context-only result carries ``outputs[0].disaggregated_params`` (LLM API dataclass with
    ``opaque_state`` bytes); it becomes the :class:`ContextHandoff` with the state base64-encoded.
    """
    if not output.finished:
        return None
    completion = output.outputs[0]
    cached = int(output.cached_tokens or 0)
    handoff = None
    params = completion.disaggregated_params
    if params is not None and params.ctx_request_id is not None:
        opaque = params.opaque_state
        handoff = ContextHandoff(
            ctx_request_id=int(params.ctx_request_id),
            first_gen_tokens=list(params.first_gen_tokens or []),
            encoded_opaque_state=base64.b64encode(opaque).decode("ascii") if opaque is not None else None,
            first_gen_log_probs=serialize_first_gen_log_probs(params.first_gen_log_probs),
            ctx_dp_rank=params.ctx_dp_rank,
            ctx_info_endpoint=params.ctx_info_endpoint,
        )
    return LegFinished(
        finish_reason=str(completion.finish_reason or "stop"),
        stop_reason=completion.stop_reason,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        prefix_query_tokens=prompt_tokens if prefix_lookup else 0,
        handoff=handoff,
    )


#: Worker methods the control API calls through ``AsyncLLM.collective_rpc``. ``reset_prefix_cache``,
#: ``start_profile`` and ``stop_profile`` are TensorRT-LLM's own ``rlhf_utils.WorkerExtension``;
#: the others are this project's ``DrsWorkerExtension`` (the default ``ray_worker_extension_cls``),
#: whose collective methods have NeMo RL's names and arguments.
RPC_METHODS: Final = {
    "load_weights": "load_weights_from_path",  # DrsWorkerExtension (trtllm_worker/extension.py)
    "load_weights_from_stream": "load_weights_from_packed",  # a peer's stream, written to a file first
    "init_collective": "init_collective",
    "prepare_refit_info": "prepare_refit_info",
    "update_weights_from_collective": "update_weights_from_collective",
    "reset_prefix_cache": "reset_prefix_cache",
    "start_profile": "start_profile",
    "stop_profile": "stop_profile",
    "weights_digest": "weights_digest",
}


def build_control_rpc(op: str, params: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """``(worker method, kwargs)`` of the ``collective_rpc`` that performs control op ``op``."""
    method = RPC_METHODS.get(op)
    if method is None:
        raise KeyError(f"no collective_rpc for control op {op!r}")
    return method, dict(params or {})


#: Words of TensorRT-LLM's refusals of a request that does not fit its limits
#: (``_check_arguments`` raises ValueError; NeMo RL catches ``executor.utils.RequestError``).
_LIMIT_WORDS: Final = ("max_seq_len", "max_num_tokens", "max_input_len")


def request_refusal(exc: BaseException) -> EngineError | None:
    """The 400 for TensorRT-LLM's refusal of a request (``None``: not a refusal, let it be a 500).

    A prompt over ``max_num_tokens``/``max_input_len``/``max_seq_len`` is "context length exceeded";
    any other ``RequestError`` is a plain 400 with TensorRT-LLM's message."""
    message = str(exc)
    if isinstance(exc, ValueError | TypeError) or type(exc).__name__ == "RequestError":
        if any(word in message for word in _LIMIT_WORDS):
            return ContextLengthError(f"context length exceeded: {message}", param="messages")
        if type(exc).__name__ == "RequestError":
            return BadRequestError(f"TensorRT-LLM refused the request: {message}")
    return None


def check_worker_results(method: str, results: Sequence[Any]) -> None:
    """A worker method that reports failure by returning ``False`` (NeMo RL's convention) failed:
    raise naming the ranks. ``None``/``True``/values are successes."""
    failed = [rank for rank, result in enumerate(results) if result is False]
    if failed:
        raise RuntimeError(f"{method} returned False on worker rank(s) {failed} of {len(results)}")
