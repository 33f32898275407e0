"""OpenAI response bodies (and stream chunks) from a leg's tokens: pure functions.

Shapes follow TensorRT-LLM's ``openai_protocol`` (``ChatCompletionResponse``,
``CompletionResponse``, their stream variants) plus what PROTOCOL.md adds: every choice carries
``token_ids``, the response carries top-level ``prompt_token_ids`` (or ``prompt_token_ids_b64``
with ``prompt_token_ids: null`` when a context leg asked for ``return_prompt_token_ids_b64``), and
a context-only choice carries ``disaggregated_params``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from drs_protocol import fields
from drs_protocol.token_ids import encode_token_ids_b64

from drs_engine.backends.base import ContextHandoff, LegFinished, TokenStep
from drs_engine.server.strict import trtllm_view
from drs_engine.wire import DisaggregatedParams, RequestType

#: token id -> its text in a logprobs entry.
TokenText = Callable[[int], str]


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """What every chunk of one response shares."""

    id: str
    created: int
    model: str
    chat: bool
    #: ``strictTrtllmResponses``: only fields TensorRT-LLM's response models declare (strict.py).
    strict: bool = False

    @classmethod
    def new(cls, model: str, *, chat: bool, strict: bool = False) -> ResponseMeta:
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()), model=model, chat=chat, strict=strict)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def disaggregated_params_out(request_params: DisaggregatedParams | None, handoff: ContextHandoff) -> dict[str, Any]:
    """A context choice's ``disaggregated_params``: the request's (unknown fields relayed) overlaid
    with what the engine produced."""
    out: dict[str, Any] = {}
    if request_params is not None:
        out = request_params.model_dump(mode="json", exclude_none=True)
        out.pop("ctx_usage", None)
    out["request_type"] = RequestType.CONTEXT_ONLY.value
    out["ctx_request_id"] = handoff.ctx_request_id
    out["first_gen_tokens"] = list(handoff.first_gen_tokens)
    for name in ("encoded_opaque_state", "first_gen_log_probs", "ctx_dp_rank", "ctx_info_endpoint"):
        value = getattr(handoff, name)
        if value is not None:
            out[name] = value
    return out


def _text_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def token_texts(text_of: TokenText, *, as_token_ids: bool) -> TokenText:
    """How a log-prob entry names its token: its text, or ``token_id:N`` when the request asked
    ``return_tokens_as_token_ids`` (vLLM's field, which NeMo-Gym's training config sends)."""
    if as_token_ids:
        return lambda tid: f"{fields.TOKEN_ID_PREFIX}{tid}"
    return text_of


def chat_logprobs(steps: Sequence[TokenStep], token_text: TokenText, top: int) -> dict[str, Any]:
    """``choice.logprobs`` of a chat answer. Every entry carries ``top_logprobs``, a list (empty
    when none were asked): OpenAI's ``ChatCompletionTokenLogprob`` requires it, and NeMo-Gym
    validates the answer with the SDK's models."""
    content = []
    for step in steps:
        text = token_text(step.token_id)
        content.append(
            {
                "token": text,
                "logprob": max(step.logprob if step.logprob is not None else -9999.0, -9999.0),
                "bytes": _text_bytes(text),
                "top_logprobs": [
                    {"token": (t := token_text(tid)), "logprob": max(lp, -9999.0), "bytes": _text_bytes(t)}
                    for tid, lp in step.top_logprobs[:top]
                ]
                if top
                else [],
            }
        )
    return {"content": content}


def completion_logprobs(
    steps: Sequence[TokenStep], token_text: TokenText, top: int, text_offset: int = 0
) -> dict[str, Any]:
    """``choice.logprobs`` of a completions answer; ``top_logprobs`` holds one dict per token (empty
    when none were asked: OpenAI's ``Logprobs`` types it ``List[Dict[str, float]]``)."""
    tokens, token_logprobs, offsets, tops = [], [], [], []
    offset = text_offset
    for step in steps:
        text = token_text(step.token_id)
        tokens.append(text)
        token_logprobs.append(step.logprob)
        offsets.append(offset)
        offset += len(text)
        tops.append({token_text(tid): lp for tid, lp in step.top_logprobs[:top]} if top else {})
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": tops}


def prompt_ids_fields(prompt_token_ids: Sequence[int], *, as_b64: bool) -> dict[str, Any]:
    if as_b64:
        return {"prompt_token_ids": None, "prompt_token_ids_b64": encode_token_ids_b64(prompt_token_ids)}
    return {"prompt_token_ids": list(prompt_token_ids)}


def full_response(
    meta: ResponseMeta,
    *,
    text: str,
    steps: Sequence[TokenStep],
    finished: LegFinished,
    logprobs: bool,
    top_logprobs: int,
    token_text: TokenText,
    prompt_token_ids: Sequence[int],
    prompt_ids_b64: bool,
    disaggregated_params: dict[str, Any] | None,
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` or ``text_completion`` body."""
    token_ids = [s.token_id for s in steps]
    choice: dict[str, Any] = {"index": 0}
    if meta.chat:
        choice["message"] = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": []}
        choice["logprobs"] = chat_logprobs(steps, token_text, top_logprobs) if logprobs else None
    else:
        choice["text"] = text
        choice["logprobs"] = completion_logprobs(steps, token_text, top_logprobs) if logprobs else None
    choice["token_ids"] = token_ids
    choice["finish_reason"] = finished.finish_reason
    choice["stop_reason"] = finished.stop_reason
    choice["disaggregated_params"] = disaggregated_params
    body: dict[str, Any] = {
        "id": meta.id,
        "object": "chat.completion" if meta.chat else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage(finished.prompt_tokens, len(token_ids), finished.cached_tokens),
    }
    body.update(prompt_ids_fields(prompt_token_ids, as_b64=prompt_ids_b64))
    return trtllm_view(body, chat=meta.chat, stream=False) if meta.strict else body


def stream_chunk(
    meta: ResponseMeta,
    *,
    text: str | None,
    steps: Sequence[TokenStep],
    logprobs: bool,
    top_logprobs: int,
    token_text: TokenText,
    role: bool = False,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    """One SSE chunk (OpenAI chunk shape) carrying ``steps`` and their text."""
    choice: dict[str, Any] = {"index": 0}
    if meta.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
        choice["logprobs"] = chat_logprobs(steps, token_text, top_logprobs) if logprobs and steps else None
    else:
        choice["text"] = text or ""
        choice["logprobs"] = completion_logprobs(steps, token_text, top_logprobs) if logprobs and steps else None
    choice["token_ids"] = [s.token_id for s in steps]
    choice["finish_reason"] = finish_reason
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    chunk = {
        "id": meta.id,
        "object": "chat.completion.chunk" if meta.chat else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    }
    return trtllm_view(chunk, chat=meta.chat, stream=True) if meta.strict else chunk


def usage_chunk(meta: ResponseMeta, finished: LegFinished, completion_tokens: int) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, just usage."""
    return {
        "id": meta.id,
        "object": "chat.completion.chunk" if meta.chat else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage(finished.prompt_tokens, completion_tokens, finished.cached_tokens),
    }
