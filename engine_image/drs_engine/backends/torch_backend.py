"""The ``torch`` backend: a reference GPU engine in PyTorch (one GPU per engine; not a test double).

It speaks the protocol of ``sim`` and ``trtllm`` with a real model (:mod:`.torch_model`, Qwen3
architecture, a Hugging Face checkpoint or ``random:<size>``):

- prefill with a real block prefix cache: a prompt's full blocks are keyed by chained hashes
  (seeded with the weights) and a hit copies the cached KV instead of recomputing it;
- decode steps of concurrent requests batched (:mod:`.torch_batch`);
- KV handoff (:mod:`.torch_kv`): a context-only leg leaves its KV on the GPU; the decode engine
  fetches it by CUDA IPC (same host) or as bytes over HTTP, and decodes from it;
- refit from safetensors (``/control/weights/load``) and by collective broadcast
  (:mod:`.torch_refit`); sleep moves the weights to host memory and frees the KV.

``torch`` is an optional dependency (the ``gpu`` extra): this module is imported only when the
backend is chosen.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncGenerator
from typing import Any, ClassVar

import httpx
import torch

from drs_engine.backends import torch_kv, torch_refit
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
from drs_engine.backends.sim_model import block_hashes
from drs_engine.backends.torch_arena import ArenaMaps, KvArena
from drs_engine.backends.torch_batch import Choice, DecodeBatcher, DecodeSeq, GpuWorker, Sampling, choose_tokens
from drs_engine.backends.torch_control import TorchControl
from drs_engine.backends.torch_handoff import TorchContext, TorchHandoff, _ctx_id
from drs_engine.backends.torch_model import (
    decode_step,
    new_kv,
    parse_dtype,
    pick_device,
    prefill,
    random_state_dict,
    read_safetensors,
    resolve_model,
)
from drs_engine.backends.torch_weights import PackedWeights, pack
from drs_engine.config import BackendName, EngineConfig
from drs_engine.errors import EngineError
from drs_engine.kv_store import ContextStore
from drs_engine.prefix_cache import PrefixCache
from drs_engine.wire import RequestType


class TorchBackend(TorchHandoff, TorchControl, EngineBackend):
    """A real model on one GPU (or the CPU, for tests of the logic)."""

    name: ClassVar[str] = BackendName.TORCH
    test_double: ClassVar[bool] = False

    def __init__(self, config: EngineConfig, *, vocab_size: int, eos_token_id: int) -> None:
        self._config = config
        self._spec = config.torch
        self._source = resolve_model(config.model.path)
        self._shape = self._source.shape
        self._dtype = parse_dtype(config.model.precision)
        self._device = pick_device(self._spec.device)
        self._eos = eos_token_id
        self._vocab_limit = min(vocab_size, self._shape.vocab_size) if self._source.random_seed is not None else None
        self._version = config.weights_version
        self._seed = self._weights_seed()
        self._weights = PackedWeights({})
        self._ipc_maps = torch_refit.IpcMaps()
        self._host_params: dict[str, Any] | None = None
        self._cache = PrefixCache(
            tokens_per_block=self._spec.tokens_per_block, capacity_tokens=self._spec.cache_capacity_tokens
        )
        self._contexts: ContextStore[TorchContext] = ContextStore(
            capacity=self._spec.kv_store_capacity,
            ttl_seconds=self._spec.kv_store_ttl_seconds,
            on_drop=self._drop_context,
        )
        cuda, arena_bytes = self._device.type == "cuda", self._spec.kv_handoff_arena_bytes
        self._arena = KvArena(self._device, arena_bytes) if cuda and arena_bytes else None
        self._arena_maps = ArenaMaps()
        self._lent: list[tuple[float, Any]] = []
        self._endpoint = config.resolved_advertise_url()
        self._worker = GpuWorker(self._device)
        self._batcher = DecodeBatcher(self._worker, self._step, self._prepare, max_batch=self._spec.max_decode_batch)
        #: bumped on the GPU thread whenever the weights change (a sequence's KV records its own)
        self._weights_gen = 0
        self._client: httpx.AsyncClient | None = None
        self._bans: dict[bool, Any] = {}
        self._group: torch_refit.RefitGroup | None = None
        self.kv_stats: dict[str, dict[str, Any]] = {}
        self._last_refit: dict[str, Any] | None = None
        self._profile_started: float | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._weights = pack(await self._worker.run(self._initial_params), self._device)
        self._bans = await self._worker.run(self._ban_masks)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(connect=5.0, read=300.0, write=60.0, pool=10.0))

    def _initial_params(self) -> dict[str, Any]:
        if self._source.directory is not None:
            return read_safetensors(self._source.directory, self._shape, self._device, self._dtype)
        seed = self._source.random_seed or 0
        return random_state_dict(self._shape, seed=seed, device=self._device, dtype=self._dtype)

    def _ban_masks(self) -> dict[bool, Any]:
        """Ids a pick may not take: outside the tokenizer (random models), plus EOS when banned."""
        base = torch.zeros(self._shape.vocab_size, dtype=torch.bool, device=self._device)
        if self._vocab_limit is not None:
            base[self._vocab_limit :] = True
            if self._eos < self._shape.vocab_size:
                base[self._eos] = False
        with_eos = base.clone()
        if self._eos < self._shape.vocab_size:
            with_eos[self._eos] = True
        return {False: base, True: with_eos}

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        torch_refit.leave_group(self._group)
        self._group = None
        self._worker.close()

    @property
    def weights_version(self) -> str:
        return self._version

    @property
    def tokens_per_block(self) -> int:
        return self._cache.tokens_per_block

    def _weights_seed(self) -> bytes:
        return hashlib.blake2b(f"{self._version}\0{self._source.label}".encode(), digest_size=16).digest()

    def server_info(self) -> dict[str, Any]:
        cuda = self._device.type == "cuda"
        b = self._batcher
        return {
            "kind": "reference GPU engine (PyTorch)",
            "device": str(self._device),
            "gpu": torch.cuda.get_device_name(self._device) if cuda else None,
            "model": self._source.label,
            "dtype": str(self._dtype).removeprefix("torch."),
            "layers": self._shape.layers,
            "kv_bytes_per_token": self._shape.kv_bytes_per_token(self._dtype),
            "kv_transport": self._spec.kv_transport,
            "kv_transports": [torch_kv.KvTransport.CUDA_IPC.value, torch_kv.KvTransport.HTTP.value]
            if cuda
            else [torch_kv.KvTransport.HTTP.value],
            "kv_transfers": self.kv_stats,
            "kv_handoff_arena": None
            if self._arena is None
            else {"bytes": self._arena.capacity, "regions_in_use": self._arena.regions},
            "host": torch_kv.host_id(),
            "prefix_cache_blocks": len(self._cache),
            "prefix_cache_capacity_blocks": self._cache.capacity_blocks,
            "context_states_held": len(self._contexts),
            "decode_batching": {
                "max_batch": b.max_batch,
                "active": b.active,
                "steps": b.steps,
                "tokens": b.tokens,
                "mean_batch": round(b.tokens / b.steps, 3) if b.steps else None,
            },
            "refit_group": None
            if self._group is None
            else {"backend": self._group.backend, "rank": self._group.rank, "world_size": self._group.world_size},
            "last_refit": self._last_refit,
        }

    # ---- the model on the worker thread ----------------------------------------------------

    def _step(self, kvs: list[Any], tokens: list[int], positions: list[int]) -> Any:
        return decode_step(self._params, self._shape, tokens, kvs, positions)

    def _prepare(self, seq: DecodeSeq) -> None:
        """Before a step: room for one more token in ``seq``'s KV (grown by ``decodeGrowthTokens``),
        and, if the weights changed since its KV was computed, that KV recomputed under the new
        weights (the prompt and the tokens generated so far: refit safety)."""
        capacity = seq.kv.shape[3]
        if seq.weights_gen != self._weights_gen:
            ids, boundary = restate_after_refit(seq.prompt, seq.generated, seq.length)
            fresh = new_kv(self._shape, capacity, device=self._device, dtype=self._dtype)
            prefill(self._params, self._shape, ids, fresh, 0)
            seq.kv, seq.weights_gen, seq.boundary = fresh, self._weights_gen, boundary
        if seq.length < capacity:
            return
        grown = max(seq.grow_to, capacity + self._spec.decode_growth_tokens)
        bigger = new_kv(self._shape, grown, device=self._device, dtype=self._dtype)
        bigger[:, :, :, :capacity].copy_(seq.kv)
        seq.kv = bigger

    def _install(self, params: dict[str, Any] | None) -> None:
        """New weights (or the same tensors, changed in place): on the GPU thread, between steps."""
        if params is not None:
            self._weights = pack(params, self._device)
        self._weights_gen += 1

    def _prefill_job(
        self,
        prompt: list[int],
        start: int,
        runs: list[tuple[int, Any, int, int]],
        capacity: int,
        s: Sampling,
        ban: Any,
        region: int | None = None,
    ) -> tuple[Any, Any, Choice, int, dict[str, Any] | None]:
        """Prefill ``prompt`` from ``start``: ``(kv, context kv, first choice, weights gen, arena)``.
        With an arena ``region`` the context's KV lies there: computed in place when the prefix
        cache keeps nothing, else copied there (the cache's blocks must outlive the region)."""
        shape = (self._shape.layers, 2, self._shape.kv_heads, capacity, self._shape.head_dim)
        arena = self._arena if region is not None else None
        in_place = arena is not None and self._cache.capacity_blocks == 0
        if arena is not None and region is not None and in_place:
            kv = arena.view(region, shape, self._dtype)
        else:
            kv = new_kv(self._shape, capacity, device=self._device, dtype=self._dtype)
        for dst, base, src, n in runs:  # cached prefix blocks, copied instead of recomputed
            kv[:, :, :, dst : dst + n].copy_(base[:, :, :, src : src + n])
        logits = prefill(self._params, self._shape, prompt[start:], kv, start)
        ctx_kv, where = kv, None
        if arena is not None and region is not None:
            ctx_kv = kv if in_place else arena.view(region, shape, self._dtype).copy_(kv)
            where = arena.describe(region, shape, self._dtype)
        return kv, ctx_kv, choose_tokens(logits[None], [s], [ban])[0], self._weights_gen, where

    # ---- serving ---------------------------------------------------------------------------

    def _sampling(self, leg: LegRequest) -> Sampling:
        req = leg.request
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        generator = None
        if temperature > 0 and req.seed is not None:
            generator = torch.Generator(device=self._device)
            generator.manual_seed(int(req.seed))
        return Sampling(
            temperature=temperature,
            top_p=float(req.top_p or 1.0),
            top_k=int(req.top_k or 0),
            logprobs=leg.logprobs,
            top_logprobs=leg.top_logprobs,
            generator=generator,
        )

    def _ban(self, leg: LegRequest, produced: int) -> Any:
        return self._bans[leg.request.ignore_eos or produced < leg.request.min_tokens]

    def _cached_runs(self, hashes: list[bytes]) -> list[tuple[int, Any, int, int]]:
        """The cached blocks as copy runs ``(dst, base, src, tokens)`` (adjacent blocks of one
        tensor merge into one copy)."""
        tpb = self._cache.tokens_per_block
        runs: list[tuple[int, Any, int, int]] = []
        for i, h in enumerate(hashes):
            base, src = self._cache.value(h)
            if runs and runs[-1][1] is base and runs[-1][2] + runs[-1][3] == src:
                dst, _, first, n = runs[-1]
                runs[-1] = (dst, base, first, n + tpb)
            else:
                runs.append((i * tpb, base, src, tpb))
        return runs

    def _remember_blocks(self, ids: list[int], kv: Any, from_block: int) -> None:
        """Cache the full blocks of ``ids`` (whose KV is in ``kv``) from ``from_block`` on."""
        tpb = self._cache.tokens_per_block
        hashes = block_hashes(self._seed, ids, tpb)[from_block:]
        values = [(kv, (from_block + i) * tpb) for i in range(len(hashes))]
        self._cache.insert(hashes, values)

    async def generate(self, leg: LegRequest) -> AsyncGenerator[LegEvent, None]:
        if leg.request_type is RequestType.GENERATION_ONLY:
            seq, first, cached = await self._receive_context(leg)
            async for event in self._decode(leg, seq, first, cached_tokens=cached, prefix_query_tokens=0):
                yield event
            return
        prompt = leg.prompt_token_ids
        seed, version = self._seed, self._version
        hashes = block_hashes(seed, prompt, self._cache.tokens_per_block)
        lookup = self._cache.lookup(len(prompt), hashes)
        runs = self._cached_runs(hashes[: lookup.hit_blocks])
        only_context = leg.request_type is RequestType.CONTEXT_ONLY
        capacity = len(prompt) if only_context else self._decode_capacity(leg)
        s = self._sampling(leg)
        region = self._arena_region(capacity) if only_context else None
        try:
            kv, ctx_kv, first, gen, arena = await self._worker.run(
                self._prefill_job, prompt, lookup.hit_tokens, runs, capacity, s, self._ban(leg, 0), region
            )
        except BaseException:
            if region is not None and self._arena is not None:
                self._arena.free(region)
            raise
        if seed == self._seed and (kv is not ctx_kv or arena is None):  # the weights did not change meanwhile
            self._remember_blocks(prompt, kv, lookup.hit_blocks)
        if not only_context:
            seq = self._new_seq(leg, kv, first, s, gen)
            async for event in self._decode(
                leg, seq, first, cached_tokens=lookup.hit_tokens, prefix_query_tokens=len(prompt)
            ):
                yield event
            return
        yield _step(first, leg)
        finish, stop_reason = finish_after(leg, [first.token_id], self._eos)
        handoff = ContextHandoff(
            ctx_request_id=_ctx_id(leg), first_gen_tokens=[first.token_id], ctx_info_endpoint=self._endpoint
        )
        if finish != "stop":
            finish = finish or "not_finished"
            handoff = self._leave_context(leg, ctx_kv, first, version, lookup.hit_tokens, arena)
        elif region is not None and self._arena is not None:
            self._arena.free(region)
        yield LegFinished(
            finish_reason=finish,
            stop_reason=stop_reason,
            prompt_tokens=len(prompt),
            cached_tokens=lookup.hit_tokens,
            prefix_query_tokens=len(prompt),
            handoff=handoff,
        )

    def _arena_region(self, tokens: int) -> int | None:
        """A handoff-arena region for a context of ``tokens`` (None: no arena, or it is full)."""
        if self._arena is None:
            return None
        return self._arena.alloc(int(tokens * self._shape.kv_bytes_per_token(self._dtype)))

    def _decode_capacity(self, leg: LegRequest) -> int:
        return len(leg.prompt_token_ids) + min(leg.max_tokens, self._spec.decode_growth_tokens)

    def _new_seq(self, leg: LegRequest, kv: Any, first: Choice, s: Sampling, gen: int) -> DecodeSeq:
        return DecodeSeq(
            prompt=list(leg.prompt_token_ids),
            weights_gen=gen,
            grow_to=self._decode_capacity(leg),
            kv=kv,
            length=len(leg.prompt_token_ids),
            next_token=first.token_id,
            sampling=s,
            generated=[first.token_id],
            check=lambda generated: finish_after(leg, generated, self._eos),
            banned=lambda produced: self._ban(leg, produced),
        )

    async def _decode(
        self, leg: LegRequest, seq: DecodeSeq, first: Choice, *, cached_tokens: int, prefix_query_tokens: int
    ) -> AsyncGenerator[LegEvent, None]:
        seed = self._seed
        yield _step(first, leg)
        seq.finish = finish_after(leg, seq.generated, self._eos)
        if seq.finish[0] is None:
            self._batcher.add(seq)
            try:
                while (item := await seq.queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise _as_engine_error(item)
                    yield _step(item, leg)
            finally:
                self._batcher.remove(seq)
        if leg.request_type is RequestType.CONTEXT_AND_GENERATION and seed == self._seed:
            computed = (leg.prompt_token_ids + seq.generated)[: seq.length]
            self._remember_blocks(computed, seq.kv, len(leg.prompt_token_ids) // self._cache.tokens_per_block)
        finish, stop_reason = seq.finish
        yield LegFinished(
            finish_reason=finish or "length",
            stop_reason=stop_reason,
            prompt_tokens=len(leg.prompt_token_ids),
            cached_tokens=cached_tokens,
            prefix_query_tokens=prefix_query_tokens,
            weights_version=self._version,
            weights_boundary=seq.boundary,
        )


def _step(choice: Choice, leg: LegRequest) -> TokenStep:
    if not leg.logprobs:
        return TokenStep(token_id=choice.token_id)
    return TokenStep(token_id=choice.token_id, logprob=choice.logprob, top_logprobs=choice.top_logprobs)


def _as_engine_error(exc: BaseException) -> EngineError:
    if isinstance(exc, EngineError):
        return exc
    return EngineError(f"decode step failed: {type(exc).__name__}: {exc}")
