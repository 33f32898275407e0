"""The ``torch`` backend's KV handoff, both ends: leaving a context for a decode engine, handing it
over (``GET /v1/disagg/kv/{id}?transport=…``), and receiving it. A mixin of
:class:`~drs_engine.backends.torch_backend.TorchBackend` (its state is declared here, set there).

Transports (:mod:`.torch_kv`): on one host, the context's KV lies in the prefill engine's handoff
arena and the decode engine copies it by CUDA IPC before it takes the context
(:mod:`.torch_arena`); a context outside the arena (full, or disabled) goes by CUDA IPC of its own
tensor; across hosts, bytes over HTTP (:mod:`.torch_transfer`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Final

import httpx
import torch
from drs_protocol.engine_config import TorchSpec

from drs_engine.backends import torch_kv
from drs_engine.backends.base import BinaryExport, ContextHandoff, LegRequest
from drs_engine.backends.torch_arena import ArenaMaps, KvArena
from drs_engine.backends.torch_batch import Choice, DecodeSeq, GpuWorker, Sampling
from drs_engine.backends.torch_model import ModelShape
from drs_engine.errors import BadRequestError, ContextMismatchError, ContextStateMissingError, EngineError
from drs_engine.kv_store import ContextStore

#: A CUDA-IPC KV exported by its own handle stays referenced here this long (the peer copies it in
#: milliseconds; arena regions need no such lease).
IPC_LEND_SECONDS: Final = 30.0
HTTP_CHUNK_BYTES: Final = 16 * 1024 * 1024
KvTransport = torch_kv.KvTransport


@dataclass(frozen=True, slots=True)
class TorchContext:
    """A finished context leg's KV, waiting for its decode engine."""

    ctx_request_id: int
    prompt_token_ids: list[int]
    first: Choice
    kv: Any
    weights_version: str
    cached_tokens: int
    #: the KV's region in the handoff arena (None: a tensor of its own)
    arena_offset: int | None = None


class TorchHandoff:
    """Leaving, handing over and receiving context KV."""

    _worker: GpuWorker
    _contexts: ContextStore[TorchContext]
    _arena: KvArena | None
    _arena_maps: ArenaMaps
    _lent: list[tuple[float, Any]]
    _client: httpx.AsyncClient | None
    _spec: TorchSpec
    _device: Any
    _dtype: Any
    _shape: ModelShape
    _endpoint: str
    _version: str
    _weights_gen: int
    kv_stats: dict[str, dict[str, Any]]

    def _sampling(self, leg: LegRequest) -> Sampling:
        raise NotImplementedError

    def _new_seq(self, leg: LegRequest, kv: Any, first: Choice, s: Sampling, gen: int) -> DecodeSeq:
        raise NotImplementedError

    def _drop_context(self, ctx: TorchContext) -> None:
        """A context gone unfetched (expired, evicted, cleared): its arena region is free again."""
        if ctx.arena_offset is not None and self._arena is not None:
            self._arena.free(ctx.arena_offset)

    def _leave_context(
        self, leg: LegRequest, kv: Any, first: Choice, version: str, cached: int, arena: dict[str, Any] | None
    ) -> ContextHandoff:
        ctx_id = _ctx_id(leg)
        offset = None if arena is None else int(arena["offset"])
        self._contexts.put(TorchContext(ctx_id, list(leg.prompt_token_ids), first, kv, version, cached, offset))
        digest = hashlib.blake2b(repr((ctx_id, leg.prompt_token_ids)).encode(), digest_size=16).hexdigest()
        opaque = torch_kv.opaque_state(
            digest=digest,
            prompt_len=len(leg.prompt_token_ids),
            weights_version=version,
            gpu_uuid=torch_kv.gpu_uuid(self._device),
            arena=arena,
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
        from drs_engine.backends.torch_transfer import export_frame, header_frame

        if transport not in set(KvTransport):
            raise BadRequestError(
                f"transport: must be one of {', '.join(KvTransport)}, not {transport!r}", param="transport"
            )
        if transport != KvTransport.HTTP and self._device.type != "cuda":
            raise BadRequestError(f"transport {transport}: this engine runs on the CPU", param="transport")
        ctx = self._contexts.take(ctx_request_id)
        if ctx is None:
            raise ContextStateMissingError(
                f"no context KV for ctx_request_id {ctx_request_id} on this engine "
                "(expired, already fetched, or never created)",
                param="ctx_request_id",
            )
        try:
            if transport == KvTransport.CUDA_IPC_ARENA:  # the decode engine has copied it already
                if ctx.arena_offset is None:
                    raise BadRequestError("transport cuda_ipc_arena: this context is not in the arena")
                return header_frame(ctx, KvTransport.CUDA_IPC_ARENA)
            if transport == KvTransport.CUDA_IPC:
                if ctx.arena_offset is not None:  # its own tensor, so the region can go now
                    ctx = await self._worker.run(_own_copy, ctx)
                now = time.monotonic()
                self._lent = [(until, t) for until, t in self._lent if until > now]
                self._lent.append((now + IPC_LEND_SECONDS, ctx.kv))
            return await export_frame(self._worker, ctx, KvTransport(transport), HTTP_CHUNK_BYTES)
        finally:
            self._drop_context(ctx)  # HTTP: the bytes are in host memory by now

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
        phases: dict[str, float] = {}
        header, kv, copy_s = await fetch_context(
            self._client,
            self._worker,
            dp.ctx_info_endpoint.rstrip("/"),
            dp.ctx_request_id,
            transport,
            producer_device=producer,
            device=self._device,
            dtype=self._dtype,
            arena=opaque.get("arena") if transport is KvTransport.CUDA_IPC else None,
            maps=self._arena_maps,
            phases=phases,
        )
        self._count_transfer(transport.value, kv.shape, time.perf_counter() - started, copy_s)
        self.kv_stats[transport.value]["last_phases_ms"] = _steps_ms(started, phases)
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


def _steps_ms(started: float, phases: dict[str, float]) -> dict[str, float]:
    """Milliseconds from ``started`` to each step of a fetch, and to its end (a profile of the fetch)."""
    out = {name: round(1000 * (at - started), 3) for name, at in phases.items()}
    out["placed"] = round(1000 * (time.perf_counter() - started), 3)
    return out


def _own_copy(ctx: TorchContext) -> TorchContext:
    """``ctx`` with its KV copied out of the arena into a tensor of its own (on the GPU thread)."""
    kv = ctx.kv.clone()
    torch.cuda.current_stream(kv.device).synchronize()
    return TorchContext(
        ctx.ctx_request_id,
        ctx.prompt_token_ids,
        ctx.first,
        kv,
        ctx.weights_version,
        ctx.cached_tokens,
        ctx.arena_offset,
    )


def _ctx_id(leg: LegRequest) -> int:
    if leg.ctx_request_id is None:
        raise BadRequestError("context_only leg without a ctx_request_id")
    return leg.ctx_request_id


def _decode_ids(b64: str) -> list[int]:
    from drs_protocol.token_ids import decode_token_ids_b64

    return decode_token_ids_b64(b64)
