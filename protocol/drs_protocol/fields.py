"""Field, header and value names of the wire protocol, in one place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

#: vLLM's request field that NeMo-Gym's training config sends: log-prob tokens are answered as
#: ``token_id:N`` (:data:`TOKEN_ID_PREFIX`) instead of their text. The drs engine accepts and
#: honours it (every backend; an extension: TensorRT-LLM's request models have no such field), and
#: the frontend relays it to both legs.
RETURN_TOKENS_AS_TOKEN_IDS: Final = "return_tokens_as_token_ids"
#: A log-prob entry's token under :data:`RETURN_TOKENS_AS_TOKEN_IDS`: ``f"{TOKEN_ID_PREFIX}{id}"``.
TOKEN_ID_PREFIX: Final = "token_id:"

#: Fields NeMo-Gym adds that TensorRT-LLM's request models (extra="forbid") reject and that the
#: frontend strips before relaying: ``return_token_ids`` (every drs answer carries the ids) and
#: ``required_prefix_token_ids`` (honoured by the splice, then given to an engine that splices).
GYM_ONLY_FIELDS: Final = ("return_token_ids", "required_prefix_token_ids")

#: The first header that carries a conversation id (a client that sends one sends this).
SESSION_HEADER: Final = "x-session-id"
#: Headers that carry a conversation id, in priority order (after the body's conversation_params).
CONVERSATION_HEADERS: Final = (SESSION_HEADER, "x-correlation-id", "x-session-affinity", "x-multi-turn-session-id")

#: Response headers naming the engines that served a turn.
HEADER_PREFILL_ENGINE: Final = "x-drs-prefill"
HEADER_DECODE_ENGINE: Final = "x-drs-decode"
#: Response header of an engine: the weights version that produced the response.
HEADER_WEIGHTS_VERSION: Final = "x-drs-weights-version"
#: Request and response header: the wall-clock instant (epoch seconds) the fleet received the turn.
#: The frontend stamps a turn once, sends it on both legs and returns it in the answer; an engine
#: judges the turn against the announced target's cut-over by it (:mod:`drs_protocol.cutover`).
HEADER_TURN_STARTED: Final = "x-drs-turn-started"
#: The standard header of a 503 saying when to try again (whole seconds), e.g. ``weights_pending``.
RETRY_AFTER_HEADER: Final = "retry-after"

#: The engine control API's credential: ``authorization: Bearer <token>`` (the token of
#: ``env.CONTROL_TOKEN``); a 401 names the scheme in ``www-authenticate``.
CONTROL_AUTH_HEADER: Final = "authorization"
CONTROL_AUTH_CHALLENGE_HEADER: Final = "www-authenticate"
CONTROL_AUTH_SCHEME: Final = "Bearer"

CONTEXT_ONLY: Final = "context_only"
GENERATION_ONLY: Final = "generation_only"
CONTEXT_AND_GENERATION: Final = "context_and_generation"

#: Context-leg finish reasons that mean "go on to the generation leg".
UNFINISHED_REASONS: Final = ("length", "not_finished")
#: ``GET /server_info`` of an engine: its prefix-cache block size (tokens), which a frontend
#: started without ``prefixBlockTokens`` adopts for its prefix routing.
SERVER_INFO_TOKENS_PER_BLOCK: Final = "tokens_per_block"


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


def control_auth(token: str) -> dict[str, str]:
    """The header a control-API caller sends."""
    return {CONTROL_AUTH_HEADER: f"{CONTROL_AUTH_SCHEME} {token}"}


def bearer_token(header: str) -> str | None:
    """The token of an ``authorization`` value in the control API's scheme (case-insensitive), or None."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != CONTROL_AUTH_SCHEME.lower() or not token.strip():
        return None
    return token.strip()
