"""Strict mode: every response body fits TensorRT-LLM's own OpenAI response models.

TensorRT-LLM's response models are ``extra="forbid"``, so a stock ``OpenAIDisaggServer`` rejects a
response carrying a field they do not declare. This engine adds such fields for NeMo-Gym and our
frontend (``token_ids`` on chat choices, relayed unknown ``disaggregated_params`` fields,
``x-drs`` extras). With ``strictTrtllmResponses: true`` the engine drops every field that the
transcribed models (``trtllm/surface.json`` → ``openai_models``, the attributed version only; the
fields seen only in newer unattributed versions are not answered) do not declare, so a stock
TensorRT-LLM front can sit before it. ``prompt_token_ids_b64`` becomes ``prompt_token_ids``. The tests validate the answers against pydantic models
built from the same transcription.
"""

from __future__ import annotations

from typing import Any, Final

from drs_protocol.token_ids import decode_token_ids_b64

from drs_engine.backends.trtllm.surface import openai_model_fields

_FULL: Final = {
    True: ("ChatCompletionResponse", "ChatCompletionResponseChoice"),
    False: ("CompletionResponse", "CompletionResponseChoice"),
}
_STREAM: Final = {
    True: ("ChatCompletionStreamResponse", "ChatCompletionResponseStreamChoice"),
    False: ("CompletionStreamResponse", "CompletionResponseStreamChoice"),
}


def _keep(body: dict[str, Any], model: str) -> dict[str, Any]:
    allowed = openai_model_fields(model)
    return {k: v for k, v in body.items() if k in allowed}


def trtllm_view(body: dict[str, Any], *, chat: bool, stream: bool) -> dict[str, Any]:
    """``body`` with only the fields TensorRT-LLM's response models declare."""
    top, choice_model = (_STREAM if stream else _FULL)[chat]
    if body.get("prompt_token_ids_b64") is not None and "prompt_token_ids_b64" not in openai_model_fields(
        top
    ):  # the recorded models have only the int list
        body = {**body, "prompt_token_ids": decode_token_ids_b64(body["prompt_token_ids_b64"])}
    out = _keep(body, top)
    choices = []
    for choice in body.get("choices", []):
        kept = _keep(choice, choice_model)
        if isinstance(kept.get("disaggregated_params"), dict):
            kept["disaggregated_params"] = _keep(kept["disaggregated_params"], "DisaggregatedParams")
        if chat and isinstance(kept.get("message"), dict):
            kept["message"] = _keep(kept["message"], "ChatMessage")
        if chat and isinstance(kept.get("delta"), dict):
            kept["delta"] = _keep(kept["delta"], "DeltaMessage")
        choices.append(kept)
    if "choices" in out:
        out["choices"] = choices
    if isinstance(out.get("usage"), dict):
        out["usage"] = _keep(out["usage"], "UsageInfo")
    return out
