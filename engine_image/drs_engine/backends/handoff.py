"""The backend-neutral steps of a KV handoff, written once for every backend that moves context
state itself (``sim`` and ``torch``; TensorRT-LLM's cache transceiver does its own). Each
backend's transport lives in its own folder (``sim/handoff.py``, ``torch/handoff/``).

The decode engine's side: :func:`context_source` reads where a ``generation_only`` leg's context
lies, :func:`raise_for_fetch_status` maps the prefill engine's answer (404 →
:class:`~drs_engine.errors.ContextStateMissingError`, anything else but 200 →
:class:`~drs_engine.errors.KvTransferError`), and :func:`check_received` refuses a context that
belongs to another prompt or another first token. The prefill engine's side:
:func:`context_request_id` (the id a ``context_only`` leg is stored under) and
:func:`missing_here` (the 404 of the export route), :func:`left_context` (the handoff a
``context_only`` leg answers with) and the ``encoded_opaque_state`` codec
(:func:`encode_opaque`, :func:`decode_opaque`: base64 of a JSON object naming its ``kind``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from drs_engine.backends.base import ContextHandoff, LegRequest, Picked
from drs_engine.errors import BadRequestError, ContextMismatchError, ContextStateMissingError, KvTransferError
from drs_engine.prefix_hash import ids_digest


@dataclass(frozen=True, slots=True)
class ContextSource:
    """Where a ``generation_only`` leg's context lies."""

    ctx_request_id: int
    #: the prefill engine's base URL, without a trailing slash
    endpoint: str


def context_request_id(leg: LegRequest) -> int:
    """The id a ``context_only`` leg leaves its state under (the server always assigns one)."""
    if leg.ctx_request_id is None:
        raise BadRequestError("context_only leg without a ctx_request_id")
    return leg.ctx_request_id


def context_source(leg: LegRequest) -> ContextSource:
    """The ``ctx_request_id`` and ``ctx_info_endpoint`` a ``generation_only`` leg must carry."""
    dp = leg.request.disaggregated_params
    if dp is None or dp.ctx_request_id is None:
        raise BadRequestError(
            "generation_only needs disaggregated_params.ctx_request_id", param="disaggregated_params.ctx_request_id"
        )
    if not dp.ctx_info_endpoint:
        raise BadRequestError(
            "generation_only needs disaggregated_params.ctx_info_endpoint (where the context state is)",
            param="disaggregated_params.ctx_info_endpoint",
        )
    return ContextSource(dp.ctx_request_id, dp.ctx_info_endpoint.rstrip("/"))


def missing_here(ctx_request_id: int) -> ContextStateMissingError:
    """The export route's answer for a context this engine does not hold."""
    return ContextStateMissingError(
        f"no context state for ctx_request_id {ctx_request_id} on this engine "
        "(expired, already fetched, or never created)",
        param="ctx_request_id",
    )


def raise_for_fetch_status(source: ContextSource, status_code: int, body: str) -> None:
    """Nothing for 200; the prefill engine's 404 as a missing context; any other status as a failed transfer."""
    if status_code == 200:
        return
    if status_code == 404:
        raise ContextStateMissingError(
            f"context state for ctx_request_id {source.ctx_request_id} is not on {source.endpoint} "
            "(expired, already fetched, or never created)",
            param="disaggregated_params.ctx_request_id",
        )
    raise KvTransferError(
        f"fetching context state for ctx_request_id {source.ctx_request_id} from {source.endpoint} "
        f"failed with HTTP {status_code}: {body[:300]}"
    )


@dataclass(frozen=True, slots=True)
class PromptDigest:
    """A prompt named by its digest (:func:`prompt_digest`) where its ids did not travel."""

    value: str


def prompt_digest(prompt_token_ids: Sequence[int]) -> str:
    """BLAKE2b-128 (hex) of the prompt's ids as int32: how a context's prompt is checked without its ids."""
    return ids_digest(prompt_token_ids).hex()


def check_received(
    leg: LegRequest, ctx_request_id: int, prompt: Sequence[int] | PromptDigest, first_token: int
) -> None:
    """A fetched context must be this leg's: computed for its prompt (its ids, or their digest),
    and (when the leg says) with its first token."""
    if isinstance(prompt, PromptDigest):
        same, there = prompt.value == prompt_digest(leg.prompt_token_ids), "another digest there"
    else:
        same, there = list(prompt) == leg.prompt_token_ids, f"{len(prompt)} tokens there"
    if not same:
        raise ContextMismatchError(
            f"context state for ctx_request_id {ctx_request_id} was computed for a different prompt "
            f"({there}, {len(leg.prompt_token_ids)} tokens here)",
            param="prompt_token_ids",
        )
    dp = leg.request.disaggregated_params
    if dp is not None and dp.first_gen_tokens and dp.first_gen_tokens[0] != first_token:
        raise ContextMismatchError(
            f"first_gen_tokens do not match the context state of ctx_request_id {ctx_request_id}",
            param="disaggregated_params.first_gen_tokens",
        )


def left_context(leg: LegRequest, first: Picked, *, opaque: str, endpoint: str) -> ContextHandoff:
    """What a ``context_only`` leg that left its state answers with."""
    return ContextHandoff(
        ctx_request_id=context_request_id(leg),
        first_gen_tokens=[first.token_id],
        encoded_opaque_state=opaque,
        first_gen_log_probs=[{"token_id": first.token_id, "logprob": first.logprob}] if leg.logprobs else None,
        ctx_dp_rank=0,
        ctx_info_endpoint=endpoint,
    )


def encode_opaque(data: dict[str, Any]) -> str:
    """``encoded_opaque_state``: base64 of the JSON of ``data`` (keys sorted)."""
    return base64.b64encode(json.dumps(data, sort_keys=True).encode()).decode("ascii")


def decode_opaque(encoded: str | None, kind: str) -> dict[str, Any]:
    """The object :func:`encode_opaque` wrote, when it names ``kind``; else ``{}`` (another backend's, or none)."""
    if not encoded:
        return {}
    try:
        data = json.loads(base64.b64decode(encoded, validate=True))
    except (ValueError, TypeError):
        return {}
    return data if isinstance(data, dict) and data.get("kind") == kind else {}
