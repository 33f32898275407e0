"""Request models of the serving routes, as strict as TensorRT-LLM's ``openai_protocol``.

Top-level request models are ``extra="forbid"`` (an unknown field is a 400 naming it, as in
``trtllm-serve``); ``disaggregated_params`` is ``extra="allow"`` so fields this engine does not
know are relayed untouched (PROTOCOL.md section 2). Field names and defaults follow TensorRT-LLM
(v1.2 line): ``ChatCompletionRequest``, ``CompletionRequest``, ``DisaggregatedParams``,
``ConversationParams``. Sampling fields the ``sim`` backend ignores are still accepted, because
TensorRT-LLM accepts them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from drs_protocol import fields
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Most alternatives a request may ask for per token (TensorRT-LLM's limit is the same order).
MAX_TOP_LOGPROBS = 20
#: Most ``stop`` strings a request may name. TensorRT-LLM and vLLM set none (OpenAI allows 4);
#: each is tokenized for every leg, so an unbounded list would let one request hold a worker
#: thread for seconds (10,000 took 0.4 s on this project's 2-core machine).
MAX_STOP_STRINGS = 1024


class RequestType(StrEnum):
    CONTEXT_ONLY = fields.CONTEXT_ONLY
    GENERATION_ONLY = fields.GENERATION_ONLY
    CONTEXT_AND_GENERATION = fields.CONTEXT_AND_GENERATION


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class UsageIn(BaseModel):
    """``ctx_usage`` relayed from the context response (lenient: it is our own output echoed back)."""

    model_config = ConfigDict(extra="allow")

    prompt_tokens: int = 0
    completion_tokens: int | None = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, Any] | None = None

    def cached_tokens(self) -> int:
        details = self.prompt_tokens_details or {}
        value = details.get("cached_tokens", 0)
        return value if isinstance(value, int) else 0


class DisaggregatedParams(BaseModel):
    """TensorRT-LLM's ``DisaggregatedParams`` on the wire; unknown fields are kept and relayed."""

    model_config = ConfigDict(extra="allow")

    request_type: RequestType
    first_gen_tokens: list[int] | None = None
    first_gen_log_probs: list[Any] | None = None
    ctx_request_id: int | None = None
    encoded_opaque_state: str | None = None
    draft_tokens: list[int] | None = None
    disagg_request_id: int | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None
    schedule_style: str | int | None = None
    ctx_usage: UsageIn | None = None
    conversation_id: str | None = None
    return_prompt_token_ids_b64: bool = False


class ConversationParams(_Strict):
    conversation_id: str

    @field_validator("conversation_id", mode="before")
    @classmethod
    def _strip(cls, value: Any) -> str:
        text = "" if value is None else str(value).strip()
        if not text:
            raise ValueError("conversation_id must be non-empty")
        return text


class StreamOptions(_Strict):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _Common(_Strict):
    """Fields shared by chat and completions requests."""

    model: str
    prompt_token_ids: list[int] | None = None
    prompt_token_ids_b64: str | None = None
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1)
    presence_penalty: float | None = 0.0
    response_format: dict[str, Any] | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    user: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    use_beam_search: bool = False
    top_k: int = Field(default=0, ge=0)
    top_p_min: float = 0.0
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    lora_request: dict[str, Any] | None = None
    priority: float | None = Field(default=None, ge=0.0, le=1.0)
    disaggregated_params: DisaggregatedParams | None = None
    conversation_params: ConversationParams | None = None
    cache_salt: str | None = None
    #: vLLM's field (not TensorRT-LLM's; NeMo-Gym's training config sends it): log-prob tokens
    #: are answered as ``token_id:N`` (drs_protocol.fields.TOKEN_ID_PREFIX) instead of their text.
    return_tokens_as_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _stream_options_need_stream(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stream_options") is not None and not data.get("stream"):
            raise ValueError("stream_options can only be set if stream is true")
        return data

    def request_type(self) -> RequestType:
        dp = self.disaggregated_params
        return dp.request_type if dp is not None else RequestType.CONTEXT_AND_GENERATION

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def conversation_id(self) -> str | None:
        """``conversation_params`` wins over ``disaggregated_params.conversation_id``."""
        if self.conversation_params is not None:
            return self.conversation_params.conversation_id
        dp = self.disaggregated_params
        return dp.conversation_id if dp is not None and dp.conversation_id else None

    def wants_logprobs(self) -> bool:
        raise NotImplementedError

    def top_logprobs_count(self) -> int:
        raise NotImplementedError


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = "none"
    reasoning_effort: str | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    #: NeMo RL's field (not TensorRT-LLM's): the rendered prompt is spliced after these ids
    #: (drs_protocol.token_prefix); without it, after the last assistant message's Gym ids.
    required_prefix_token_ids: list[int] | None = None

    @model_validator(mode="before")
    @classmethod
    def _top_logprobs_need_logprobs(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("top_logprobs") and not data.get("logprobs"):
            raise ValueError("logprobs must be true when using top_logprobs")
        return data

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def top_logprobs_count(self) -> int:
        return self.top_logprobs or 0


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: str | list[int] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    add_special_tokens: bool = True
    detokenize: bool = True

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    def wants_logprobs(self) -> bool:
        """``logprobs: 0`` asks for the sampled tokens' log-probs without alternatives (OpenAI, vLLM)."""
        return self.logprobs is not None

    def top_logprobs_count(self) -> int:
        return self.logprobs or 0


EngineRequest = ChatCompletionRequest | CompletionRequest
