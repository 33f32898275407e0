"""The ``torch`` backend's KV handoff component, both ends: where a context gets exported.

The prefill engine's side: a finished context leg's KV is left here (:meth:`TorchHandoff.leave`)
under its ``ctx_request_id`` until a decode engine takes it (:meth:`TorchHandoff.export`, the
route ``GET /v1/disagg/kv/{id}?transport=…``). The decode engine's side:
:meth:`TorchHandoff.receive` fetches it and checks it is the leg's.

Transports (:mod:`.frame`): on one host, the context's KV lies in the prefill engine's handoff
arena and the decode engine copies it by CUDA IPC before it takes the context
(:mod:`drs_engine.backends.torch.kv.arena`); a context outside the arena (full, or disabled) goes
by CUDA IPC of its own tensor; across hosts, bytes over HTTP (:mod:`.transfer`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import httpx
import torch
from drs_protocol.engine_config import TorchSpec
from drs_protocol.enums import KvTransport
from drs_protocol.routes import KV_COPY_EVENT_PARAM
from drs_protocol.token_source import TokenSource

from drs_engine.backends.base import BinaryExport, ContextHandoff, LegRequest
from drs_engine.backends.handoff import (
    PromptDigest,
    check_received,
    context_request_id,
    context_source,
    left_context,
    missing_here,
    prompt_digest,
)
from drs_engine.backends.torch import ipc
from drs_engine.backends.torch.handoff import frame
from drs_engine.backends.torch.handoff.frame import ARENA_TAKE, FETCH_TRANSPORTS
from drs_engine.backends.torch.handoff.transfer import TorchContext, export_frame, fetch_context, header_frame
from drs_engine.backends.torch.kv.arena import ArenaMaps, KvArena
from drs_engine.backends.torch.model import ModelShape
from drs_engine.backends.torch.sampling import Choice
from drs_engine.backends.torch.worker import GpuWorker
from drs_engine.errors import BadRequestError, EngineError
from drs_engine.kv_store import ContextStore
from drs_engine.peer_auth import peer_auth

#: A CUDA-IPC KV exported by its own handle stays referenced here this long (the peer copies it in
#: milliseconds; arena regions need no such lease).
IPC_LEND_SECONDS: Final = 30.0
HTTP_CHUNK_BYTES: Final = 16 * 1024 * 1024
#: Timeouts of the decode engine's KV fetch (a 16k context over HTTP takes seconds).
FETCH_TIMEOUT: Final = httpx.Timeout(connect=5.0, read=300.0, write=60.0, pool=10.0)


@dataclass(frozen=True, slots=True)
class ReceivedKv:
    """A context's KV fetched from a prefill engine (on this engine's device), checked to be the leg's."""

    kv: Any
    first: Choice
    cached_tokens: int
    weights_version: str


class TorchHandoff:
    """Context KV left for decode engines, handed over, and received."""

    def __init__(
        self,
        spec: TorchSpec,
        *,
        shape: ModelShape,
        device: Any,
        dtype: Any,
        worker: GpuWorker,
        endpoint: str,
        peer_headers: TokenSource | Mapping[str, str] | None = None,
    ) -> None:
        self._spec = spec
        #: what the KV fetch presents to a prefill engine (the fleet's serving token)
        self._peer_auth, self._peer_headers = peer_auth(peer_headers)
        self._shape = shape
        self._device = device
        self._dtype = dtype
        self._worker = worker
        self.endpoint = endpoint
        self._contexts: ContextStore[TorchContext] = ContextStore(
            capacity=spec.kv_store_capacity, ttl_seconds=spec.kv_store_ttl_seconds, on_drop=self._drop
        )
        cuda, arena_bytes = device.type == "cuda", spec.kv_handoff_arena_bytes
        #: the prefill engine's handoff arena (None: on the CPU, or disabled)
        self.arena = KvArena(device, arena_bytes) if cuda and arena_bytes else None
        self._arena_maps = ArenaMaps()
        self._lent: list[tuple[float, Any]] = []
        self._client: httpx.AsyncClient | None = None
        self.kv_stats: dict[str, dict[str, Any]] = {}
        #: the prefill engine's side: exports by ``?transport=``, the last one's steps (ms)
        self.kv_exports: dict[str, dict[str, Any]] = {}

    def open(self) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=FETCH_TIMEOUT, headers=self._peer_headers, auth=self._peer_auth)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def __len__(self) -> int:
        """Context states left for decode engines and not fetched yet."""
        return len(self._contexts)

    async def clear(self) -> int:
        """Sleep: drop every unfetched context, lent KV and the arena's memory; returns how many contexts."""
        dropped = self._contexts.clear()  # frees their arena regions
        self._lent.clear()
        if self.arena is not None:
            await self._worker.run(self.arena.release)
        return dropped

    def info(self) -> dict[str, Any]:
        """The handoff's part of ``/server_info``."""
        cuda = self._device.type == "cuda"
        return {
            "kv_transport": self._spec.kv_transport,
            "kv_transports": [KvTransport.CUDA_IPC.value, KvTransport.HTTP.value] if cuda else [KvTransport.HTTP.value],
            "kv_transfers": self.kv_stats,
            "kv_exports": self.kv_exports,
            "kv_handoff_arena": None
            if self.arena is None
            else {"bytes": self.arena.capacity, "regions_in_use": self.arena.regions},
            "host": ipc.host_id(),
        }

    # ---- the prefill engine's side ---------------------------------------------------------

    def region(self, tokens: int) -> int | None:
        """A handoff-arena region for a context of ``tokens`` (None: no arena, or it is full)."""
        if self.arena is None:
            return None
        return self.arena.alloc(int(tokens * self._shape.kv_bytes_per_token(self._dtype)))

    def free_region(self, region: int | None) -> None:
        if region is not None and self.arena is not None:
            self.arena.free(region)

    def _drop(self, ctx: TorchContext) -> None:
        """A context gone unfetched (expired, evicted, cleared), or handed over: its region is free again."""
        self.free_region(ctx.arena_offset)

    def leave(
        self, leg: LegRequest, kv: Any, first: Choice, version: str, cached: int, arena: dict[str, Any] | None
    ) -> ContextHandoff:
        """Keep a context leg's KV for its decode engine; the handoff the leg answers with."""
        ctx_id = context_request_id(leg)
        offset = None if arena is None else int(arena["offset"])
        digest = prompt_digest(leg.prompt_token_ids)
        self._contexts.put(TorchContext(ctx_id, list(leg.prompt_token_ids), first, kv, version, cached, offset, digest))
        opaque = frame.opaque_state(
            digest=digest,
            prompt_len=len(leg.prompt_token_ids),
            weights_version=version,
            gpu_uuid=ipc.gpu_uuid(self._device),
            arena=arena,
        )
        return left_context(leg, first, opaque=opaque, endpoint=self.endpoint)

    async def export(
        self, ctx_request_id: int, transport: str, *, copy_event: str | None = None, digest_only: bool = False
    ) -> BinaryExport:
        """Hand over (and forget) a context's KV as a binary frame over ``transport``; ``copy_event``
        (:data:`~drs_protocol.routes.KV_COPY_EVENT_PARAM`, with :data:`~.frame.ARENA_TAKE` only): the
        decode engine's copy out of the arena may still run, and the region is freed once it is done;
        ``digest_only`` (:data:`~drs_protocol.routes.KV_PROMPT_DIGEST_PARAM`): the header names the
        prompt by its digest."""
        if transport not in FETCH_TRANSPORTS:
            raise BadRequestError(
                f"transport: must be one of {', '.join(FETCH_TRANSPORTS)}, not {transport!r}", param="transport"
            )
        if transport != KvTransport.HTTP and self._device.type != "cuda":
            raise BadRequestError(f"transport {transport}: this engine runs on the CPU", param="transport")
        if copy_event is not None and transport != ARENA_TAKE:
            raise BadRequestError(
                f"{KV_COPY_EVENT_PARAM}: only with transport={ARENA_TAKE}, not {transport}", param=KV_COPY_EVENT_PARAM
            )
        started = time.perf_counter()
        phases: dict[str, float] = {}
        event = None if copy_event is None else self._open_copy_event(copy_event)
        phases["event_opened"] = time.perf_counter()
        ctx = self._contexts.take(ctx_request_id)
        if ctx is None:
            raise missing_here(ctx_request_id)
        phases["taken"] = time.perf_counter()
        try:
            if transport == ARENA_TAKE:  # the decode engine has copied it, or enqueued the copy
                if ctx.arena_offset is None:
                    raise BadRequestError(f"transport {ARENA_TAKE}: this context is not in the arena")
                if event is not None and self.arena is not None:
                    self.arena.free_after(ctx.arena_offset, event)  # not before the copy is done
                    ctx = dataclasses.replace(ctx, arena_offset=None)
                exported = header_frame(ctx, digest_only=digest_only)
            else:
                if transport == KvTransport.CUDA_IPC:
                    if ctx.arena_offset is not None:  # its own tensor, so the region can go now
                        ctx = await self._worker.run(_own_copy, ctx)
                    now = time.monotonic()
                    self._lent = [(until, t) for until, t in self._lent if until > now]
                    self._lent.append((now + IPC_LEND_SECONDS, ctx.kv))
                exported = await export_frame(
                    self._worker, ctx, KvTransport(transport), HTTP_CHUNK_BYTES, digest_only=digest_only
                )
        finally:
            self._drop(ctx)  # HTTP: the bytes are in host memory by now
        stats = self.kv_exports.setdefault(transport, {"count": 0})
        stats["count"] += 1
        stats["last_steps_ms"] = _steps_ms(started, phases, end="framed")
        return exported

    def _open_copy_event(self, handle: str) -> Any:
        try:
            return ipc.open_event(handle, self._device)
        except EngineError as exc:
            raise BadRequestError(f"{KV_COPY_EVENT_PARAM}: {exc}", param=KV_COPY_EVENT_PARAM) from exc

    # ---- the decode engine's side ----------------------------------------------------------

    async def receive(self, leg: LegRequest) -> ReceivedKv:
        """Fetch a ``generation_only`` leg's context KV onto this engine's device."""
        source = context_source(leg)
        if self._client is None:
            raise EngineError("the torch backend is not started")
        dp = leg.request.disaggregated_params
        opaque = frame.read_opaque_state(dp.encoded_opaque_state if dp is not None else None)
        transport, producer = frame.choose_transport(self._spec.kv_transport, opaque, self._device)
        started = time.perf_counter()
        phases: dict[str, float] = {}
        header, kv, copy_s = await fetch_context(
            self._client,
            self._worker,
            source.endpoint,
            source.ctx_request_id,
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
        prompt = (
            PromptDigest(header.prompt_digest) if header.prompt_digest else _decode_ids(header.prompt_token_ids_b64)
        )
        check_received(leg, source.ctx_request_id, prompt, header.first_token)
        top = tuple((int(t), float(lp)) for t, lp in header.first_top_logprobs[: leg.top_logprobs])
        first = Choice(header.first_token, header.first_logprob, top)
        cached = dp.ctx_usage.cached_tokens() if dp is not None and dp.ctx_usage is not None else header.cached_tokens
        return ReceivedKv(kv, first, cached, header.weights_version)

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


def _steps_ms(started: float, phases: dict[str, float], end: str = "placed") -> dict[str, float]:
    """Milliseconds from ``started`` to each step of a fetch or an export, and to its ``end`` (a
    profile of it, for ``/server_info``)."""
    out = {name: round(1000 * (at - started), 3) for name, at in phases.items()}
    out[end] = round(1000 * (time.perf_counter() - started), 3)
    return out


def _own_copy(ctx: TorchContext) -> TorchContext:
    """``ctx`` with its KV copied out of the arena into a tensor of its own (on the GPU thread)."""
    kv = ctx.kv.clone()
    torch.cuda.current_stream(kv.device).synchronize()
    return dataclasses.replace(ctx, kv=kv)


def _decode_ids(b64: str) -> list[int]:
    from drs_protocol.token_ids import decode_token_ids_b64

    return decode_token_ids_b64(b64)
