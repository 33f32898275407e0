"""Request and response shapes of one turn (PROTOCOL.md sections 1 and 2): pure functions.

In the order a turn uses them:

1. :func:`parse_request` — the client's JSON body, checked just enough to relay it (the engines
   validate the rest and their 4xx passes through); raises
   :class:`~drs_frontend.errors.RequestError`.
2. :func:`strip_client_fields` — drop the NeMo-Gym fields no engine takes (``return_token_ids``,
   ``required_prefix_token_ids``; ``return_tokens_as_token_ids`` is relayed: the engines honour it).
3. :func:`build_context_request` — the context leg.
4. :func:`check_context_response` — is the turn already finished?
5. :func:`build_generation_request` — the generation leg.
6. :func:`shape_response` — token ids and log-probs copied onto ``choices[].message`` where
   NeMo-Gym reads them; :func:`finished_context_response` for the early return;
   :func:`sse_events` to stream a complete response as server-sent events.

Bodies are shallow-copied, never mutated: the caller's dict stays the client's request.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from drs_protocol import fields, token_prefix
from drs_protocol.routes import Endpoint
from drs_protocol.token_ids import TokenIdsError, decode_token_ids_b64

from drs_frontend import gym_ids, wire_json
from drs_frontend.errors import ForwardTooLarge, RequestError, UpstreamProtocolError
from drs_frontend.tokenization.window import GYM_MESSAGE_FIELDS, message_view

Body = dict[str, Any]


# -- 1. the client's request ---------------------------------------------------------------------


def parse_request(raw: bytes, endpoint: Endpoint, *, skip_gym_ids: bool = False) -> Body:
    """The request body as a dict; 400 for malformed JSON, missing ``messages``/``prompt``, or a
    ``conversation_params`` without a non-empty string ``conversation_id``. ``skip_gym_ids``: Gym's
    id arrays are left as JSON text (:func:`drs_frontend.gym_ids.loads_chat`)."""
    try:
        body = gym_ids.loads_chat(raw) if skip_gym_ids and endpoint is Endpoint.CHAT else wire_json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages: a non-empty list of messages is required", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RequestError(f"messages[{i}]: must be an object with a string role", param="messages")
    elif "prompt" not in body and "prompt_token_ids" not in body:
        raise RequestError("prompt: required", param="prompt")
    params = body.get("conversation_params")
    if params is not None:
        cid = params.get("conversation_id") if isinstance(params, dict) else None
        if not isinstance(cid, str) or not cid.strip():
            raise RequestError(
                "conversation_params: must be an object with a non-empty string conversation_id",
                param="conversation_params",
            )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError("stream: must be a boolean", param="stream")
    return body


def strip_client_fields(body: Body) -> Body:
    """``body`` without the Gym-only fields TensorRT-LLM rejects (``extra="forbid"``)."""
    if not any(name in body for name in fields.GYM_ONLY_FIELDS):
        return body
    return {k: v for k, v in body.items() if k not in fields.GYM_ONLY_FIELDS}


def engine_token_prefix(request: Body, body: Body, *, tokenized: bool, continuity: bool) -> Body:
    """The chat body the engines get. Gym's ids on earlier assistant messages (``prompt_token_ids``,
    ``generation_token_ids``, ``generation_log_probs``: O(turns²) ids over a conversation) go
    only where they are used:

    * ``tokenized`` (this frontend built the prompt ids, spliced or not): taken off the messages;
      the engines get the ids and never render the template;
    * the engine renders the prompt and ``continuity`` is on: kept, and ``required_prefix_token_ids``
      given back (the drs engine accepts it; PROTOCOL.md section 1), so that the engine splices;
    * the engine renders and ``continuity`` is off: taken off, so that the engine re-tokenizes."""
    if continuity and not tokenized:
        if token_prefix.PREFIX_FIELD in request:
            return {**body, token_prefix.PREFIX_FIELD: request[token_prefix.PREFIX_FIELD]}
        return body
    messages = body["messages"]
    if not any(isinstance(m, dict) and not GYM_MESSAGE_FIELDS.isdisjoint(m) for m in messages):
        return body
    return {**body, "messages": [message_view(m) if isinstance(m, dict) else m for m in messages]}


def wants_stream(body: Mapping[str, Any]) -> bool:
    return body.get("stream") is True


# -- 2. the context leg --------------------------------------------------------------------------


def build_context_request(
    body: Body,
    *,
    disagg_request_id: int,
    conversation_id: str | None,
    tokids_ctxbytes: bool,
    prompt_token_ids_b64: str | None = None,
) -> Body:
    """A copy of the request for the prefill engine: not streamed, context only."""
    ctx = dict(body)
    ctx["stream"] = False
    ctx["stream_options"] = None
    ctx["disaggregated_params"] = {
        "request_type": fields.CONTEXT_ONLY,
        "disagg_request_id": disagg_request_id,
        "conversation_id": conversation_id,
        "return_prompt_token_ids_b64": tokids_ctxbytes,
    }
    if prompt_token_ids_b64 is not None:
        ctx["prompt_token_ids_b64"] = prompt_token_ids_b64
    return ctx


def check_context_response(ctx: Mapping[str, Any]) -> bool:
    """True when the context leg already finished the turn (no generation leg needed).

    Raises :class:`UpstreamProtocolError` when the response lacks what the next step needs.
    """
    choices = ctx.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise UpstreamProtocolError("context response has no choices")
    params = choices[0].get("disaggregated_params")
    if not isinstance(params, dict):
        raise UpstreamProtocolError("context response choice has no disaggregated_params")
    if choices[0].get("finish_reason") not in fields.UNFINISHED_REASONS:
        return True
    for name in ("ctx_request_id", "disagg_request_id"):
        if params.get(name) is None:
            raise UpstreamProtocolError(f"context response disaggregated_params.{name} is missing")
    return False


def finished_context_response(ctx: Body) -> Body:
    """The context response as the turn's answer: ``disaggregated_params`` removed, and the prompt
    ids the leg answered as ``prompt_token_ids_b64`` (our own leg field) given as top-level
    ``prompt_token_ids``, as a generation leg's answer has them: NeMo-Gym reads that field with the
    choice's ``token_ids`` and refuses one without the other ("partial token metadata")."""
    out = dict(ctx)
    out.pop("disaggregated_params", None)
    if out.get("prompt_token_ids") is None and isinstance(out.get("prompt_token_ids_b64"), str):
        out["prompt_token_ids"] = prompt_ids_of(out)
    out.pop("prompt_token_ids_b64", None)
    out["choices"] = [{k: v for k, v in c.items() if k != "disaggregated_params"} for c in ctx["choices"]]
    return out


def for_engines(leg: str, body: Body, limit: int) -> bytes:
    """``body`` as the bytes sent to an engine, or :class:`ForwardTooLarge` (413 here, naming the
    limit) when they are over ``limit``, the engines' body limit: an engine would refuse them with
    a bare 413. The operator renders that limit to cover any body this frontend accepts
    (drs_protocol.limits), so only a prompt longer than any engine serves gets this."""
    payload = wire_json.dumps(body)
    if len(payload) > limit:
        raise ForwardTooLarge(
            f"the {leg} request for the engines would be {len(payload)} bytes (the body plus the prompt ids "
            f"and routing fields this frontend adds), over the engines' limit of {limit} bytes "
            "(limits.engineMaxRequestBytes)"
        )
    return payload


# -- 3. the generation leg -----------------------------------------------------------------------


def build_generation_request(body: Body, ctx: Mapping[str, Any], *, endpoint: Endpoint, strip_history: bool) -> Body:
    """The request for the decode engine: the context choice's params as ``generation_only``."""
    gen = dict(body)
    params = dict(ctx["choices"][0]["disaggregated_params"])
    params["request_type"] = fields.GENERATION_ONLY
    params["ctx_usage"] = ctx.get("usage")
    gen["disaggregated_params"] = params
    b64 = ctx.get("prompt_token_ids_b64")
    if b64 is not None:
        gen["prompt_token_ids_b64"] = b64
        gen.pop("prompt_token_ids", None)
    elif ctx.get("prompt_token_ids") is not None:
        gen["prompt_token_ids"] = ctx["prompt_token_ids"]
        gen.pop("prompt_token_ids_b64", None)
    if strip_history and endpoint is Endpoint.CHAT:
        gen["messages"] = body["messages"][-1:]
    return gen


# -- 4. the answer -------------------------------------------------------------------------------


def parse_response(raw: bytes, leg: str) -> Body:
    """An engine's answer to the ``leg`` request as a dict, or :class:`UpstreamProtocolError`."""
    try:
        data = wire_json.loads(raw)
    except ValueError as exc:
        raise UpstreamProtocolError(f"{leg} leg answered invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UpstreamProtocolError(f"{leg} leg answered {type(data).__name__}, not an object")
    return data


def prompt_ids_of(response: Mapping[str, Any]) -> list[int] | None:
    """Top-level ``prompt_token_ids``, else decoded ``prompt_token_ids_b64``, else None."""
    ids = response.get("prompt_token_ids")
    if isinstance(ids, list):
        return ids
    b64 = response.get("prompt_token_ids_b64")
    if isinstance(b64, str):
        try:
            return decode_token_ids_b64(b64)
        except TokenIdsError as exc:
            raise UpstreamProtocolError(f"engine response: {exc}") from None
    return None


def _logprob_entries(choice: Mapping[str, Any]) -> list[Any] | None:
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        content = logprobs.get("content")
        if isinstance(content, list):
            return content
    return None


def generation_ids_of(choice: Mapping[str, Any]) -> list[int] | None:
    """The choice's ``token_ids``, else the ids in ``"token_id:N"`` logprob tokens."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return ids
    entries = _logprob_entries(choice)
    if not entries:
        return None
    out: list[int] = []
    for entry in entries:
        token = entry.get("token") if isinstance(entry, dict) else None
        if not isinstance(token, str) or not token.startswith(fields.TOKEN_ID_PREFIX):
            return None
        try:
            out.append(int(token[len(fields.TOKEN_ID_PREFIX) :]))
        except ValueError:
            return None
    return out


def shape_response(response: Body, *, prompt_ids: list[int] | None = None) -> Body:
    """Copy prompt ids, generated ids and log-probs onto each chat choice's ``message``.

    ``prompt_ids`` (the frontend's own tokenization) is used only when the engine returned none.
    Completions responses (no ``message``) are returned as they are.
    """
    choices = response.get("choices")
    if not isinstance(choices, list) or not any(isinstance(c, dict) and "message" in c for c in choices):
        return response
    engine_prompt = prompt_ids_of(response)
    prompt = engine_prompt if engine_prompt is not None else prompt_ids
    shaped_choices = []
    for choice in choices:
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            shaped_choices.append(choice)
            continue
        message = dict(message)
        if prompt is not None:
            message["prompt_token_ids"] = prompt
        generated = generation_ids_of(choice)
        if generated is not None:
            message["generation_token_ids"] = generated
        entries = _logprob_entries(choice)
        if entries is not None:
            message["generation_log_probs"] = [e.get("logprob") if isinstance(e, dict) else None for e in entries]
        shaped_choices.append({**choice, "message": message})
    return {**response, "choices": shaped_choices}


# -- 5. a complete response as server-sent events ------------------------------------------------


def sse_events(response: Mapping[str, Any], *, include_usage: bool) -> Iterator[bytes]:
    """A complete (non-streamed) response re-cut as OpenAI stream chunks, ending with ``[DONE]``."""
    chat = response.get("object") == "chat.completion"
    base = {k: response[k] for k in ("id", "created", "model") if k in response}
    base["object"] = "chat.completion.chunk" if chat else "text_completion"
    for choice in response.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if chat:
            message = choice.get("message") or {}
            delta = {"role": "assistant", **{k: v for k, v in message.items() if k in _DELTA_FIELDS and v is not None}}
            out: Body = {"index": choice.get("index", 0), "delta": delta}
        else:
            out = {"index": choice.get("index", 0), "text": choice.get("text", "")}
        out["logprobs"] = choice.get("logprobs")
        out["finish_reason"] = choice.get("finish_reason")
        for extra in ("stop_reason", "token_ids"):
            if extra in choice:
                out[extra] = choice[extra]
        yield _sse({**base, "choices": [out]})
    if include_usage and response.get("usage") is not None:
        yield _sse({**base, "choices": [], "usage": response["usage"]})
    yield b"data: [DONE]\n\n"


_DELTA_FIELDS = ("content", "reasoning_content", "tool_calls", "refusal")


def _sse(chunk: Mapping[str, Any]) -> bytes:
    return b"data: " + wire_json.dumps(chunk) + b"\n\n"
