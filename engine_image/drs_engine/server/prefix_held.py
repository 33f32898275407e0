"""``POST /v1/prefix_cache/held``: what this engine's prefix cache holds of a prompt, and its own prefill work.

A frontend asks it on a routing miss (``drs_protocol.prefix_lookup``): the body's ``messages``
(and ``tools``) are rendered with the chat template and no generation prompt, by the function the
frontend tokenizes with, else its ``prompt_token_ids`` are taken as they are; the backend counts
the leading full blocks it holds under the weights served now (501 from a backend that cannot
say), and the server adds what it keeps of every leg that prefills (:mod:`drs_engine.prefill_work`):
the blocks a leg in flight will store (``pending_blocks``) and its recent work (``recent_work``).
A request with a ``claim`` (a frontend placed a new group here) is counted at once if the recent
work stays within its limit (:meth:`drs_engine.prefill_work.PrefillWork.claim`); its answer says
``claimed`` and gives the live recent work, not the quote (as does one asking ``live``), and the
pending blocks as they stood before the claim; one with ``release`` drops this prompt's claims
that no leg has taken (:meth:`drs_engine.prefill_work.PrefillWork.release`).
Served while awake only, like a turn; behind the serving token like every serving route.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from drs_protocol.body import parse_json_object, read_body
from drs_protocol.chat import ChatTemplateError, render_prompt_ids
from drs_protocol.prefix_lookup import PrefixHeldRequest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from drs_engine.backends.base import EngineBackend, LegFinished
from drs_engine.errors import BadRequestError, EngineError, NotSupportedError
from drs_engine.prefill_work import FOLLOW_SECONDS, InFlight
from drs_engine.server.body import check_token_ids, validate
from drs_engine.server.state import EngineState

#: Tokens per block of the in-flight match for a backend that does not say (it answers no lookup).
UNKNOWN_BLOCK_TOKENS = 32


async def prefix_held(state: EngineState, request: Request) -> Response:
    try:
        state.check_serving()
        backend = state.require_backend()
        body = await read_body(request, state.config.request_bytes_limit())
        req = validate(PrefixHeldRequest, parse_json_object(body))
        messages = req.messages  # the model's validator: these, or prompt_token_ids
        if messages is None:
            ids = list(req.prompt_token_ids or ())
            check_token_ids(ids, len(state.tokenizer), "prompt_token_ids")
        else:
            try:
                ids = await asyncio.to_thread(
                    render_prompt_ids, state.tokenizer, messages, tools=req.tools, add_generation_prompt=False
                )
            except ChatTemplateError as exc:
                raise BadRequestError(str(exc), param="messages") from exc
        held = backend.prefix_held(ids)
    except EngineError as exc:
        return JSONResponse(exc.to_body(), status_code=exc.status)
    work = state.prefill_work
    weights = backend.weights_version
    if req.release:
        work.release(ids, weights)
    # pending before the claim: the frontend asks whether a sibling is here, not whether its own claim is
    update: dict[str, object] = {
        "pending_blocks": min(work.pending_blocks(ids, weights, held.tokens_per_block), held.blocks)
    }
    if req.claim is not None:
        claim = req.claim
        update["claimed"] = work.claim(
            ids, weights, claim.tokens, limit=claim.limit, tokens_per_block=held.tokens_per_block
        )
        update["recent_work"] = work.recent_work()
    else:
        update["recent_work"] = work.recent_work() if req.live else work.quote(ids)
    return JSONResponse(held.model_copy(update=update).model_dump(mode="json", exclude_none=req.claim is None))


def leg_started(
    state: EngineState, backend: EngineBackend, prompt_ids: Sequence[int], *, context_only: bool
) -> InFlight:
    """Count a leg that prefills here from its arrival (its expected work, its pending blocks);
    only a ``context_only`` leg may be followed (:mod:`drs_engine.prefill_work`)."""
    try:
        held = backend.prefix_held(prompt_ids)
        held_tokens, per_block = held.held_tokens, held.tokens_per_block
    except NotSupportedError:
        held_tokens, per_block = 0, UNKNOWN_BLOCK_TOKENS
    return state.prefill_work.start(
        prompt_ids,
        backend.weights_version,
        held_tokens=held_tokens,
        tokens_per_block=per_block,
        followable=context_only,
    )


async def follow(leg: InFlight | None) -> None:
    """Wait for the leg in flight that stores every full block of this one's prompt (a sibling
    another frontend sent here a moment ago), at most :data:`FOLLOW_SECONDS`: then the prompt is
    read from the cache, not computed twice in one iteration."""
    if leg is not None and leg.follows is not None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(leg.follows.ended.wait(), FOLLOW_SECONDS)


def leg_ended(state: EngineState, leg: InFlight | None, finished: LegFinished | None) -> None:
    """The leg ended: what it computed (nothing known when it failed) joins the recent work."""
    if leg is not None:
        computed = 0 if finished is None else max(0, finished.prompt_tokens - finished.cached_tokens)
        state.prefill_work.finish(leg, computed)
