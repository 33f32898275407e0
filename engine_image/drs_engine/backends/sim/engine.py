"""The ``sim`` backend: a CPU test double for a TensorRT-LLM GPU engine.

It is a test and benchmark double, named as one everywhere (``server_info``, metrics labels). It
speaks the same protocol as the GPU engine and has the parts whose behaviour the rest of the
system depends on, each real rather than faked:

- a token function of (weights, prefix) (:mod:`.model`), so a wrong KV handoff, a wrong
  prefix or stale weights show up as different tokens;
- a prefix cache of chained block hashes with LRU eviction (:mod:`drs_engine.prefix_cache`),
  looked up and filled by prefill iterations as an in-flight batching engine does
  (:mod:`drs_engine.prefill_batch`: blocks still being computed are shared with nobody);
- a KV handoff (:mod:`.handoff`): a context-only leg leaves its state in a bounded store
  (:mod:`drs_engine.kv_store`) under ``ctx_request_id``; the decode engine fetches it over HTTP
  from ``ctx_info_endpoint`` (``GET /v1/disagg/kv/{ctx_request_id}``) and continues from it;
- weights (:mod:`.weights`): a version name and a content hash;
- a latency model (:mod:`drs_engine.latency`): prefill time for uncached tokens only, decode
  steps slowing with batch size, all scaled by ``sim.speed``.

Sampling parameters (temperature, top_p, …) do not change the tokens: the double is greedy over a
hash. One ``context_and_generation`` call gives exactly the tokens of a context leg followed by a
generation leg on another engine with the same weights. The order of a leg's steps is
:func:`drs_engine.backends.leg.run_leg`'s; this engine supplies the steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from drs_protocol.control import CollectiveInit, CollectiveUpdate, PrepareRefitInfo
from drs_protocol.prefix_lookup import PrefixHeld
from drs_protocol.token_source import TokenSource
from drs_protocol.weights_stream import WeightsStreamHeader

from drs_engine.backends.base import (
    ALL_MEMORY_TAGS,
    ContextHandoff,
    EngineBackend,
    LegEvent,
    LegRequest,
    finish_after,
    restate_after_refit,
    token_step,
)
from drs_engine.backends.leg import Prefilled, run_leg
from drs_engine.backends.profile import WallClockProfile
from drs_engine.backends.sim import stream as sim_stream
from drs_engine.backends.sim.collective import SimCollective
from drs_engine.backends.sim.handoff import SimHandoff
from drs_engine.backends.sim.model import PrefixState, TokenChoice, TokenFunction
from drs_engine.backends.sim.weights import SimWeights, initial_weights, read_weights_path
from drs_engine.config import BackendName, EngineConfig
from drs_engine.latency import LatencyModel
from drs_engine.prefill_batch import PrefillIterations
from drs_engine.prefix_cache import PrefixCache, prefix_held
from drs_engine.prefix_hash import block_hashes
from drs_engine.weights.stream import WeightsExport
from drs_engine.wire import RequestType


@dataclass(slots=True)
class SimLeg:
    """A leg's prefix state and the weights it was computed under."""

    prefix: PrefixState
    weights: SimWeights


class SimBackend(EngineBackend):
    """The sim test double (see the module docstring)."""

    name: ClassVar[str] = BackendName.SIM
    test_double: ClassVar[bool] = True

    def __init__(
        self,
        config: EngineConfig,
        *,
        vocab_size: int,
        eos_token_id: int,
        peer_headers: TokenSource | Mapping[str, str] | None = None,
    ) -> None:
        spec = config.sim
        self._config = config
        self._vocab_size = spec.vocab_size or vocab_size
        self._eos_token_id = spec.eos_token_id if spec.eos_token_id is not None else eos_token_id
        self._weights = initial_weights(config.model.path, config.weights_version)
        self._cache = PrefixCache(tokens_per_block=spec.tokens_per_block, capacity_tokens=spec.cache_capacity_tokens)
        self._handoff = SimHandoff(spec, config.resolved_advertise_url(), peer_headers)
        self._latency = LatencyModel.from_spec(spec)
        self._prefill = PrefillIterations(self._cache, self._latency)
        self._decodes_in_flight = 0
        self._profile = WallClockProfile({})
        self._collective = SimCollective()

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._handoff.open()

    async def close(self) -> None:
        await self._handoff.close()

    @property
    def weights_version(self) -> str:
        return self._weights.version

    @property
    def tokens_per_block(self) -> int:
        return self._cache.tokens_per_block

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def endpoint(self) -> str:
        return self._handoff.endpoint

    def server_info(self) -> dict[str, Any]:
        return {
            "kind": "test double",
            "vocab_size": self._vocab_size,
            "eos_token_id": self._eos_token_id,
            "speed": self._latency.speed,
            "prefix_cache_blocks": len(self._cache),
            "prefix_cache_capacity_blocks": self._cache.capacity_blocks,
            "context_states_held": len(self._handoff),
        }

    def prefix_held(self, prompt_ids: Sequence[int]) -> PrefixHeld:
        """The blocks a prefill of ``prompt_ids`` would reuse now (stored when a context phase ended)."""
        return prefix_held(self._cache, self._weights.seed, prompt_ids)

    # ---- serving: the steps of drs_engine.backends.leg.run_leg -------------------------------

    def _token_function(self, weights: SimWeights) -> TokenFunction:
        return TokenFunction(
            weights.seed,
            vocab_size=self._vocab_size,
            eos_token_id=self._eos_token_id,
            eos_probability=self._config.sim.eos_probability,
            tokens_per_block=self._cache.tokens_per_block,
        )

    def generate(self, leg: LegRequest) -> AsyncGenerator[LegEvent, None]:
        return run_leg(leg, self)

    async def receive(self, leg: LegRequest) -> Prefilled[SimLeg, TokenChoice]:
        weights = self._weights  # the weights at the start; decode re-prefills if a load lands mid-decode
        got = await self._handoff.receive(leg)
        state, first = got.state, got.first
        if got.weights_version != weights.version:  # the context was computed under other weights: redo it
            state = await self._restate(self._token_function(weights), list(leg.prompt_token_ids))
            first = self._next(self._token_function(weights), state, leg, produced=0)
        return Prefilled(SimLeg(state, weights), first, got.cached_tokens, 0, weights.version)

    async def prefill(self, leg: LegRequest) -> Prefilled[SimLeg, TokenChoice]:
        weights = self._weights
        fn = self._token_function(weights)
        prompt = leg.prompt_token_ids
        hashes = block_hashes(fn.seed, prompt, fn.tokens_per_block)
        lookup = await self._prefill.prefill(len(prompt), hashes)
        state = fn.start(prompt, hashes)
        first = self._next(fn, state, leg, produced=0)
        return Prefilled(SimLeg(state, weights), first, lookup.hit_tokens, len(prompt), weights.version)

    def leave(self, leg: LegRequest, prefilled: Prefilled[SimLeg, TokenChoice]) -> ContextHandoff:
        leg_state = prefilled.state
        return self._handoff.leave(
            leg, leg_state.prefix, prefilled.first, leg_state.weights.version, cached_tokens=prefilled.cached_tokens
        )

    def discard(self, prefilled: Prefilled[SimLeg, TokenChoice]) -> None:
        """Nothing to free: the double's state is a few hashes."""

    async def decode(
        self, leg: LegRequest, prefilled: Prefilled[SimLeg, TokenChoice]
    ) -> AsyncGenerator[LegEvent, None]:
        """Decode until a stop. Refit safety: when the engine's weights change between two steps, the
        prompt plus every token generated so far is prefilled again under the new weights (the old
        KV is dropped) and decoding resumes from there, so every token after the switch comes from
        the new weights over the same context; ``weights_boundary`` says how many came before."""
        state, weights = prefilled.state.prefix, prefilled.state.weights
        fn = self._token_function(weights)
        choice = prefilled.first
        generated = [choice.token_id]
        new_blocks: list[bytes] = []
        boundary: int | None = None
        self._decodes_in_flight += 1
        try:
            while True:
                yield token_step(choice, leg)
                finish, stop_reason = finish_after(leg, generated, self._eos_token_id)
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
                choice = self._next(fn, state, leg, produced=len(generated))
                generated.append(choice.token_id)
        finally:
            self._decodes_in_flight -= 1
        if leg.request_type is RequestType.CONTEXT_AND_GENERATION and boundary is None:
            self._cache.insert(new_blocks)  # generated blocks extend the cached prompt blocks
        yield prefilled.finished(leg, finish, stop_reason, weights_version=weights.version, weights_boundary=boundary)

    def _next(self, fn: TokenFunction, state: PrefixState, leg: LegRequest, *, produced: int) -> TokenChoice:
        """The next token; EOS may come only after ``min_tokens``. ``ignore_eos`` has TensorRT-LLM's
        meaning: EOS is not banned (it may be picked, with its log-probability), it only does not end
        the leg (:func:`~drs_engine.backends.base.finish_after`)."""
        allow_eos = produced >= leg.request.min_tokens
        return fn.next_token(state, top_logprobs=leg.top_logprobs, allow_eos=allow_eos)

    async def _restate(self, fn: TokenFunction, ids: list[int]) -> PrefixState:
        """A context leg over ``ids`` under ``fn``'s weights (prefill time for all of them)."""
        await self._prefill_compute(len(ids))
        return fn.start(ids)

    async def _prefill_compute(self, uncached_tokens: int) -> None:
        """Prefill time for ``uncached_tokens``, in the engine's prefill iterations (shared with
        the other prompts, so prefill throughput is bounded); no cache lookup."""
        await self._prefill.prefill(uncached_tokens, None)

    def pending_handoffs(self) -> int:
        return len(self._handoff)

    async def export_context(self, ctx_request_id: int) -> dict[str, Any]:
        return self._handoff.export(ctx_request_id)

    # ---- control ---------------------------------------------------------------------------

    async def load_weights(self, path: str, version: str) -> dict[str, Any]:
        return await self.load_weights_at(path, version, _at_once)

    async def load_weights_at(self, path: str, version: str, cut_over: Callable[[], Awaitable[None]]) -> dict[str, Any]:
        """Read and check the weights first (a copy in this call's locals, serving nothing), swap
        them in only once ``cut_over()`` returned."""
        content_hash, digest = await asyncio.to_thread(read_weights_path, path)  # each file read once
        await self._latency.sleep(self._latency.weights_load())
        await cut_over()
        previous = self._weights
        if self._config.sim.fault_load_moves_nothing:  # the injected fault: "success", same bytes
            content_hash, digest = previous.content_hash, previous.digest
        self._weights = SimWeights(version=version, content_hash=content_hash, source=path, digest=digest, loaded=True)
        return self._swapped(previous)

    def _swapped(self, previous: SimWeights) -> dict[str, Any]:
        evicted = self._cache.reset()  # as TensorRT-LLM's final update_weights does
        return {
            "version": self._weights.version,
            "previous_version": previous.version,
            "content_hash": self._weights.content_hash.hex()[:16],
            "prefix_cache_blocks_evicted": evicted,
        }

    async def export_weights(self) -> WeightsExport:
        return sim_stream.export(self._weights)

    async def load_weights_from_stream(
        self, header: WeightsStreamHeader, pieces: AsyncIterator[bytes], version: str
    ) -> dict[str, Any]:
        received = await sim_stream.receive(header, pieces, version)
        await self._latency.sleep(self._latency.weights_load())
        previous, self._weights = self._weights, received
        return {**self._swapped(previous), "bytes": header.nbytes, "source": received.source}

    async def measure_digest(self) -> str | None:
        return self._weights.digest

    async def init_collective(self, params: CollectiveInit) -> dict[str, Any]:
        return await self._collective.init(params)

    async def prepare_refit_info(self, params: PrepareRefitInfo) -> dict[str, Any]:
        return self._collective.prepare(params)

    async def update_weights_from_collective(self, params: CollectiveUpdate) -> dict[str, Any]:
        received = await self._collective.update(params)  # all of it, or nothing changes
        await self._latency.sleep(self._latency.weights_load())
        previous, self._weights = self._weights, received
        return {
            **self._swapped(previous),
            "bytes": sum(len(b) for _, b in received.parts or ()),
            "source": received.source,
        }

    async def abort_collective(self, reason: str) -> dict[str, Any]:
        return {"aborted": self._collective.abort()}

    async def reset_prefix_cache(self) -> dict[str, Any]:
        return {"prefix_cache_blocks_evicted": self._cache.reset()}

    async def release_memory(self, tags: list[str]) -> dict[str, Any]:
        released = list(tags) or list(ALL_MEMORY_TAGS)
        dropped_blocks = dropped_states = 0
        if "kv_cache" in released:  # the KV pool is gone: cached blocks and unfetched states with it
            dropped_blocks = self._cache.reset()
            dropped_states = self._handoff.clear()
        return {
            "released": released,
            "prefix_cache_blocks_evicted": dropped_blocks,
            "context_states_dropped": dropped_states,
        }

    async def resume_memory(self, tags: list[str]) -> dict[str, Any]:
        return {"resumed": list(tags) or list(ALL_MEMORY_TAGS)}

    async def start_profile(self) -> dict[str, Any]:
        return self._profile.start()

    async def stop_profile(self) -> dict[str, Any]:
        return self._profile.stop()


async def _at_once() -> None:
    """A cut-over that is now (a load without one)."""
