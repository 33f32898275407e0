"""The ``sim`` backend: a CPU test double for a TensorRT-LLM GPU engine.

It is a test and benchmark double, named as one everywhere (``server_info``, metrics labels). It
speaks the same protocol as the GPU engine and has the parts whose behaviour the rest of the
system depends on, each real rather than faked:

- a token function of (weights, prefix) (:mod:`.sim_model`), so a wrong KV handoff, a wrong
  prefix or stale weights show up as different tokens;
- a prefix cache of chained block hashes with LRU eviction (:mod:`drs_engine.prefix_cache`);
- a KV handoff: a context-only leg leaves its state in a bounded store
  (:mod:`drs_engine.kv_store`) under ``ctx_request_id``; the decode engine fetches it over HTTP
  from ``ctx_info_endpoint`` (``GET /v1/disagg/kv/{ctx_request_id}``) and continues from it;
- a latency model (:mod:`drs_engine.latency`): prefill time for uncached tokens only, decode
  steps slowing with batch size, all scaled by ``sim.speed``.

Sampling parameters (temperature, top_p, …) do not change the tokens: the double is greedy over a
hash. One ``context_and_generation`` call gives exactly the tokens of a context leg followed by a
generation leg on another engine with the same weights.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncGenerator
from typing import Any, ClassVar, Final

import httpx
from drs_protocol.control import CollectiveInit, CollectiveUpdate, PrepareRefitInfo
from drs_protocol.routes import CONTROL_ROUTES, ControlOp, kv_export_path

from drs_engine.backends.base import (
    ContextHandoff,
    EngineBackend,
    LegEvent,
    LegFinished,
    LegRequest,
    TokenStep,
    finish_after,
    restate_after_refit,
)
from drs_engine.backends.sim_model import PrefixState, TokenChoice, TokenFunction, block_hashes
from drs_engine.backends.sim_weights import SimWeights, digest_weights_path, hash_weights_path, initial_weights
from drs_engine.config import BackendName, EngineConfig
from drs_engine.errors import (
    BadRequestError,
    ContextMismatchError,
    ContextStateMissingError,
    KvTransferError,
    NotSupportedError,
)
from drs_engine.kv_store import ContextState, ContextStore
from drs_engine.latency import LatencyModel
from drs_engine.prefix_cache import PrefixCache
from drs_engine.wire import RequestType

#: Timeouts of the decode engine's KV fetch from a prefill engine.
KV_FETCH_TIMEOUT: Final = httpx.Timeout(connect=2.0, read=30.0, write=30.0, pool=5.0)
#: Idle connections expire before the peer's uvicorn keep-alive timeout (5 s) closes them, so a
#: fetch never goes out on a connection the prefill engine is closing.
KV_FETCH_LIMITS: Final = httpx.Limits(max_connections=64, max_keepalive_connections=32, keepalive_expiry=2.0)
#: A fetch that failed before the prefill engine answered (a closed idle connection) is sent once more.
KV_FETCH_RETRYABLE: Final = (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError)
#: Tags a release without tags covers.
ALL_MEMORY_TAGS: Final = ("model", "kv_cache")
OPAQUE_STATE_KIND: Final = "drs-sim-kv/1"


class SimBackend(EngineBackend):
    """The sim test double (see the module docstring)."""

    name: ClassVar[str] = BackendName.SIM
    test_double: ClassVar[bool] = True

    def __init__(self, config: EngineConfig, *, vocab_size: int, eos_token_id: int) -> None:
        spec = config.sim
        self._config = config
        self._vocab_size = spec.vocab_size or vocab_size
        self._eos_token_id = spec.eos_token_id if spec.eos_token_id is not None else eos_token_id
        self._weights = initial_weights(config.model.path, config.weights_version)
        self._cache = PrefixCache(tokens_per_block=spec.tokens_per_block, capacity_tokens=spec.cache_capacity_tokens)
        self._store: ContextStore[ContextState] = ContextStore(
            capacity=spec.kv_store_capacity, ttl_seconds=spec.kv_store_ttl_seconds
        )
        self._latency = LatencyModel.from_spec(spec)
        self._endpoint = config.resolved_advertise_url()
        self._client: httpx.AsyncClient | None = None
        self._decodes_in_flight = 0
        self._prefill_lock = asyncio.Lock()
        self._profile_started: float | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=KV_FETCH_TIMEOUT, limits=KV_FETCH_LIMITS)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def weights_version(self) -> str:
        return self._weights.version

    @property
    def tokens_per_block(self) -> int:
        return self._cache.tokens_per_block

    def server_info(self) -> dict[str, Any]:
        return {
            "kind": "test double",
            "vocab_size": self._vocab_size,
            "eos_token_id": self._eos_token_id,
            "speed": self._latency.speed,
            "prefix_cache_blocks": len(self._cache),
            "prefix_cache_capacity_blocks": self._cache.capacity_blocks,
            "context_states_held": len(self._store),
        }

    # ---- serving ---------------------------------------------------------------------------

    def _token_function(self, weights: SimWeights) -> TokenFunction:
        return TokenFunction(
            weights.seed,
            vocab_size=self._vocab_size,
            eos_token_id=self._eos_token_id,
            eos_probability=self._config.sim.eos_probability,
            tokens_per_block=self._cache.tokens_per_block,
        )

    async def generate(self, leg: LegRequest) -> AsyncGenerator[LegEvent, None]:
        weights = self._weights  # the weights at the start; _decode re-prefills if a load lands mid-decode
        fn = self._token_function(weights)
        if leg.request_type is RequestType.GENERATION_ONLY:
            state, first, cached, ctx_version = await self._receive_context(leg, weights)
            if ctx_version != weights.version:  # the context was computed under other weights: redo it
                state, first = await self._reprefill(fn, list(leg.prompt_token_ids), leg, produced=0)
            async for event in self._decode(leg, weights, state, first, cached_tokens=cached, prefix_query_tokens=0):
                yield event
            return

        prompt = leg.prompt_token_ids
        hashes = block_hashes(fn.seed, prompt, fn.tokens_per_block)
        lookup = self._cache.lookup(len(prompt), hashes)
        await self._prefill_compute(len(prompt) - lookup.hit_tokens)
        self._cache.insert(hashes)
        state = fn.start(prompt, hashes)
        first = fn.next_token(state, top_logprobs=leg.top_logprobs, allow_eos=_eos_allowed(leg, 0))

        if leg.request_type is RequestType.CONTEXT_AND_GENERATION:
            async for event in self._decode(
                leg, weights, state, first, cached_tokens=lookup.hit_tokens, prefix_query_tokens=len(prompt)
            ):
                yield event
            return

        # context_only: prefill plus the first token, then leave the state for the decode engine.
        yield _step(first, leg)
        finish, stop_reason = self._finish_after(leg, [first.token_id])
        if finish == "stop":  # the turn ended on the prefill engine: nothing to hand over
            handoff = ContextHandoff(
                ctx_request_id=_ctx_request_id(leg), first_gen_tokens=[first.token_id], ctx_info_endpoint=self._endpoint
            )
        else:
            finish = finish or "not_finished"
            handoff = self._leave_context(leg, state, first, weights, cached_tokens=lookup.hit_tokens)
        yield LegFinished(
            finish_reason=finish,
            stop_reason=stop_reason,
            prompt_tokens=len(prompt),
            cached_tokens=lookup.hit_tokens,
            prefix_query_tokens=len(prompt),
            handoff=handoff,
            weights_version=weights.version,
        )

    async def _decode(
        self,
        leg: LegRequest,
        weights: SimWeights,
        state: PrefixState,
        first: TokenChoice,
        *,
        cached_tokens: int,
        prefix_query_tokens: int,
    ) -> AsyncGenerator[LegEvent, None]:
        """Decode until a stop. Refit safety: when the engine's weights change between two steps, the
        prompt plus every token generated so far is prefilled again under the new weights (the old
        KV is dropped) and decoding resumes from there, so every token after the switch comes from
        the new weights over the same context; ``weights_boundary`` says how many came before."""
        fn = self._token_function(weights)
        prompt_len = len(leg.prompt_token_ids)
        generated = [first.token_id]
        choice = first
        new_blocks: list[bytes] = []
        boundary: int | None = None
        self._decodes_in_flight += 1
        try:
            while True:
                yield _step(choice, leg)
                finish, stop_reason = self._finish_after(leg, generated)
                if finish is not None:
                    break
                closed = fn.advance(state, choice.token_id)
                if closed is not None:
                    new_blocks.append(closed)
                await self._latency.sleep(self._latency.decode_step_seconds(self._decodes_in_flight))
                if self._weights is not weights:
                    weights, fn = self._weights, self._token_function(self._weights)
                    ids, boundary = restate_after_refit(leg.prompt_token_ids, generated)
                    state = await self._restate(fn, ids)
                    new_blocks = []
                allow_eos = _eos_allowed(leg, len(generated))
                choice = fn.next_token(state, top_logprobs=leg.top_logprobs, allow_eos=allow_eos)
                generated.append(choice.token_id)
        finally:
            self._decodes_in_flight -= 1
        if leg.request_type is RequestType.CONTEXT_AND_GENERATION and boundary is None:
            self._cache.insert(new_blocks)  # generated blocks extend the cached prompt blocks
        yield LegFinished(
            finish_reason=finish,
            stop_reason=stop_reason,
            prompt_tokens=prompt_len,
            cached_tokens=cached_tokens,
            prefix_query_tokens=prefix_query_tokens,
            weights_version=weights.version,
            weights_boundary=boundary,
        )

    async def _restate(self, fn: TokenFunction, ids: list[int]) -> PrefixState:
        """A context leg over ``ids`` under ``fn``'s weights (prefill time for all of them)."""
        await self._prefill_compute(len(ids))
        return fn.start(ids)

    async def _reprefill(
        self, fn: TokenFunction, ids: list[int], leg: LegRequest, *, produced: int
    ) -> tuple[PrefixState, TokenChoice]:
        state = await self._restate(fn, ids)
        first = fn.next_token(state, top_logprobs=leg.top_logprobs, allow_eos=_eos_allowed(leg, produced))
        return state, first

    def _leave_context(
        self, leg: LegRequest, state: PrefixState, first: TokenChoice, weights: SimWeights, *, cached_tokens: int
    ) -> ContextHandoff:
        ctx_request_id = _ctx_request_id(leg)
        digest = state.digest()
        self._store.put(
            ContextState(
                ctx_request_id=ctx_request_id,
                prompt_token_ids=list(leg.prompt_token_ids),
                first_gen_token=first.token_id,
                first_gen_logprob=first.logprob,
                first_gen_top_logprobs=list(first.top_logprobs),
                chain_hex=state.chain.hex(),
                tail=list(state.tail),
                digest=digest,
                weights_version=weights.version,
                cached_tokens=cached_tokens,
            )
        )
        opaque = {
            "kind": OPAQUE_STATE_KIND,
            "digest": digest,
            "prompt_len": len(leg.prompt_token_ids),
            "weights_version": weights.version,
        }
        return ContextHandoff(
            ctx_request_id=ctx_request_id,
            first_gen_tokens=[first.token_id],
            encoded_opaque_state=base64.b64encode(json.dumps(opaque, sort_keys=True).encode()).decode("ascii"),
            first_gen_log_probs=[{"token_id": first.token_id, "logprob": first.logprob}] if leg.logprobs else None,
            ctx_dp_rank=0,
            ctx_info_endpoint=self._endpoint,
        )

    async def _prefill_compute(self, uncached_tokens: int) -> None:
        """Prefill takes time for uncached tokens only, and prefills share the engine: concurrent
        prompts queue behind each other, so prefill throughput (tokens/s) is bounded."""
        seconds = self._latency.prefill_seconds(uncached_tokens)
        if seconds <= 0:
            return
        async with self._prefill_lock:
            await self._latency.sleep(seconds)

    def _finish_after(self, leg: LegRequest, generated: list[int]) -> tuple[str | None, int | str | None]:
        return finish_after(leg, generated, self._eos_token_id)

    async def _receive_context(self, leg: LegRequest, weights: SimWeights) -> tuple[PrefixState, TokenChoice, int, str]:
        """Fetch the context state from the prefill engine and check it is this request's."""
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
        ctx_id = dp.ctx_request_id
        body = await self._fetch_context(dp.ctx_info_endpoint.rstrip("/"), ctx_id)
        try:
            ctx = ContextState.from_wire(body)
        except (KeyError, ValueError, TypeError) as exc:
            raise KvTransferError(f"malformed context state for ctx_request_id {ctx_id}: {exc}") from exc
        state = PrefixState(chain=bytes.fromhex(ctx.chain_hex), tail=list(ctx.tail), length=len(ctx.prompt_token_ids))
        if state.digest() != ctx.digest:
            raise ContextMismatchError(f"context state for ctx_request_id {ctx_id} is corrupt (digest mismatch)")
        if ctx.prompt_token_ids != leg.prompt_token_ids:
            raise ContextMismatchError(
                f"context state for ctx_request_id {ctx_id} was computed for a different prompt "
                f"({len(ctx.prompt_token_ids)} tokens there, {len(leg.prompt_token_ids)} here)",
                param="prompt_token_ids",
            )
        if dp.encoded_opaque_state:
            expected = _opaque_digest(dp.encoded_opaque_state)
            if expected is not None and expected != ctx.digest:
                raise ContextMismatchError(
                    f"context state for ctx_request_id {ctx_id} does not match encoded_opaque_state",
                    param="disaggregated_params.encoded_opaque_state",
                )
        if dp.first_gen_tokens and dp.first_gen_tokens[0] != ctx.first_gen_token:
            raise ContextMismatchError(
                f"first_gen_tokens do not match the context state of ctx_request_id {ctx_id}",
                param="disaggregated_params.first_gen_tokens",
            )
        first = TokenChoice(
            token_id=ctx.first_gen_token,
            logprob=ctx.first_gen_logprob,
            top_logprobs=tuple(ctx.first_gen_top_logprobs[: leg.top_logprobs]) if leg.top_logprobs else (),
        )
        cached = dp.ctx_usage.cached_tokens() if dp.ctx_usage is not None else ctx.cached_tokens
        return state, first, cached, ctx.weights_version

    async def _fetch_context(self, endpoint: str, ctx_request_id: int) -> dict[str, Any]:
        if self._client is None:
            raise KvTransferError("the sim backend is not started")
        url = endpoint + kv_export_path(ctx_request_id)
        try:
            try:
                response = await self._client.get(url)
            except KV_FETCH_RETRYABLE:
                response = await self._client.get(url)
        except httpx.HTTPError as exc:
            raise KvTransferError(
                f"cannot fetch context state for ctx_request_id {ctx_request_id} from {endpoint}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if response.status_code == 404:
            raise ContextStateMissingError(
                f"context state for ctx_request_id {ctx_request_id} is not on {endpoint} "
                "(expired, already fetched, or never created)",
                param="disaggregated_params.ctx_request_id",
            )
        if response.status_code != 200:
            raise KvTransferError(
                f"fetching context state for ctx_request_id {ctx_request_id} from {endpoint} "
                f"failed with HTTP {response.status_code}: {response.text[:200]}"
            )
        body = response.json()
        if not isinstance(body, dict):
            raise KvTransferError(f"context state for ctx_request_id {ctx_request_id} is not a JSON object")
        return body

    def pending_handoffs(self) -> int:
        return len(self._store)

    async def export_context(self, ctx_request_id: int) -> dict[str, Any]:
        state = self._store.take(ctx_request_id)
        if state is None:
            raise ContextStateMissingError(
                f"no context state for ctx_request_id {ctx_request_id} on this engine "
                "(expired, already fetched, or never created)",
                param="ctx_request_id",
            )
        return state.to_wire()

    # ---- control ---------------------------------------------------------------------------

    async def load_weights(self, path: str, version: str) -> dict[str, Any]:
        content_hash = await asyncio.to_thread(hash_weights_path, path)
        digest = await asyncio.to_thread(digest_weights_path, path)
        await self._latency.sleep(self._latency.weights_load())
        previous = self._weights
        if self._config.sim.fault_load_moves_nothing:  # the injected fault: "success", same bytes
            content_hash, digest = previous.content_hash, previous.digest
        self._weights = SimWeights(version=version, content_hash=content_hash, source=path, digest=digest)
        evicted = self._cache.reset()  # as TensorRT-LLM's final update_weights does
        return {
            "version": version,
            "previous_version": previous.version,
            "content_hash": content_hash.hex()[:16],
            "prefix_cache_blocks_evicted": evicted,
        }

    async def measure_digest(self) -> str | None:
        return self._weights.digest

    async def init_collective(self, params: CollectiveInit) -> dict[str, Any]:
        raise self._no_collective("init_collective")

    async def prepare_refit_info(self, params: PrepareRefitInfo) -> dict[str, Any]:
        raise self._no_collective("prepare_refit_info")

    async def update_weights_from_collective(self, params: CollectiveUpdate) -> dict[str, Any]:
        raise self._no_collective("update_weights_from_collective")

    def _no_collective(self, op: str) -> NotSupportedError:
        return NotSupportedError(
            f"{op} is not supported by the sim backend (a test double with no GPU or NCCL); "
            f"it needs the trtllm backend. Use POST {CONTROL_ROUTES[ControlOp.LOAD_WEIGHTS]} on sim engines."
        )

    async def reset_prefix_cache(self) -> dict[str, Any]:
        return {"prefix_cache_blocks_evicted": self._cache.reset()}

    async def release_memory(self, tags: list[str]) -> dict[str, Any]:
        released = list(tags) or list(ALL_MEMORY_TAGS)
        dropped_blocks = dropped_states = 0
        if "kv_cache" in released:  # the KV pool is gone: cached blocks and unfetched states with it
            dropped_blocks = self._cache.reset()
            dropped_states = self._store.clear()
        return {
            "released": released,
            "prefix_cache_blocks_evicted": dropped_blocks,
            "context_states_dropped": dropped_states,
        }

    async def resume_memory(self, tags: list[str]) -> dict[str, Any]:
        return {"resumed": list(tags) or list(ALL_MEMORY_TAGS)}

    async def start_profile(self) -> dict[str, Any]:
        if self._profile_started is not None:
            raise BadRequestError("a profile is already running")
        self._profile_started = time.monotonic()
        return {"profiling": True}

    async def stop_profile(self) -> dict[str, Any]:
        if self._profile_started is None:
            raise BadRequestError("no profile is running")
        elapsed = time.monotonic() - self._profile_started
        self._profile_started = None
        return {"profiling": False, "duration_s": round(elapsed, 6)}


def _ctx_request_id(leg: LegRequest) -> int:
    if leg.ctx_request_id is None:  # the server always assigns one for a context-only leg
        raise BadRequestError("context_only leg without a ctx_request_id")
    return leg.ctx_request_id


def _step(choice: TokenChoice, leg: LegRequest) -> TokenStep:
    if not leg.logprobs:
        return TokenStep(token_id=choice.token_id)
    return TokenStep(token_id=choice.token_id, logprob=choice.logprob, top_logprobs=choice.top_logprobs)


def _eos_allowed(leg: LegRequest, produced: int) -> bool:
    return not leg.request.ignore_eos and produced >= leg.request.min_tokens


def _opaque_digest(encoded: str) -> str | None:
    try:
        data = json.loads(base64.b64decode(encoded, validate=True))
    except (ValueError, TypeError):
        return None
    if isinstance(data, dict) and data.get("kind") == OPAQUE_STATE_KIND and isinstance(data.get("digest"), str):
        return str(data["digest"])
    return None
