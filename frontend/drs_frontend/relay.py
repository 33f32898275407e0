"""One turn, top to bottom: PROTOCOL.md section 2's legs after the frontend's own parsing and tokenization.

:meth:`Relay.handle` takes the client's body and headers and returns a :class:`Reply`; the steps
are numbered here as in the code:

1. parse the body (Gym's id arrays left as JSON text when this frontend tokenizes), strip the
   Gym-only fields, find the conversation id;
2. with ``tokenize`` on, render the chat template and tokenize (incrementally per conversation,
   spliced after the policy's own ids with ``tokenContinuity``);
3. mint the snowflake ``disagg_request_id`` with this frontend's node id;
4. a first turn whose group's first turn (the same opening) is in its context leg here waits for
   it (:mod:`.bursts`); on a routing miss (neither the conversation nor its opening known here)
   ask the engines the ctx router names what they hold of the opening (:mod:`.lookup`); pick a
   prefill engine (ctx router) and send the context leg, retrying on another prefill engine when
   one is unreachable;
5. if the context leg finished the turn, answer with it (as SSE if the client streams);
6. else pick a decode engine (gen router, never the prefill engine's address) and send the
   generation leg, streamed through when the client streams;
7. copy token ids and log-probs where NeMo-Gym reads them.

A decode engine that answers that the context state is gone (404, 502) makes the turn run steps
3 to 7 again, with a fresh request id, at most ``contextReruns`` times.

Every answer after routing carries ``x-drs-prefill`` / ``x-drs-decode``. Engine 4xx/5xx answers
pass through verbatim; an engine that refuses or times out is put in a cool-down and the leg
moves to another engine of the same role (at most ``max_attempts`` engines, never one twice);
with none left the answer is 503 naming the role. Cancelling :meth:`Relay.handle` (the client
went away) cancels the engine call in flight, which closes its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from array import array
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from drs_protocol import fields, lifecycle
from drs_protocol.chat import ChatTemplateError, render_completion_ids
from drs_protocol.cutover import format_stamp
from drs_protocol.enums import Role
from drs_protocol.errors import error_body
from drs_protocol.limits import FORWARD_OVERHEAD_BYTES, token_ids_b64_bytes
from drs_protocol.routes import Endpoint
from drs_protocol.snowflake import SnowflakeMinter
from drs_protocol.token_ids import encode_token_ids_b64
from drs_protocol.token_prefix import DIVERGENT_LOG, PREFIX_FIELD, PrefixOutcome, Spliced, TokenPrefix, TokenPrefixError

from drs_frontend import gym_ids, wire_json
from drs_frontend.bursts import GroupBursts, Member
from drs_frontend.config import FrontendConfig
from drs_frontend.engines import EnginePool
from drs_frontend.errors import (
    EngineRefusedCredential,
    EngineRejected,
    ForwardTooLarge,
    NoEngineAvailable,
    RequestError,
    UpstreamProtocolError,
    UpstreamUnavailable,
)
from drs_frontend.legs import LegAttempts, Refused
from drs_frontend.lookup import PrefixLookup
from drs_frontend.metrics import FrontendMetrics
from drs_frontend.reply import Reply
from drs_frontend.routing import Candidate, Decision, RouteRequest, build_ctx_router, build_gen_router
from drs_frontend.routing.groups import is_first_turn, opening_of
from drs_frontend.shaping import (
    Body,
    build_context_request,
    build_generation_request,
    check_context_response,
    engine_token_prefix,
    finished_context_response,
    for_engines,
    parse_request,
    parse_response,
    prompt_ids_of,
    shape_response,
    sse_events,
    strip_client_fields,
    wants_stream,
)
from drs_frontend.tokenization import ChatTokenizer, Path
from drs_frontend.upstream import UpstreamClient, UpstreamResponse, UpstreamStream

log = logging.getLogger(__name__)

JSON: Final = "application/json"
SSE: Final = "text/event-stream"
#: Chat-request fields that mean the engine must render the prompt itself.
ENGINE_RENDERS: Final = ("prompt_token_ids", "prompt_token_ids_b64", "chat_template", "documents")
#: Generation-leg answers that mean "the context state is gone" (404: expired or never there;
#: 502: its prefill engine could not be reached): the turn re-runs its context leg.
RERUN_STATUSES: Final = (404, 502)


@dataclass(slots=True)
class _Turn:
    """Which engines served this turn so far (for the headers of every answer, errors included)."""

    prefill: str | None = None
    decode: str | None = None
    routed: bool = False
    ids: array[int] | None = field(default=None)
    burst: Member | None = None  #: a first turn's place among its group's first turns here
    #: the instant this frontend received the turn (wall clock), once per turn: both legs carry it
    #: (:data:`~drs_protocol.fields.HEADER_TURN_STARTED`), re-runs included (drs_protocol.cutover)
    stamp: Mapping[str, str] = field(default_factory=lambda: {fields.HEADER_TURN_STARTED: format_stamp(time.time())})


dumps: Final = wire_json.dumps


def ids_overflow(raw_bytes: int, ids: int, limit: int) -> bool:
    """Whether a body of ``raw_bytes`` forwarded with ``ids`` prompt ids may exceed ``limit`` (an
    upper bound: the client's bytes, the base64 ids and every field a frontend adds). With the
    limit the operator renders (drs_protocol.limits.engine_max_request_bytes) this is never true
    for a body this frontend accepts whose prompt is shorter than the engines' maxModelLen."""
    return raw_bytes + token_ids_b64_bytes(ids) + FORWARD_OVERHEAD_BYTES > limit


class Relay:
    """The request path of one frontend; owns the pools, routers, tokenizer and upstream client."""

    def __init__(
        self,
        config: FrontendConfig,
        *,
        upstream: UpstreamClient,
        metrics: FrontendMetrics,
        chat_tokenizer: ChatTokenizer | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.upstream = upstream
        self.metrics = metrics
        self.chat_tokenizer = chat_tokenizer
        self.prefill = EnginePool(
            Role.PREFILL, config.prefill, cooldown=config.engine_cooldown, clock=clock, fallback=config.fallback_prefill
        )
        self.decode = EnginePool(
            Role.DECODE, config.decode, cooldown=config.engine_cooldown, clock=clock, fallback=config.fallback_decode
        )
        self.ctx_router = build_ctx_router(config)
        self.gen_router = build_gen_router(config.gen_router)
        self.minter = SnowflakeMinter(config.node_id, config.process_id)
        self.bursts = GroupBursts(metrics, max_bursts=config.max_sessions)
        self._rng = rng or random.Random()
        self.legs = LegAttempts(config, metrics)
        self.lookup = PrefixLookup(upstream, metrics, timeout=config.timeouts.prefix_lookup)

    # -- the turn --------------------------------------------------------------------------------

    async def handle(self, endpoint: Endpoint, raw: bytes, headers: Mapping[str, str]) -> Reply:
        """Serve one client request; never raises for anything the client or an engine did."""
        turn = _Turn()
        try:
            reply = await self._turn(endpoint, raw, headers, turn)
        except EngineRejected as exc:
            reply = Reply(exc.status, exc.content_type or JSON, exc.body)
            if exc.role == self.prefill.role:
                turn.prefill = exc.url
            else:
                turn.decode = exc.url
        except (
            RequestError,
            ForwardTooLarge,
            NoEngineAvailable,
            UpstreamProtocolError,
            EngineRefusedCredential,
        ) as exc:
            if isinstance(exc, UpstreamProtocolError):
                log.warning("engine broke the protocol: %s", exc)
            reply = Reply(exc.status, JSON, dumps(exc.to_body()))
        finally:
            if turn.burst is not None:
                turn.burst.leave()
        reply.prefill = reply.prefill or turn.prefill
        reply.decode = reply.decode or turn.decode
        reply.routed = turn.routed
        reply.turn_started = turn.stamp[fields.HEADER_TURN_STARTED]
        self.metrics.requests_of(endpoint.value, str(reply.status)).inc()
        return reply

    async def _turn(self, endpoint: Endpoint, raw: bytes, headers: Mapping[str, str], turn: _Turn) -> Reply:
        # 1. the client's request (Gym's id arrays left unparsed when this frontend tokenizes)
        skips_ids = self.chat_tokenizer is not None and self.config.tokenize
        request = parse_request(raw, endpoint, skip_gym_ids=skips_ids)
        body = strip_client_fields(request)
        conversation_id = fields.conversation_id_from(body, headers)
        # 2. the prompt ids, when this frontend tokenizes (spliced after the policy's own ids)
        turn.ids = self._prompt_ids(endpoint, body, conversation_id, request.get(PREFIX_FIELD))
        if turn.ids is not None and ids_overflow(len(raw), len(turn.ids), self.config.limits.forward_limit()):
            # Our ids would push the body past the engines' limit: only a prompt longer than they
            # serve does that. Left to the engine, which renders it and answers its own 400.
            turn.ids = None
            self.metrics.ids_left_to_engine.inc()
        if endpoint is Endpoint.CHAT:  # Gym's ids of earlier turns only to an engine that splices
            tokenized = turn.ids is not None
            if not tokenized and skips_ids and gym_ids.skipped(request):  # the engine renders after all
                request = parse_request(raw, endpoint)
                body = strip_client_fields(request)
            body = engine_token_prefix(request, body, tokenized=tokenized, continuity=self.config.token_continuity)
        route = self._route_request(endpoint, body, conversation_id, turn.ids)
        turn.routed = True
        opening = route.opening  # a first turn's (group routing on): siblings wait for the first one
        if opening is not None and opening.first_turn:
            turn.burst = await self.bursts.join(opening.key, self.config.group_hold_seconds)
        reruns = 0
        while True:
            try:
                return await self._legs(endpoint, body, conversation_id, route, turn)
            except EngineRejected as exc:
                # The decode engine could not get the context state (its prefill engine stopped,
                # or the state expired): the turn is not lost, its context leg runs again.
                if exc.role != self.decode.role or exc.status not in RERUN_STATUSES:
                    raise
                if reruns >= self.config.context_reruns:
                    raise
                reruns += 1
                self.metrics.retries_of("context_rerun").inc()
                log.warning(
                    "decode engine %s lost the context state (%d); re-running the context leg", exc.url, exc.status
                )

    async def _legs(
        self, endpoint: Endpoint, body: Body, conversation_id: str | None, route: RouteRequest, turn: _Turn
    ) -> Reply:
        # 3. the request id (a fresh one for a re-run: the context state is keyed by it)
        request_id = self.minter.next_id()
        # 4. the context leg (asking the engines first where the ctx router does not know the group)
        if self.ctx_router.looks_up:  # off (the default before 2026-12-05): nothing built, nobody asked
            targets = self.ctx_router.lookup_targets(route, [c.url for c in self.prefill.candidates(frozenset())])
            if targets:  # what they hold, then a new group's placement claimed (:mod:`.lookup`)
                route = await self.lookup.place(self.ctx_router, route, targets)
        ctx_body = build_context_request(
            body,
            disagg_request_id=request_id,
            conversation_id=conversation_id,
            tokids_ctxbytes=self.config.gen_tokids_ctxbytes,
            prompt_token_ids_b64=encode_token_ids_b64(turn.ids) if turn.ids is not None else None,
        )
        turn.prefill, ctx_raw = await self._post_leg(
            self.prefill,
            "context",
            endpoint,
            for_engines("context", ctx_body, self.config.limits.forward_limit()),
            self.config.timeouts.context,
            lambda candidates: self.ctx_router.pick(route, candidates),
            affinity=conversation_id is not None,
            headers=turn.stamp,
        )
        if turn.burst is not None:
            turn.burst.context_done()
        ctx = parse_response(ctx_raw.body, "context")
        self._count_prefill(turn.prefill, ctx)
        # 5. finished already?
        if check_context_response(ctx):
            answer = self._shape(finished_context_response(ctx), turn)
            if wants_stream(body):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return Reply(200, SSE, stream=_iterate(sse_events(answer, include_usage=include_usage)))
            return Reply(200, JSON, dumps(answer), weights_version=ctx_raw.weights_version or _weights_version(ctx))
        # 6. the generation leg
        gen_body = build_generation_request(
            body, ctx, endpoint=endpoint, strip_history=self.config.gen_strip_message_history
        )
        exclude = frozenset({turn.prefill})
        if wants_stream(body):
            return await self._stream_generation(
                endpoint, for_engines("generation", gen_body, self.config.limits.forward_limit()), exclude, turn
            )
        turn.decode, gen_raw = await self._post_leg(
            self.decode,
            "generation",
            endpoint,
            for_engines("generation", gen_body, self.config.limits.forward_limit()),
            self.config.timeouts.generation,
            self.gen_router.pick,
            exclude=exclude,
            headers=turn.stamp,
        )
        # 7. the answer, with ids where Gym reads them
        gen = parse_response(gen_raw.body, "generation")
        version = gen_raw.weights_version or _weights_version(gen)
        return Reply(200, JSON, dumps(self._shape(gen, turn)), weights_version=version)

    # -- step 2: tokenization --------------------------------------------------------------------

    def _prompt_ids(
        self, endpoint: Endpoint, body: Body, conversation_id: str | None, required_prefix: Any
    ) -> array[int] | None:
        chat = self.chat_tokenizer
        if chat is None or not self.config.tokenize:
            return None
        started = time.perf_counter()
        try:
            if endpoint is Endpoint.CHAT:
                if any(name in body for name in ENGINE_RENDERS) or body.get("add_special_tokens"):
                    return None
                shadow = self._rng.random() < self.config.tokenize_shadow_rate
                continuity = self.config.token_continuity
                prefix = chat.find_prefix(required_prefix, body["messages"], conversation_id) if continuity else None
                result = chat.prompt_ids(
                    conversation_id,
                    body["messages"],
                    tools=body.get("tools"),
                    chat_template_kwargs=body.get("chat_template_kwargs"),
                    add_generation_prompt=body.get("add_generation_prompt", True) is not False,
                    prefix=prefix,
                    shadow=shadow,
                )
                if result.spliced is not None and prefix is not None:
                    self._count_prefix(result.spliced, prefix, conversation_id)
                if result.shadowed:
                    mismatch = result.path is Path.SHADOW_MISMATCH
                    self.metrics.tokenize_shadow.labels(result="mismatch" if mismatch else "match").inc()
                path, ids, new = result.path.value, result.ids, result.new_ids
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str) or "prompt_token_ids" in body:
                    return None
                add_special = body.get("add_special_tokens", True) is not False
                ids = array("i", render_completion_ids(chat.tokenizer, prompt, add_special_tokens=add_special))
                path, new = "completion", len(ids)
        except ChatTemplateError as exc:
            raise RequestError(str(exc), param="messages") from None
        except TokenPrefixError as exc:
            raise RequestError(exc.message, param=exc.param) from None
        except Exception:  # a tokenizer failure is no reason to fail the turn: the engine tokenizes
            log.exception("frontend tokenization failed; leaving it to the engine")
            self.metrics.tokenize_errors.inc()
            return None
        self.metrics.tokenize_seconds_of(path).observe(time.perf_counter() - started)
        self.metrics.tokenize_new_tokens_of(path).inc(new)
        return ids

    def _count_prefix(self, spliced: Spliced, prefix: TokenPrefix, conversation_id: str | None) -> None:
        self.metrics.token_prefix_of(spliced.outcome.value).inc()
        text = prefix.text
        how = "parsed" if text is None else "after_last_turn" if text.reused else "whole_text"
        self.metrics.token_prefix_read_of(how).inc()
        if spliced.outcome is PrefixOutcome.DIVERGENT:
            log.warning(
                "%s (conversation %s): the prefix holds %d end-of-turn tokens before its last, the history %d; "
                "spliced all the same, as NeMo RL does",
                DIVERGENT_LOG,
                conversation_id,
                spliced.prefix_eos,
                spliced.history_eos - 1,
            )

    def _route_request(
        self, endpoint: Endpoint, body: Body, conversation_id: str | None, ids: array[int] | None
    ) -> RouteRequest:
        if endpoint is Endpoint.CHAT:
            messages, tools = body["messages"], body.get("tools")
            # a first turn's opening now (the hold needs it); a later turn's only if the router asks
            first = self.config.group_routing and is_first_turn(messages)
            opening = opening_of(messages, tools) if first else None
            return RouteRequest(conversation_id, ids, messages, tools=tools, opening=opening)
        if conversation_id is not None or ids is not None:
            return RouteRequest(conversation_id=conversation_id, prompt_ids=ids)
        prompt = body.get("prompt")
        return RouteRequest(prompt=prompt if isinstance(prompt, str) else None)

    def _count_prefill(self, url: str | None, ctx: Body) -> None:
        """Prompt tokens the prefill engine computed vs reused, as its context answer's usage says."""
        usage = ctx.get("usage")
        if url is None or not isinstance(usage, dict):
            return
        prompt = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(prompt, int):
            reused = cached if isinstance(cached, int) else 0
            self.metrics.prefill_tokens_of(url, "computed").inc(max(prompt - reused, 0))
            self.metrics.prefill_tokens_of(url, "reused").inc(max(reused, 0))

    # -- steps 4 and 6: one leg, with retries ----------------------------------------------------

    async def _post_leg(
        self,
        pool: EnginePool,
        leg: str,
        endpoint: Endpoint,
        body: bytes,
        timeout: float,
        pick: Callable[[list[Candidate]], Decision],
        *,
        exclude: frozenset[str] = frozenset(),
        affinity: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[str, UpstreamResponse]:
        histogram = self.metrics.leg_seconds_of(leg)

        async def post(decision: Decision) -> UpstreamResponse | Refused:
            url, cost = decision.url, decision.cost
            started = time.perf_counter()
            engine = pool.engines[url]
            engine.in_flight += 1  # pool.track(url), without a generator per call
            engine.pending += cost
            try:
                response = await self.upstream.post_json(url + endpoint.value, body, timeout, headers)
            finally:
                engine.in_flight -= 1
                engine.pending -= cost
                histogram.observe(time.perf_counter() - started)
            return response if response.status == 200 else Refused(response)

        return await self.legs.run(pool, pick, post, exclude=exclude, affinity=affinity)

    async def _stream_generation(self, endpoint: Endpoint, body: bytes, exclude: frozenset[str], turn: _Turn) -> Reply:
        pool = self.decode

        async def open_stream(decision: Decision) -> tuple[UpstreamStream, contextlib.AsyncExitStack] | Refused:
            url = decision.url
            stack = contextlib.AsyncExitStack()
            await stack.__aenter__()
            stack.enter_context(pool.track(url))
            try:
                stream = await stack.enter_async_context(
                    self.upstream.stream_json(url + endpoint.value, body, self.config.timeouts.generation, turn.stamp)
                )
                if stream.status != 200:
                    data = await stream.read()
            except BaseException:  # UpstreamUnavailable included: _retrying moves to the next engine
                await stack.aclose()
                raise
            if stream.status != 200:
                await stack.aclose()
                return Refused(UpstreamResponse(stream.status, stream.content_type, data))
            return stream, stack

        url, (stream, stack) = await self.legs.run(pool, self.gen_router.pick, open_stream, exclude=exclude)
        turn.decode = url
        return Reply(200, stream.content_type or SSE, stream=self._relay_stream(stream.chunks(), stack, url))

    async def _relay_stream(
        self, chunks: AsyncIterator[bytes], stack: contextlib.AsyncExitStack, url: str
    ) -> AsyncIterator[bytes]:
        started = time.perf_counter()
        try:
            async for chunk in chunks:
                yield chunk
        except UpstreamUnavailable as exc:
            self.metrics.upstream_errors.labels(role=Role.DECODE, kind=exc.kind).inc()
            log.warning("decode engine %s failed mid-stream: %s", url, exc)
            yield b"data: " + dumps(error_body(502, f"decode engine failed mid-stream: {exc}")) + b"\n\n"
        finally:
            self.metrics.leg_seconds_of("generation").observe(time.perf_counter() - started)
            await asyncio.shield(stack.aclose())

    # -- step 7 ----------------------------------------------------------------------------------

    def _shape(self, response: Body, turn: _Turn) -> Body:
        fallback: list[int] | None = None
        if turn.ids is not None and prompt_ids_of(response) is None:
            fallback = turn.ids.tolist()
        return shape_response(response, prompt_ids=fallback)


def _weights_version(body: Body) -> str | None:
    version = body.get(lifecycle.FIELD_WEIGHTS_VERSION)
    return version if isinstance(version, str) else None


async def _iterate(chunks: Sequence[bytes] | Any) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
