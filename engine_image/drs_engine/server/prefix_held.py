"""``POST /v1/prefix_cache/held``: what this engine's prefix cache holds of a prompt.

A frontend asks it on a routing miss (``drs_protocol.prefix_lookup``): the body's ``messages``
(and ``tools``) are rendered with the chat template and no generation prompt, by the function the
frontend tokenizes with, else its ``prompt_token_ids`` are taken as they are; the backend counts
the leading full blocks it holds under the weights served now (501 from a backend that cannot
say). Served while awake only, like a turn; behind the serving token like every serving route.
"""

from __future__ import annotations

import asyncio

from drs_protocol.body import parse_json_object, read_body
from drs_protocol.chat import ChatTemplateError, render_prompt_ids
from drs_protocol.prefix_lookup import PrefixHeldRequest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from drs_engine.errors import BadRequestError, EngineError
from drs_engine.server.body import validate
from drs_engine.server.state import EngineState


async def prefix_held(state: EngineState, request: Request) -> Response:
    try:
        state.check_serving()
        backend = state.require_backend()
        body = await read_body(request, state.config.request_bytes_limit())
        req = validate(PrefixHeldRequest, parse_json_object(body))
        messages = req.messages  # the model's validator: these, or prompt_token_ids
        if messages is None:
            ids = list(req.prompt_token_ids or ())
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
    return JSONResponse(held.model_dump(mode="json"))
