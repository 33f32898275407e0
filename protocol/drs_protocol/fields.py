"""Field, header and value names of the wire protocol, in one place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

#: Fields NeMo-Gym adds that TensorRT-LLM's request models (extra="forbid") reject:
#: the frontend strips them before relaying.
GYM_ONLY_FIELDS: Final = ("return_tokens_as_token_ids", "return_token_ids", "required_prefix_token_ids")

#: Headers that carry a conversation id, in priority order (after the body's conversation_params).
CONVERSATION_HEADERS: Final = ("x-session-id", "x-correlation-id", "x-session-affinity", "x-multi-turn-session-id")

#: Response headers naming the engines that served a turn.
HEADER_PREFILL_ENGINE: Final = "x-drs-prefill"
HEADER_DECODE_ENGINE: Final = "x-drs-decode"
#: Response header of an engine: the weights version that produced the response.
HEADER_WEIGHTS_VERSION: Final = "x-drs-weights-version"

CONTEXT_ONLY: Final = "context_only"
GENERATION_ONLY: Final = "generation_only"
CONTEXT_AND_GENERATION: Final = "context_and_generation"

#: Context-leg finish reasons that mean "go on to the generation leg".
UNFINISHED_REASONS: Final = ("length", "not_finished")


def conversation_id_from(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """The conversation id of a request: ``conversation_params.conversation_id`` wins, else the
    first present header of :data:`CONVERSATION_HEADERS` (header lookup is case-insensitive when
    ``headers`` is, as Starlette's and aiohttp's are)."""
    params = body.get("conversation_params")
    if isinstance(params, Mapping):
        cid = params.get("conversation_id")
        if isinstance(cid, str) and cid:
            return cid
    for name in CONVERSATION_HEADERS:
        value = headers.get(name)
        if value:
            return value
    return None
