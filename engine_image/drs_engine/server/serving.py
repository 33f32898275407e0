"""``POST /v1/chat/completions`` and ``POST /v1/completions``, top to bottom.

1. refuse while asleep (503); read the body under the size cap (413); parse JSON and validate it
   as strictly as TensorRT-LLM (400 naming the field);
2. prompt ids: ``prompt_token_ids_b64`` (int32-LE base64), else ``prompt_token_ids``, else render
   the chat template and tokenize (:func:`drs_protocol.chat.render_prompt_ids`, the function the
   frontend uses too) or tokenize the completion prompt; check the model length (400
   ``context length exceeded: …``);
3. the leg: its request type, ``ctx_request_id`` (the ``disagg_request_id`` when given, as
   TensorRT-LLM does, else an engine-local id), the conversation id;
4. wait for a batch slot, run the backend, and answer: one JSON body, or SSE chunks in the OpenAI
   shape ending in ``data: [DONE]``; a client that disconnects stops its leg either way. A generation leg's first event (the KV fetch) is awaited
   before the stream starts, so a missing context state is still a 4xx, not a broken stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from drs_protocol import fields, lifecycle
from drs_protocol.body import parse_json_object, read_body
from drs_protocol.chat import ChatTemplateError, decode_token_ids, render_completion_ids, render_prompt_ids, token_text
from drs_protocol.cutover import BadTurnStamp, format_stamp, parse_stamp
from drs_protocol.token_ids import TokenIdsError, decode_token_ids_b64
from drs_protocol.token_prefix import (
    DIVERGENT_LOG,
    PrefixOutcome,
    TokenPrefixError,
    find_prefix,
    render_spliced_ids,
)
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from drs_engine.backends.base import LegEvent, LegFinished, LegRequest, TokenStep
from drs_engine.errors import BadRequestError, ContextLengthError, EngineError, retry_headers
from drs_engine.prefill_work import InFlight
from drs_engine.server import responses
from drs_engine.server.body import check_token_ids, validate
from drs_engine.server.detok import IncrementalDetokenizer
from drs_engine.server.prefix_held import follow, leg_ended, leg_started
from drs_engine.server.readahead import ReadAhead
from drs_engine.server.state import EngineState
from drs_engine.wire import ChatCompletionRequest, CompletionRequest, EngineRequest, RequestType

log = logging.getLogger(__name__)
SSE_DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


async def serve(state: EngineState, request: Request, *, chat: bool) -> Response:
    leg_label = "unknown"
    try:
        stamp = turn_stamp(state, request)
        state.check_serving()
        backend = state.require_backend()
        straddles = state.check_weights_target(backend, stamp)
        body = await read_body(request, state.config.request_bytes_limit())
        data = parse_json_object(body)
        req: EngineRequest = validate(ChatCompletionRequest, data) if chat else validate(CompletionRequest, data)
        leg_label = req.request_type().value
        check_supported(req)
        prompt = await resolve_prompt_ids(state, req)
        stops = await asyncio.to_thread(stop_sequences, state, req) if req.stop else ()
        leg = build_leg(state, req, prompt, data, request, stops)
        prefill = (
            None
            if leg.request_type is RequestType.GENERATION_ONLY
            else leg_started(state, backend, prompt, context_only=leg.request_type is RequestType.CONTEXT_ONLY)
        )
        admission = state.require_admission()
        try:
            await follow(prefill)
            await admission.acquire()
        except BaseException:
            leg_ended(state, prefill, None)
            raise
        try:
            weights_version = backend.weights_version  # the generator snapshots the same weights
            events = backend.generate(leg)
            first = await anext(events)
        except BaseException:
            admission.release()
            leg_ended(state, prefill, None)
            raise
    except EngineError as exc:
        if state.metrics is not None:
            state.metrics.requests.labels(leg=leg_label, status="error").inc()
        return JSONResponse(exc.to_body(), status_code=exc.status, headers=retry_headers(exc))

    meta = responses.ResponseMeta.new(
        state.config.served_model_name(), chat=chat, strict=state.config.strict_trtllm_responses
    )
    headers = {fields.HEADER_WEIGHTS_VERSION: weights_version, fields.HEADER_TURN_STARTED: format_stamp(stamp)}
    if leg.streaming:
        return StreamingResponse(
            _stream(state, leg, meta, first, events, Started(weights_version, stamp, straddles, prefill)),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", **headers},
        )
    ended: LegFinished | None = None
    try:
        steps, finished = await _unless_client_leaves(request, _collect(first, events))
        ended = finished
    except EngineError as exc:
        state.require_metrics().requests.labels(leg=leg_label, status="error").inc()
        return JSONResponse(exc.to_body(), status_code=exc.status, headers=headers)
    except ClientDisconnected:
        state.require_metrics().requests.labels(leg=leg_label, status="disconnected").inc()
        return Response(status_code=499)  # nobody reads it; uvicorn drops it
    finally:
        await events.aclose()
        admission.release()
        leg_ended(state, prefill, ended)
    _record(state, leg, finished, len(steps))
    text = decode_token_ids(state.tokenizer, [s.token_id for s in steps], skip_special_tokens=req.skip_special_tokens)
    answer = _full_body(state, leg, meta, text, steps, finished)
    versions = weights_fields(finished, weights_version, straddles=straddles)
    _answered(state, stamp, versions)
    if not meta.strict:  # strictTrtllmResponses: the version travels in the header only
        answer.update(versions)
    headers[fields.HEADER_WEIGHTS_VERSION] = versions[lifecycle.FIELD_WEIGHTS_VERSION]
    return JSONResponse(answer, headers=headers)


@dataclass(frozen=True, slots=True)
class Started:
    """How a leg was admitted: the weights it started with, its turn's stamp, and whether it
    straddles a refit (stamped before the target's cut-over, admitted at the target)."""

    weights_version: str
    stamp: float
    straddles: bool
    prefill: InFlight | None = None  #: the leg's place among those prefilling here (not generation-only)


def turn_stamp(state: EngineState, request: Request) -> float:
    """The instant the leg's turn started: the frontend's :data:`~drs_protocol.fields.HEADER_TURN_STARTED`
    (400 naming the header when it is not an epoch-seconds number), else now (a direct call)."""
    value = request.headers.get(fields.HEADER_TURN_STARTED)
    if value is None:
        return state.target.wall()
    try:
        return parse_stamp(value)
    except BadTurnStamp as exc:
        raise BadRequestError(str(exc), param=fields.HEADER_TURN_STARTED) from None


def weights_fields(finished: LegFinished, started_with: str, *, straddles: bool = False) -> dict[str, Any]:
    """The response fields naming the weights version of the tokens (and the switch, if any: a leg
    that straddles the refit's cut-over is marked at 0 tokens when the backend saw no switch)."""
    out: dict[str, Any] = {lifecycle.FIELD_WEIGHTS_VERSION: finished.weights_version or started_with}
    if finished.weights_boundary is not None:
        out[lifecycle.FIELD_WEIGHTS_BOUNDARY] = finished.weights_boundary
    elif straddles:
        out[lifecycle.FIELD_WEIGHTS_BOUNDARY] = 0
    return out


def _answered(state: EngineState, stamp: float, versions: dict[str, Any]) -> None:
    if lifecycle.FIELD_WEIGHTS_BOUNDARY not in versions:
        state.leg_answered(state.require_backend(), stamp, versions[lifecycle.FIELD_WEIGHTS_VERSION])


def check_supported(req: EngineRequest) -> None:
    """Refuse what this engine does not do rather than silently doing something else."""
    if req.n != 1:
        raise BadRequestError("n > 1 is not supported by this engine", param="n")
    if req.request_type() is RequestType.CONTEXT_ONLY and req.stream:
        raise BadRequestError("a context_only request cannot stream (send stream: false)", param="stream")
    if isinstance(req, CompletionRequest) and req.echo:
        raise BadRequestError("echo is not supported by this engine", param="echo")
    if isinstance(req, ChatCompletionRequest):
        if req.chat_template is not None:
            raise BadRequestError("chat_template cannot be supplied per request", param="chat_template")
        if req.documents:
            raise BadRequestError("documents are not supported by this engine", param="documents")


async def resolve_prompt_ids(state: EngineState, req: EngineRequest) -> list[int]:
    """The prompt as token ids: given ids win (no template is applied), else render + tokenize."""
    if req.prompt_token_ids_b64 is not None:
        try:
            ids = decode_token_ids_b64(req.prompt_token_ids_b64, "prompt_token_ids_b64")
        except TokenIdsError as exc:
            raise BadRequestError(str(exc), param="prompt_token_ids_b64") from exc
        field = "prompt_token_ids_b64"
    elif req.prompt_token_ids is not None:
        ids, field = list(req.prompt_token_ids), "prompt_token_ids"
    elif isinstance(req, ChatCompletionRequest):
        if not req.messages:
            raise BadRequestError("messages: at least one message is required", param="messages")
        try:
            ids = await asyncio.to_thread(render_chat_ids, state, req)
        except ChatTemplateError as exc:
            raise BadRequestError(str(exc), param="messages") from exc
        except TokenPrefixError as exc:
            raise BadRequestError(exc.message, param=exc.param) from exc
        field = "messages"
    elif isinstance(req.prompt, str):
        ids = await asyncio.to_thread(
            render_completion_ids, state.tokenizer, req.prompt, add_special_tokens=req.add_special_tokens
        )
        field = "prompt"
    elif isinstance(req.prompt, list):
        ids, field = list(req.prompt), "prompt"
    else:
        raise BadRequestError("prompt: required (a string or a list of token ids)", param="prompt")
    check_prompt(state, ids, field)
    return ids


def render_chat_ids(state: EngineState, req: ChatCompletionRequest) -> list[int]:
    """Render + tokenize the chat template; spliced after the policy's own ids when the request
    carries them (``required_prefix_token_ids`` or Gym's ids on the last assistant message), the
    same splice the frontend does when it tokenizes (:mod:`drs_protocol.token_prefix`)."""
    tokenizer = state.tokenizer
    eos = tokenizer.eos_token_id
    prefix = find_prefix(
        req.required_prefix_token_ids,
        req.messages,
        vocab_size=len(tokenizer),
        eos_id=eos if isinstance(eos, int) else -1,
    )
    kwargs: dict[str, Any] = {
        "tools": req.tools,
        "chat_template_kwargs": req.chat_template_kwargs,
        "add_generation_prompt": req.add_generation_prompt,
    }
    if prefix is None:
        return render_prompt_ids(tokenizer, req.messages, **kwargs)
    spliced = render_spliced_ids(tokenizer, req.messages, prefix, **kwargs)
    if state.metrics is not None:
        state.metrics.token_prefix.labels(outcome=spliced.outcome.value).inc()
    if spliced.outcome is PrefixOutcome.DIVERGENT:
        log.warning(
            "%s (%s): the prefix holds %d end-of-turn tokens before its last, the history %d; spliced all the same",
            DIVERGENT_LOG,
            prefix.param,
            spliced.prefix_eos,
            spliced.history_eos - 1,
        )
    return spliced.ids.tolist()


def check_prompt(state: EngineState, ids: list[int], field: str) -> None:
    if not ids:
        raise BadRequestError(f"{field}: the prompt is empty", param=field)
    check_token_ids(ids, len(state.tokenizer), field)
    limit = state.config.model.max_model_len
    if len(ids) >= limit:
        raise ContextLengthError(
            f"context length exceeded: the prompt has {len(ids)} tokens, the model's maximum length is {limit} "
            "(prompt plus at least one generated token)",
            param=field,
        )


def stop_sequences(state: EngineState, req: EngineRequest) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``stop``'s non-empty strings with their token ids (a worker thread's job: up to
    ``wire.MAX_STOP_STRINGS`` of them to tokenize)."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    encode = state.tokenizer.encode
    return tuple((text, tuple(int(t) for t in encode(text, add_special_tokens=False))) for text in stops if text)


def build_leg(
    state: EngineState,
    req: EngineRequest,
    prompt: list[int],
    data: dict[str, Any],
    request: Request,
    stops: tuple[tuple[str, tuple[int, ...]], ...],
) -> LegRequest:
    request_type = req.request_type()
    room = state.config.model.max_model_len - len(prompt)
    requested = req.requested_max_tokens()
    max_tokens = room if requested is None else min(requested, room)
    ctx_request_id = None
    if request_type is RequestType.CONTEXT_ONLY:
        dp = req.disaggregated_params
        given = dp.disagg_request_id if dp is not None else None
        ctx_request_id = given if given is not None else state.next_local_ctx_request_id()
    conversation_id = req.conversation_id() or fields.conversation_id_from(data, request.headers)
    return LegRequest(
        request_type=request_type,
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        request=req,
        logprobs=req.wants_logprobs(),
        top_logprobs=req.top_logprobs_count(),
        conversation_id=conversation_id,
        streaming=bool(req.stream),
        ctx_request_id=ctx_request_id,
        stop_sequences=stops,
    )


class ClientDisconnected(Exception):
    """The client of a non-streaming leg went away before its answer was ready."""


async def _unless_client_leaves(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``await work``, cancelled as soon as the client disconnects (then :class:`ClientDisconnected`).

    A streaming leg stops when its client leaves (the response body is cancelled); a non-streaming
    one would otherwise run to its end for nobody, holding a batch slot, as TensorRT-LLM's server
    aborts it too. The body is already read, so the next ASGI message is ``http.disconnect``."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait((task,))
    raise ClientDisconnected


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(first: LegEvent, events: AsyncIterator[LegEvent]) -> tuple[list[TokenStep], LegFinished]:
    steps: list[TokenStep] = []
    event = first
    while True:
        if isinstance(event, LegFinished):
            return steps, event
        steps.append(event)
        event = await anext(events)


def _record(state: EngineState, leg: LegRequest, finished: LegFinished, generated: int) -> None:
    metrics = state.require_metrics()
    label = leg.request_type.value
    metrics.requests.labels(leg=label, status="ok").inc()
    metrics.prompt_tokens.labels(leg=label).inc(finished.prompt_tokens)
    metrics.generation_tokens.labels(leg=label).inc(generated)
    if finished.prefix_query_tokens:
        metrics.prefix_query_tokens.inc(finished.prefix_query_tokens)
        metrics.prefix_hit_tokens.inc(finished.cached_tokens)


def _full_body(
    state: EngineState,
    leg: LegRequest,
    meta: responses.ResponseMeta,
    text: str,
    steps: list[TokenStep],
    finished: LegFinished,
) -> dict[str, Any]:
    dp = leg.request.disaggregated_params
    disagg = None
    as_b64 = False
    if leg.request_type is RequestType.CONTEXT_ONLY and finished.handoff is not None:
        disagg = responses.disaggregated_params_out(dp, finished.handoff)
        as_b64 = dp is not None and dp.return_prompt_token_ids_b64
    return responses.full_response(
        meta,
        text=text,
        steps=steps,
        finished=finished,
        logprobs=leg.logprobs,
        top_logprobs=leg.top_logprobs,
        token_text=_logprob_token_text(state, leg),
        prompt_token_ids=leg.prompt_token_ids,
        prompt_ids_b64=as_b64,
        disaggregated_params=disagg,
    )


def _logprob_token_text(state: EngineState, leg: LegRequest) -> responses.TokenText:
    tokenizer = state.tokenizer
    return responses.token_texts(
        lambda tid: token_text(tokenizer, tid), as_token_ids=leg.request.return_tokens_as_token_ids
    )


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _stream(
    state: EngineState,
    leg: LegRequest,
    meta: responses.ResponseMeta,
    first: LegEvent,
    events: AsyncGenerator[LegEvent, None],
    started: Started,
) -> AsyncIterator[bytes]:
    tokenizer = state.tokenizer
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=leg.request.skip_special_tokens)
    stream_options = leg.request.stream_options
    include_usage = bool(stream_options and stream_options.include_usage)
    common: dict[str, Any] = {
        "logprobs": leg.logprobs,
        "top_logprobs": leg.top_logprobs,
        "token_text": _logprob_token_text(state, leg),
    }
    admission = state.require_admission()
    generated = 0
    ended: LegFinished | None = None
    # One chunk per token, or (a backend that opts in) every token that arrived since the last send.
    ahead = ReadAhead(events) if state.require_backend().stream_runs else None
    try:
        if meta.chat:
            yield _sse(responses.stream_chunk(meta, text="", steps=[], role=True, **common))
        run: list[LegEvent] = [first]
        while not isinstance(run[-1], LegFinished):
            steps = [e for e in run if isinstance(e, TokenStep)]
            generated += len(steps)
            text = detok.push([s.token_id for s in steps])
            yield _sse(responses.stream_chunk(meta, text=text, steps=steps, **common))
            run = await ahead.next_run() if ahead is not None else [await anext(events)]
        steps = [e for e in run if isinstance(e, TokenStep)]
        if steps:
            generated += len(steps)
            yield _sse(
                responses.stream_chunk(meta, text=detok.push([s.token_id for s in steps]), steps=steps, **common)
            )
        finished = run[-1]
        ended = finished if isinstance(finished, LegFinished) else None
        last = responses.stream_chunk(
            meta,
            text=detok.flush(),
            steps=[],
            finish_reason=finished.finish_reason,
            stop_reason=finished.stop_reason,
            **common,
        )
        versions = weights_fields(finished, started.weights_version, straddles=started.straddles)
        _answered(state, started.stamp, versions)
        if not meta.strict:
            last.update(versions)
        yield _sse(last)
        if include_usage:
            yield _sse(responses.usage_chunk(meta, finished, generated))
        _record(state, leg, finished, generated)
        yield SSE_DONE
    except EngineError as exc:
        state.require_metrics().requests.labels(leg=leg.request_type.value, status="error").inc()
        yield _sse(exc.to_body())
        yield SSE_DONE
    finally:
        if ahead is not None:
            await ahead.close()
        await events.aclose()
        admission.release()
        leg_ended(state, started.prefill, ended)
