"""The ``torch`` backend: a reference GPU engine in PyTorch (one GPU per engine; not a test double).

It speaks the protocol of ``sim`` and ``trtllm`` with a real model (:mod:`.model`, Qwen3
architecture, a Hugging Face checkpoint or ``random:<size>``). :class:`TorchBackend` owns four
components, each with its own state, and supplies the steps of
:func:`drs_engine.backends.leg.run_leg`:

- the model runner (:mod:`.runner`): prefill, and decode steps of concurrent requests batched
  (:mod:`.batching`) in a preallocated decode pool replayed as CUDA graphs (:mod:`.decoder`,
  :mod:`.pooled`, :mod:`.graphs`), all on one GPU thread (:mod:`.worker`), tokens picked by
  :mod:`.sampling`;
- the KV store (:mod:`.kv`): a real block prefix cache (a prompt's full blocks keyed by chained
  hashes seeded with the weights, their version and generation; a hit copies the cached KV instead
  of recomputing it; with ``kvLayout: paged`` the cache is the paged store's blocks, shared in
  place: :mod:`.kv.turns`). A prefill's hit counts only under the weights its job runs with on the
  GPU thread (a refit queued before it: computed whole, :mod:`.runner`);
- the handoff (:mod:`.handoff`): a context-only leg leaves its KV on the GPU; the decode engine
  fetches it by CUDA IPC (same host) or as bytes over HTTP, and decodes from it;
- the weights manager (:mod:`.weights`): refit from safetensors (``/control/weights/load``), by
  collective broadcast and by CUDA IPC; sleep moves the weights to host memory and frees the KV.

``torch`` is an optional dependency (the ``gpu`` extra): this package is imported only when the
backend is chosen.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from drs_protocol.control import CollectiveInit, CollectiveUpdate, IpcUpdate, PrepareRefitInfo
from drs_protocol.prefix_lookup import PrefixHeld
from drs_protocol.token_source import TokenSource
from drs_protocol.weights_stream import WeightsStreamHeader

from drs_engine.backends.base import (
    ALL_MEMORY_TAGS,
    BinaryExport,
    ContextHandoff,
    EngineBackend,
    LegEvent,
    LegRequest,
    finish_after,
    token_step,
)
from drs_engine.backends.leg import Prefilled, run_leg
from drs_engine.backends.profile import WallClockProfile
from drs_engine.backends.torch import worker as device_memory
from drs_engine.backends.torch.handoff.contexts import TorchHandoff
from drs_engine.backends.torch.kv.prefix import PrefixKv
from drs_engine.backends.torch.model import parse_dtype, pick_device, resolve_model
from drs_engine.backends.torch.runner import ModelRunner
from drs_engine.backends.torch.sampling import Choice, Sampling, sampling_for
from drs_engine.backends.torch.weights.manager import KEPT_VERSIONS, WeightsManager
from drs_engine.backends.torch.worker import GpuWorker
from drs_engine.config import BackendName, EngineConfig
from drs_engine.errors import BadRequestError, EngineError
from drs_engine.prefix_cache import prefix_held
from drs_engine.prefix_hash import block_hashes
from drs_engine.weights.stream import WeightsExport
from drs_engine.wire import RequestType


@dataclass(slots=True)
class TorchLeg:
    """A leg's KV after its prompt (prefilled here, or received), and how to go on from it."""

    kv: Any
    sampling: Sampling
    #: the weights generation ``kv`` was computed with (-1: other weights, recomputed first)
    gen: int
    #: what a context leg leaves: ``kv`` or its copy in the handoff arena (and the region)
    ctx_kv: Any = None
    arena: dict[str, Any] | None = None
    region: int | None = None


class TorchBackend(EngineBackend):
    """A real model on one GPU (or the CPU, for tests of the logic)."""

    name: ClassVar[str] = BackendName.TORCH
    test_double: ClassVar[bool] = False
    stream_runs: ClassVar[bool] = True  # 32 streams make 32 tokens a step: a stream behind catches up at once

    def __init__(
        self,
        config: EngineConfig,
        *,
        vocab_size: int,
        eos_token_id: int,
        peer_headers: TokenSource | Mapping[str, str] | None = None,
    ) -> None:
        spec = config.torch
        source = resolve_model(config.model.path)
        self._source = source
        self._shape = source.shape
        self._dtype = parse_dtype(config.model.precision)
        self._device = pick_device(spec.device)
        self._eos = eos_token_id
        vocab_limit = min(vocab_size, self._shape.vocab_size) if source.random_seed is not None else None
        self._worker = GpuWorker(self._device)
        self._weights = WeightsManager(
            source, version=config.weights_version, device=self._device, dtype=self._dtype, worker=self._worker
        )
        self._kv = PrefixKv(spec)
        self._handoff = TorchHandoff(
            spec,
            shape=self._shape,
            device=self._device,
            dtype=self._dtype,
            worker=self._worker,
            endpoint=config.resolved_advertise_url(),
            peer_headers=peer_headers,
        )
        self._runner = ModelRunner(
            spec,
            shape=self._shape,
            device=self._device,
            dtype=self._dtype,
            weights=self._weights,
            worker=self._worker,
            vocab_limit=vocab_limit,
            eos_token_id=eos_token_id,
        )
        self._profile = WallClockProfile({"kind": "wall clock only"})

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self._device.type == "cuda":
            device_memory.share_the_gil_finely()
        await self._weights.start()
        await self._runner.start(self._kv.tokens_per_block)
        self._handoff.open()

    async def close(self) -> None:
        await self._handoff.close()
        self._weights.close()
        self._worker.close()

    @property
    def weights_version(self) -> str:
        return self._weights.version

    @property
    def tokens_per_block(self) -> int:
        return self._kv.tokens_per_block

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def endpoint(self) -> str:
        return self._handoff.endpoint

    def server_info(self) -> dict[str, Any]:
        cuda = self._device.type == "cuda"
        b = self._runner.batcher
        handoff = self._handoff.info()
        return {
            "kind": "reference GPU engine (PyTorch)",
            "device": str(self._device),
            "gpu": torch.cuda.get_device_name(self._device) if cuda else None,
            "model": self._source.label,
            "dtype": str(self._dtype).removeprefix("torch."),
            "layers": self._shape.layers,
            "kv_bytes_per_token": self._shape.kv_bytes_per_token(self._dtype),
            **handoff,
            **self._cache_info(),
            "context_states_held": len(self._handoff),
            "decode_batching": {
                "max_batch": b.max_batch,
                "active": b.active,
                "steps_per_job": b.steps_per_job,
                "jobs": b.jobs,
                "steps": b.steps,
                "tokens": b.tokens,
                "mean_batch": round(b.tokens / b.steps, 3) if b.steps else None,
                "pool": self._runner.decoder.info(),
            },
            "prefill_batching": {
                "token_budget": self._runner.prefills.budget,
                "batches": self._runner.prefills.batches,
                "prompts": self._runner.prefills.prompts,
            },
            "refit_group": self._weights.group_info(),
            "last_refit": self._weights.last_refit,
        }

    def _cache_info(self) -> dict[str, int]:
        """The prefix cache's blocks: the paged store's pool (``kvLayout: paged``) or :class:`PrefixKv`."""
        turns = self._runner.turns
        if turns is not None:
            pool = turns.store.pool
            return {"prefix_cache_blocks": pool.cached_blocks, "prefix_cache_capacity_blocks": pool.blocks}
        return {"prefix_cache_blocks": len(self._kv), "prefix_cache_capacity_blocks": self._kv.cache.capacity_blocks}

    # ---- serving: the steps of drs_engine.backends.leg.run_leg -------------------------------

    def generate(self, leg: LegRequest) -> AsyncGenerator[LegEvent, None]:
        return run_leg(leg, self)

    async def receive(self, leg: LegRequest) -> Prefilled[TorchLeg, Choice]:
        got = await self._handoff.receive(leg)
        # KV computed under other weights than this engine serves is recomputed before the first step
        # (the served generation's own version: a swap's tensors are in before the event loop says so).
        served = self._weights.gen
        gen = served if got.weights_version == self._weights.version_of(served) else -1
        state = TorchLeg(kv=got.kv, sampling=sampling_for(leg, self._device), gen=gen)
        return Prefilled(state, got.first, got.cached_tokens, 0, self._weights.version)

    async def prefill(self, leg: LegRequest) -> Prefilled[TorchLeg, Choice]:
        runner = self._runner
        prompt = leg.prompt_token_ids
        gen = self._weights.gen  # the generation the hit is looked up under (the runner checks it is still served)
        seed = self._weights.seed_at(gen)
        only_context = leg.request_type is RequestType.CONTEXT_ONLY
        paged = runner.turns is not None
        keyed = paged and not (only_context and self._kv.keeps_nothing)  # the store's pool is the cache
        hit = self._kv.lookup(seed, prompt) if not paged else None
        capacity = len(prompt) if only_context else runner.decode_capacity(leg)
        s = sampling_for(leg, self._device)
        region = self._handoff.region(capacity) if only_context else None
        try:
            done = await runner.prefill(
                prompt,
                hit.tokens if hit else 0,
                hit.runs if hit else [],
                capacity,
                s,
                runner.ban(leg, 0),
                self._handoff.arena,
                region,
                cache_keeps_nothing=self._kv.keeps_nothing,
                gen=gen,
                keyed=keyed,
                decodes=not only_context,
            )
        except BaseException:
            self._handoff.free_region(region)
            raise
        remember = hit is not None and seed == self._weights.seed  # the weights did not change meanwhile
        if hit is not None and remember and (done.kv is not done.ctx_kv or done.arena is None):
            self._kv.remember(seed, prompt, done.kv, hit.blocks)
        state = TorchLeg(done.kv, s, done.gen, ctx_kv=done.ctx_kv, arena=done.arena, region=region)
        # labelled with the weights the prefill ran under, not those served at the request's arrival:
        # a context leg computed after a refit's swap is the new weights' (a decode engine still at
        # the old ones must recompute it, not take it as its own)
        version = self._weights.version_of(done.gen)
        if version is None:  # only for a prompt queued across more swaps than the manager remembers
            self._handoff.free_region(region)
            runner.drop_turn(done.kv)
            raise EngineError(f"the weights changed {KEPT_VERSIONS} times or more while this prompt waited")
        return Prefilled(state, done.first, done.cached, len(prompt), version)

    def leave(self, leg: LegRequest, prefilled: Prefilled[TorchLeg, Choice]) -> ContextHandoff:
        s = prefilled.state
        version = prefilled.weights_version or self._weights.version
        return self._handoff.leave(leg, s.ctx_kv, prefilled.first, version, prefilled.cached_tokens, s.arena)

    def discard(self, prefilled: Prefilled[TorchLeg, Choice]) -> None:
        self._handoff.free_region(prefilled.state.region)

    async def decode(self, leg: LegRequest, prefilled: Prefilled[TorchLeg, Choice]) -> AsyncGenerator[LegEvent, None]:
        runner, state, first = self._runner, prefilled.state, prefilled.first
        seq = runner.new_seq(leg, state.kv, first, state.sampling, state.gen)
        seed = self._weights.seed
        try:
            yield token_step(first, leg)
            seq.finish = finish_after(leg, seq.generated, self._eos)
            if seq.finish[0] is None:
                runner.batcher.add(seq)
                try:
                    while (item := await seq.queue.get()) is not None:
                        if isinstance(item, BaseException):
                            raise _as_engine_error(item)
                        yield token_step(item, leg)
                finally:
                    runner.batcher.remove(seq)
                await seq.released.wait()  # out of the decode pool: its KV is its own again (paged: cached)
        finally:
            runner.drop_turn(seq.kv)  # paged: a prefilled turn that never stepped gives its blocks back
        cache = runner.turns is None and not seq.pooled and seed == self._weights.seed
        if leg.request_type is RequestType.CONTEXT_AND_GENERATION and cache:
            computed = (leg.prompt_token_ids + seq.generated)[: seq.length]
            self._kv.remember(seed, computed, seq.kv, len(leg.prompt_token_ids) // self._kv.tokens_per_block)
        finish, stop_reason = seq.finish
        yield prefilled.finished(
            leg, finish or "length", stop_reason, weights_version=self._weights.version, weights_boundary=seq.boundary
        )

    # ---- the handoff's routes --------------------------------------------------------------

    def pending_handoffs(self) -> int:
        return len(self._handoff)

    async def export_context(self, ctx_request_id: int) -> dict[str, Any]:
        raise BadRequestError(
            "the torch backend hands KV over as a binary frame: GET with ?transport=http or ?transport=cuda_ipc",
            param="transport",
        )

    async def export_context_frame(
        self, ctx_request_id: int, transport: str, *, copy_event: str | None = None, prompt_digest: bool = False
    ) -> BinaryExport:
        return await self._handoff.export(ctx_request_id, transport, copy_event=copy_event, digest_only=prompt_digest)

    # ---- control: weights (swapped by the weights manager; the prefix cache goes with them) ----

    async def _switched(self, previous: str, result: dict[str, Any]) -> dict[str, Any]:
        evicted = await self._forget_prefixes()
        return {
            "version": self._weights.version,
            "previous_version": previous,
            "prefix_cache_blocks_evicted": evicted,
            **result,
        }

    async def measure_digest(self) -> str | None:
        return await self._weights.measure_digest()

    async def load_weights(self, path: str, version: str) -> dict[str, Any]:
        return await self._switched(*await self._weights.load(path, version))

    async def export_weights(self) -> WeightsExport:
        return self._weights.export()

    async def load_weights_from_stream(
        self, header: WeightsStreamHeader, pieces: AsyncIterator[bytes], version: str
    ) -> dict[str, Any]:
        return await self._switched(*await self._weights.load_stream(header, pieces, version))

    async def init_collective(self, params: CollectiveInit) -> dict[str, Any]:
        return await self._weights.init_collective(params)

    async def prepare_refit_info(self, params: PrepareRefitInfo) -> dict[str, Any]:
        return await self._weights.prepare(params)

    async def update_weights_from_collective(self, params: CollectiveUpdate) -> dict[str, Any]:
        return await self._switched(*await self._weights.update_from_collective(params))

    async def update_weights_from_ipc(self, params: IpcUpdate) -> dict[str, Any]:
        return await self._switched(*await self._weights.update_from_ipc(params))

    async def abort_collective(self, reason: str) -> dict[str, Any]:
        return {"aborted": self._weights.abort_group()}

    # ---- control: caches, memory, profile ---------------------------------------------------

    def prefix_held(self, prompt_ids: Sequence[int]) -> PrefixHeld:
        """The blocks of KV a prefill of ``prompt_ids`` would reuse now instead of computing (paged:
        the store's cached blocks, shared in place; else :class:`PrefixKv`'s, copied)."""
        turns = self._runner.turns
        if turns is None:
            return prefix_held(self._kv.cache, self._weights.seed, prompt_ids)
        tpb = self._kv.tokens_per_block
        hashes = block_hashes(self._weights.seed, prompt_ids, tpb)
        held = turns.store.pool.cached_run(hashes) if turns.caching else 0
        return PrefixHeld(tokens=len(prompt_ids), blocks=len(hashes), held_blocks=held, tokens_per_block=tpb)

    async def _forget_prefixes(self) -> int:
        """Every cached prefix block dropped (new weights: its KV is stale; a reset; sleep); how many."""
        return self._kv.reset() + await self._worker.run(self._runner.forget_cached)

    async def reset_prefix_cache(self) -> dict[str, Any]:
        return {"prefix_cache_blocks_evicted": await self._forget_prefixes()}

    async def release_memory(self, tags: list[str]) -> dict[str, Any]:
        released = list(tags) or list(ALL_MEMORY_TAGS)
        before = await self._worker.run(device_memory.free_bytes, self._device)
        dropped_blocks = dropped_states = 0
        if "kv_cache" in released:
            dropped_blocks = await self._forget_prefixes()
            dropped_states = await self._handoff.clear()
            self._runner.batcher.fail_all(EngineError("the engine released its KV cache (sleep)"))
            await self._worker.run(self._runner.free_pool)
        if "model" in released:
            await self._weights.offload()
        after = await self._worker.run(device_memory.empty_cache, self._device)
        held = (await self._worker.run(device_memory.memory, self._device))["gpu_allocated_bytes"]
        return {
            "released": released,
            "prefix_cache_blocks_evicted": dropped_blocks,
            "context_states_dropped": dropped_states,
            "gpu_free_bytes_before": before,
            "gpu_free_bytes_after": after,
            "gpu_allocated_bytes": held,
        }

    async def resume_memory(self, tags: list[str]) -> dict[str, Any]:
        resumed = list(tags) or list(ALL_MEMORY_TAGS)
        if "model" in resumed:
            await self._weights.restore()
        return {"resumed": resumed, **(await self._worker.run(device_memory.memory, self._device))}

    async def start_profile(self) -> dict[str, Any]:
        return self._profile.start()

    async def stop_profile(self) -> dict[str, Any]:
        return self._profile.stop()


def _as_engine_error(exc: BaseException) -> EngineError:
    if isinstance(exc, EngineError):
        return exc
    return EngineError(f"decode step failed: {type(exc).__name__}: {exc}")
