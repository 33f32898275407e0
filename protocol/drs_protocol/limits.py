"""Limits two processes must agree on: what one side sends, the other accepts.

Request bodies (docs/concepts.md, "Limits"): a frontend accepts a client body of up to
``limits.maxRequestBytes`` (:data:`FRONTEND_MAX_REQUEST_BYTES` by default) and forwards a bigger
one to the engines: a tokenizing frontend adds the prompt ids (``prompt_token_ids_b64``), every
frontend adds ``disaggregated_params`` (ids, the request type, a conversation id that may come from
a request header) and the generation leg carries the context leg's prompt ids and usage. The
engines' limit is therefore derived, never chosen on its own:
:func:`engine_max_request_bytes` = the frontend's limit + the base64 ids of a longest prompt
(``maxModelLen`` tokens; an engine refuses a longer one anyway) + :data:`FORWARD_OVERHEAD_BYTES`.
The operator renders both sides from this one function; a frontend checks every body it forwards
against the same number and answers a larger one with its own 413 naming the limit, so a client
never sees an engine's bare 413.
"""

from __future__ import annotations

from typing import Final

#: Longest weights version (characters): the engine's control API, the sidecar's trainer API and
#: ``status.weights.version`` in the CRD all use this bound.
MAX_WEIGHTS_VERSION_CHARS: Final = 256
#: Longest lease of an announced weights target (seconds): an engine refuses new legs for at most
#: this long after the last announce unless it comes to hold the target (a sidecar that died
#: between its announce and the load leaves no engine refusing for good).
MAX_WEIGHTS_TARGET_LEASE_S: Final = 3600.0
#: Largest control-API request body an engine accepts (bytes); larger gets 413.
MAX_CONTROL_BODY_BYTES: Final = 1024 * 1024

#: Seconds a collective refit step (joining the group, one update's broadcasts) may take by
#: default: ``drs sidecar --collective-timeout``; an engine given no ``timeout_s`` waits this long.
DEFAULT_COLLECTIVE_TIMEOUT_S: Final = 300.0
#: The longest ``timeout_s`` an engine accepts for one collective step (seconds).
MAX_COLLECTIVE_TIMEOUT_S: Final = 3600.0

MIB: Final = 1024 * 1024
#: Largest request body a frontend accepts from a client by default (bytes); larger gets 413.
FRONTEND_MAX_REQUEST_BYTES: Final = 16 * MIB
#: Longest request head a frontend accepts (bytes); larger gets 431. A conversation id may come
#: from a header, so it is bounded by this too.
MAX_REQUEST_HEAD_BYTES: Final = 64 * 1024
#: The model's default longest prompt + completion (tokens), ``spec.model.maxModelLen``.
DEFAULT_MAX_MODEL_LEN: Final = 32768
#: Bytes a frontend adds to a forwarded body besides the prompt ids: ``disaggregated_params``
#: (a conversation id up to a request head long, the context leg's own params), ``ctx_usage``,
#: ``stream`` fields. Twice the head bound plus 64 KiB for the fixed-size fields.
FORWARD_OVERHEAD_BYTES: Final = 2 * MAX_REQUEST_HEAD_BYTES + 64 * 1024
#: Bytes of one int32 token id before base64.
TOKEN_ID_BYTES: Final = 4


def token_ids_b64_bytes(tokens: int) -> int:
    """Length of ``encode_token_ids_b64`` of ``tokens`` ids, plus the quoted field name and comma."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    raw = tokens * TOKEN_ID_BYTES
    return 4 * ((raw + 2) // 3) + len('"prompt_token_ids_b64":"",')


def engine_max_request_bytes(frontend_max_request_bytes: int, max_model_len: int) -> int:
    """The largest body an engine must accept so that any body a frontend accepts (up to
    ``frontend_max_request_bytes``) is still accepted once the frontend forwards it with the
    prompt ids of a prompt the engine can serve (fewer than ``max_model_len`` tokens)."""
    if frontend_max_request_bytes < 0 or max_model_len < 1:
        raise ValueError(
            f"need frontend_max_request_bytes >= 0 and max_model_len >= 1, got {frontend_max_request_bytes}, "
            f"{max_model_len}"
        )
    return frontend_max_request_bytes + token_ids_b64_bytes(max_model_len) + FORWARD_OVERHEAD_BYTES


#: Largest request body an engine's serving routes accept by default (the default frontend limit
#: forwarded with a default-length prompt's ids); ``drs engine`` derives it from its own
#: ``maxModelLen`` when the config leaves it unset.
DEFAULT_ENGINE_MAX_REQUEST_BYTES: Final = engine_max_request_bytes(FRONTEND_MAX_REQUEST_BYTES, DEFAULT_MAX_MODEL_LEN)
