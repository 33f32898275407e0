"""Moving one context's KV between two ``torch`` engines (the frame is :mod:`.frame`'s).

:func:`export_frame` is the prefill engine's side of ``GET /v1/disagg/kv/{id}?transport=…``;
:func:`fetch_context` is the decode engine's: it asks for the frame, then puts the KV on its own
GPU in a tensor with room for the tokens it will decode. HTTP stages through pinned host memory
(one device-to-host copy, the bytes, one host-to-device copy); CUDA IPC maps the prefill
engine's tensor and copies it GPU to GPU, once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import torch
from drs_protocol.enums import KvTransport
from drs_protocol.routes import KV_COPY_EVENT_PARAM, KV_PROMPT_DIGEST_PARAM, kv_export_path
from drs_protocol.token_ids import encode_token_ids_b64

from drs_engine.backends.base import BinaryExport
from drs_engine.backends.handoff import ContextSource, raise_for_fetch_status
from drs_engine.backends.torch.handoff.frame import ARENA_TAKE, HEADER_LEN, MAX_HEADER_BYTES, KvHeader
from drs_engine.backends.torch.ipc import ipc_export, ipc_import
from drs_engine.backends.torch.kv.arena import COPY_EVENT_KEY, ArenaMaps, RegionCopy, start_copy
from drs_engine.backends.torch.model import DTYPES
from drs_engine.backends.torch.sampling import Choice
from drs_engine.backends.torch.worker import GpuWorker
from drs_engine.errors import KvTransferError


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
    #: :func:`~drs_engine.backends.handoff.prompt_digest` of the prompt (worked out as the leg ends)
    prompt_digest: str = ""


def _header(
    ctx: TorchContext, transport: str, payload_bytes: int, ipc: dict[str, Any], *, digest_only: bool
) -> KvHeader:
    digest_only = digest_only and bool(ctx.prompt_digest)
    return KvHeader(
        ctx_request_id=ctx.ctx_request_id,
        prompt_token_ids_b64="" if digest_only else encode_token_ids_b64(ctx.prompt_token_ids),
        prompt_digest=ctx.prompt_digest if digest_only else "",
        first_token=ctx.first.token_id,
        first_logprob=float(ctx.first.logprob if ctx.first.logprob is not None else 0.0),
        first_top_logprobs=[[t, lp] for t, lp in ctx.first.top_logprobs],
        weights_version=ctx.weights_version,
        cached_tokens=ctx.cached_tokens,
        transport=transport,
        kv_shape=list(ctx.kv.shape),
        kv_dtype=str(ctx.kv.dtype).removeprefix("torch."),
        payload_bytes=payload_bytes,
        ipc=ipc,
    )


def _to_pinned(kv: Any) -> Any:
    flat = kv.reshape(-1).view(torch.uint8)
    host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=kv.device.type == "cuda")
    host.copy_(flat)
    return host


async def export_frame(
    worker: GpuWorker, ctx: TorchContext, transport: KvTransport, chunk: int, *, digest_only: bool = False
) -> BinaryExport:
    """``digest_only``: the header names the prompt by its digest (the decode engine asked)."""
    if transport is KvTransport.CUDA_IPC:
        ipc = await worker.run(ipc_export, ctx.kv)
        data = _header(ctx, transport.value, 0, ipc, digest_only=digest_only).encode()
        return BinaryExport(length=len(data), chunks=_once(data))
    host = await worker.run(_to_pinned, ctx.kv)
    head = _header(ctx, transport.value, int(host.numel()), {}, digest_only=digest_only).encode()
    return BinaryExport(length=len(head) + int(host.numel()), chunks=_chunks(head, host, chunk))


def header_frame(ctx: TorchContext, *, digest_only: bool = False) -> BinaryExport:
    """A frame of the header alone (the take after an arena copy, :data:`~.frame.ARENA_TAKE`)."""
    data = _header(ctx, ARENA_TAKE, 0, {}, digest_only=digest_only).encode()
    return BinaryExport(length=len(data), chunks=_once(data))


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _chunks(head: bytes, host: Any, chunk: int) -> AsyncIterator[bytes | memoryview]:
    yield head
    view = memoryview(host.numpy()).cast("B")
    for start in range(0, len(view), chunk):
        yield view[start : start + chunk]


async def fetch_context(
    client: httpx.AsyncClient,
    worker: GpuWorker,
    endpoint: str,
    ctx_request_id: int,
    transport: KvTransport,
    *,
    producer_device: int | None,
    device: Any,
    dtype: Any,
    arena: dict[str, Any] | None = None,
    maps: ArenaMaps | None = None,
    phases: dict[str, float] | None = None,
) -> tuple[KvHeader, Any, float | None]:
    """The context's header (naming the prompt by its digest where the prefill engine knows to), its
    KV on ``device`` (exactly the context's tokens: the decode loop
    grows it before the first step, off the time to first token), and for CUDA IPC the seconds of
    the GPU copy itself (the rest of the fetch is the request and mapping the handle). ``phases``,
    when given, gets the clock (``time.perf_counter``) at each step, for ``/server_info``."""
    phases = {} if phases is None else phases
    pending: RegionCopy | None = None
    phases["start"] = time.perf_counter()
    params = {"transport": transport.value, KV_PROMPT_DIGEST_PARAM: "1"}
    if arena is not None and maps is not None and producer_device is not None:
        pending = await worker.run(start_copy, maps, arena, producer_device, device, dtype, _copy_stream(device))
        params = {"transport": ARENA_TAKE, KV_PROMPT_DIGEST_PARAM: "1"}
        if arena.get(COPY_EVENT_KEY):  # taken while the copy runs: the region is freed once its event completes
            params[KV_COPY_EVENT_PARAM] = pending.event_handle
        else:  # an older prefill engine frees the region at the take: copy first
            await worker.run(pending.ended.synchronize)
        phases["arena_copy_enqueued"] = time.perf_counter()
    try:
        async with client.stream("GET", endpoint + kv_export_path(ctx_request_id), params=params) as response:
            if response.status_code != 200:
                body = (await response.aread())[:300].decode(errors="replace")
                raise_for_fetch_status(ContextSource(ctx_request_id, endpoint), response.status_code, body)
            phases["response_head"] = time.perf_counter()
            header, host = await _read_frame(response.aiter_raw(), pin=device.type == "cuda")
            phases["frame_read"] = time.perf_counter()
    except httpx.HTTPError as exc:
        raise KvTransferError(
            f"cannot fetch context KV {ctx_request_id} from {endpoint}: {type(exc).__name__}: {exc}"
        ) from exc
    if header.kv_dtype not in DTYPES or DTYPES[header.kv_dtype] != dtype:
        raise KvTransferError(f"context KV dtype {header.kv_dtype} differs from this engine's {dtype}")
    if pending is not None:
        copied = await worker.run(pending.finish)
        phases["arena_copy"] = time.perf_counter()
        if list(copied[0].shape) != header.kv_shape:
            raise KvTransferError(f"arena KV has shape {list(copied[0].shape)}, the header says {header.kv_shape}")
        return header, copied[0], copied[1]
    if transport is KvTransport.CUDA_IPC:
        if producer_device is None:
            raise KvTransferError("cuda_ipc without the prefill engine's GPU")
        kv, copy_s = await worker.run(_from_ipc, header, producer_device, device, dtype)
        return header, kv, copy_s
    kv = await worker.run(_from_host, header, host, device, dtype)
    return header, kv, None


async def _read_frame(chunks: AsyncIterator[bytes], *, pin: bool) -> tuple[KvHeader, Any]:
    pending = bytearray()
    header: KvHeader | None = None
    host: Any = None
    view: Any = None
    filled = 0
    async for piece in chunks:
        if header is None:
            pending += piece
            if len(pending) < HEADER_LEN.size:
                continue
            (size,) = HEADER_LEN.unpack_from(pending)
            if size > MAX_HEADER_BYTES:
                raise KvTransferError(f"KV frame header of {size} bytes is too large")
            if len(pending) < HEADER_LEN.size + size:
                continue
            header = KvHeader.decode(bytes(pending[HEADER_LEN.size : HEADER_LEN.size + size]))
            host = torch.empty(header.payload_bytes, dtype=torch.uint8, pin_memory=pin and header.payload_bytes > 0)
            view = host.numpy()  # the pinned buffer, written in place chunk by chunk
            piece = bytes(pending[HEADER_LEN.size + size :])
            pending.clear()
        if piece:
            if filled + len(piece) > header.payload_bytes:
                raise KvTransferError("KV frame is longer than its header says")
            view[filled : filled + len(piece)] = memoryview(piece)
            filled += len(piece)
    if header is None:
        raise KvTransferError("KV frame ended inside its header")
    if filled != header.payload_bytes:
        raise KvTransferError(f"KV frame ended after {filled} of {header.payload_bytes} payload bytes")
    return header, host


def _from_host(header: KvHeader, host: Any, device: Any, dtype: Any) -> Any:
    kv = host.view(dtype).view(header.kv_shape).to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return kv


def _from_ipc(header: KvHeader, producer_device: int, device: Any, dtype: Any) -> tuple[Any, float]:
    """The context's KV copied out of the prefill engine's tensor, and the copy's own seconds
    (CUDA events around the one bulk copy, on a stream of its own: no device-wide sync)."""
    remote = ipc_import(header.ipc, dtype, producer_device)
    if list(remote.shape) != header.kv_shape:
        raise KvTransferError(f"CUDA IPC KV has shape {list(remote.shape)}, the header says {header.kv_shape}")
    kv = torch.empty(remote.shape, dtype=dtype, device=device)
    stream = _copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the allocation is ordered before the copy
    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        began.record(stream)
        kv.copy_(remote, non_blocking=True)  # one contiguous copy: GPU to GPU, or within the GPU
        ended.record(stream)
    ended.synchronize()
    kv.record_stream(stream)
    del remote
    return kv, began.elapsed_time(ended) / 1000.0


_STREAMS: dict[Any, Any] = {}


def _copy_stream(device: Any) -> Any:
    """The stream KV copies run on (one per device, made once)."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]
