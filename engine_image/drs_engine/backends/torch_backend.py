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
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import httpx
import torch

from drs_engine.backends import torch_kv, torch_refit
from drs_engine.backends.base import (
    BinaryExport,
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
from drs_engine.backends.torch_batch import Choice, DecodeBatcher, DecodeSeq, GpuWorker, Sampling, choose_tokens
from drs_engine.backends.torch_control import TorchControl
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
from drs_engine.errors import BadRequestError, ContextMismatchError, ContextStateMissingError, EngineError
from drs_engine.kv_store import ContextStore
from drs_engine.prefix_cache import PrefixCache
from drs_engine.wire import RequestType

#: An exported CUDA-IPC KV stays referenced here this long (the peer copies it in milliseconds).
IPC_LEND_SECONDS: Final = 30.0
HTTP_CHUNK_BYTES: Final = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TorchContext:
    """A finished context leg's KV, waiting for its decode engine."""

    ctx_request_id: int
    prompt_token_ids: list[int]
    first: Choice
    kv: Any
    weights_version: str
    cached_tokens: int


class TorchBackend(TorchControl, EngineBackend):
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
            capacity=self._spec.kv_store_capacity, ttl_seconds=self._spec.kv_store_ttl_seconds
        )
        self._lent: list[tuple[float, Any]] = []
        self._endpoint = config.resolved_advertise_url()
        self._worker = GpuWorker(self._device)
        self._batcher = DecodeBatcher(self._worker, self._step, self._prepare, max_batch=self._spec.max_decode_batch)
        #: bumped on the GPU thread whenever the weights change (a sequence's KV records its own)
        self._weights_gen = 0
        self._client: httpx.AsyncClient | None = None
        self._bans: dict[bool, Any] = {}
        self._group: torch_refit.RefitGroup | None = None
        self.kv_stats: dict[str, dict[str, float]] = {}
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
        self, prompt: list[int], start: int, runs: list[tuple[int, Any, int, int]], capacity: int, s: Sampling, ban: Any
    ) -> tuple[Any, Choice, int]:
        kv = new_kv(self._shape, capacity, device=self._device, dtype=self._dtype)
        for dst, base, src, n in runs:  # cached prefix blocks, copied instead of recomputed
            kv[:, :, :, dst : dst + n].copy_(base[:, :, :, src : src + n])
        logits = prefill(self._params, self._shape, prompt[start:], kv, start)
        return kv, choose_tokens(logits[None], [s], [ban])[0], self._weights_gen

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
        kv, first, gen = await self._worker.run(
            self._prefill_job, prompt, lookup.hit_tokens, runs, capacity, s, self._ban(leg, 0)
        )
        if seed == self._seed:  # the weights did not change meanwhile
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
            handoff = self._leave_context(leg, kv, first, version, lookup.hit_tokens)
        yield LegFinished(
            finish_reason=finish,
            stop_reason=stop_reason,
            prompt_tokens=len(prompt),
            cached_tokens=lookup.hit_tokens,
            prefix_query_tokens=len(prompt),
            handoff=handoff,
        )

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

    # ---- KV handoff ------------------------------------------------------------------------

    def _leave_context(self, leg: LegRequest, kv: Any, first: Choice, version: str, cached: int) -> ContextHandoff:
        ctx_id = _ctx_id(leg)
        self._contexts.put(TorchContext(ctx_id, list(leg.prompt_token_ids), first, kv, version, cached))
        digest = hashlib.blake2b(repr((ctx_id, leg.prompt_token_ids)).encode(), digest_size=16).hexdigest()
        opaque = torch_kv.opaque_state(
            digest=digest,
            prompt_len=len(leg.prompt_token_ids),
            weights_version=version,
            gpu_uuid=torch_kv.gpu_uuid(self._device),
        )
        return ContextHandoff(
            ctx_request_id=ctx_id,
            first_gen_tokens=[first.token_id],
            encoded_opaque_state=opaque,
            first_gen_log_probs=[{"token_id": first.token_id, "logprob": first.logprob}] if leg.logprobs else None,
            ctx_dp_rank=0,
            ctx_info_endpoint=self._endpoint,
        )

    async def export_context(self, ctx_request_id: int) -> dict[str, Any]:
        raise BadRequestError(
            "the torch backend hands KV over as a binary frame: GET with ?transport=http or ?transport=cuda_ipc",
            param="transport",
        )

    async def export_context_frame(self, ctx_request_id: int, transport: str) -> BinaryExport:
        from drs_engine.backends.torch_transfer import export_frame

        if transport not in (torch_kv.KvTransport.HTTP, torch_kv.KvTransport.CUDA_IPC):
            raise BadRequestError(f"transport: must be http or cuda_ipc, not {transport!r}", param="transport")
        if transport == torch_kv.KvTransport.CUDA_IPC and self._device.type != "cuda":
            raise BadRequestError("transport cuda_ipc: this engine runs on the CPU", param="transport")
        ctx = self._contexts.take(ctx_request_id)
        if ctx is None:
            raise ContextStateMissingError(
                f"no context KV for ctx_request_id {ctx_request_id} on this engine "
                "(expired, already fetched, or never created)",
                param="ctx_request_id",
            )
        now = time.monotonic()
        self._lent = [(until, t) for until, t in self._lent if until > now]
        if transport == torch_kv.KvTransport.CUDA_IPC:
            self._lent.append((now + IPC_LEND_SECONDS, ctx.kv))
        return await export_frame(self._worker, ctx, torch_kv.KvTransport(transport), HTTP_CHUNK_BYTES)

    async def _receive_context(self, leg: LegRequest) -> tuple[DecodeSeq, Choice, int]:
        from drs_engine.backends.torch_transfer import fetch_context

        dp = leg.request.disaggregated_params
        if dp is None or dp.ctx_request_id is None or not dp.ctx_info_endpoint:
            raise BadRequestError(
                "generation_only needs disaggregated_params.ctx_request_id and ctx_info_endpoint",
                param="disaggregated_params",
            )
        if self._client is None:
            raise EngineError("the torch backend is not started")
        opaque = torch_kv.read_opaque_state(dp.encoded_opaque_state)
        transport, producer = torch_kv.choose_transport(self._spec.kv_transport, opaque, self._device)
        started = time.perf_counter()
        header, kv, copy_s = await fetch_context(
            self._client,
            self._worker,
            dp.ctx_info_endpoint.rstrip("/"),
            dp.ctx_request_id,
            transport,
            producer_device=producer,
            device=self._device,
            dtype=self._dtype,
        )
        self._count_transfer(transport.value, kv.shape, time.perf_counter() - started, copy_s)
        ids = _decode_ids(header.prompt_token_ids_b64)
        if ids != leg.prompt_token_ids:
            raise ContextMismatchError(
                f"the context KV of ctx_request_id {dp.ctx_request_id} was computed for another prompt "
                f"({len(ids)} tokens there, {len(leg.prompt_token_ids)} here)",
                param="prompt_token_ids",
            )
        if dp.first_gen_tokens and dp.first_gen_tokens[0] != header.first_token:
            raise ContextMismatchError(
                f"first_gen_tokens do not match the context of ctx_request_id {dp.ctx_request_id}",
                param="disaggregated_params.first_gen_tokens",
            )
        top = tuple((int(t), float(lp)) for t, lp in header.first_top_logprobs[: leg.top_logprobs])
        first = Choice(header.first_token, header.first_logprob, top)
        s = self._sampling(leg)
        cached = dp.ctx_usage.cached_tokens() if dp.ctx_usage is not None else header.cached_tokens
        # KV computed under other weights than this engine serves is recomputed before the first step.
        gen = self._weights_gen if header.weights_version == self._version else -1
        return self._new_seq(leg, kv, first, s, gen), first, cached

    def _count_transfer(self, transport: str, shape: Any, seconds: float, copy_s: float | None) -> None:
        """``last_gb_per_s``: the whole fetch (request, mapping or bytes, copy); ``last_copy_gb_per_s``:
        the GPU copy alone (CUDA IPC; CUDA events)."""
        nbytes = int(shape[3]) * self._shape.kv_bytes_per_token(self._dtype)
        stats = self.kv_stats.setdefault(transport, {"count": 0, "bytes": 0, "seconds": 0.0})
        stats["count"] += 1
        stats["bytes"] += nbytes
        stats["seconds"] += seconds
        stats["last_bytes"] = nbytes
        stats["last_seconds"] = round(seconds, 6)
        stats["last_gb_per_s"] = round(nbytes / max(seconds, 1e-9) / 1e9, 3)
        if copy_s is not None:
            stats["last_copy_seconds"] = round(copy_s, 6)
            stats["last_copy_gb_per_s"] = round(nbytes / max(copy_s, 1e-9) / 1e9, 3)

    def pending_handoffs(self) -> int:
        return len(self._contexts)


def _ctx_id(leg: LegRequest) -> int:
    if leg.ctx_request_id is None:
        raise BadRequestError("context_only leg without a ctx_request_id")
    return leg.ctx_request_id


def _step(choice: Choice, leg: LegRequest) -> TokenStep:
    if not leg.logprobs:
        return TokenStep(token_id=choice.token_id)
    return TokenStep(token_id=choice.token_id, logprob=choice.logprob, top_logprobs=choice.top_logprobs)


def _decode_ids(b64: str) -> list[int]:
    from drs_protocol.token_ids import decode_token_ids_b64

    return decode_token_ids_b64(b64)


def _as_engine_error(exc: BaseException) -> EngineError:
    if isinstance(exc, EngineError):
        return exc
    return EngineError(f"decode step failed: {type(exc).__name__}: {exc}")
