"""The ``torch`` backend's weights to and from a peer (:mod:`drs_engine.weights.stream`).

Sending: the packed buffer (:mod:`.packed`) as it is, in pieces copied to host memory one at a
time (no copy on the CPU); weights kept as separate tensors go one after the other, each as its
bytes. The layout is the refit's: the model's parameters in order, with their names, shapes and
dtypes in the header.

Receiving: the header's tensors must be this model's (names, shapes, dtypes, order); the bytes go
into a new flat buffer on the engine's device, piece by piece, and the digest is computed there
(:func:`drs_engine.weights.digest.fused_digest`, the value of :func:`drs_protocol.weights_digest.digest_torch`) before anything is swapped: the served weights
stay untouched until the new ones are whole and proven. The new buffer is then adopted as the
packed weights (their parameters are views of it), so the peak is two copies of the weights on
the device for the time of one load. On the CPU the digest is computed as the pieces arrive
(NumPy, overlapping the network) instead of over the buffer afterwards; the manager keeps it as
the digest of the weights until they next change (no second pass over the same bytes). Every function that touches a tensor blocks: they run on the
GPU worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import AsyncIterator
from typing import Any

import torch
from drs_protocol.nemo_rl_refit import TensorSpec
from drs_protocol.weights_digest import Digester
from drs_protocol.weights_pack import flat_slots
from drs_protocol.weights_stream import StreamTensor, WeightsStreamHeader

from drs_engine.backends.torch.weights.packed import PackedWeights, _itemsize, _torch_dtype, specs_of
from drs_engine.backends.torch.worker import GpuWorker
from drs_engine.errors import WeightsLoadError
from drs_engine.weights.digest import fused_digest
from drs_engine.weights.stream import RECEIVE_PIECE_BYTES, WeightsExport


def export(weights: PackedWeights, worker: GpuWorker) -> WeightsExport:
    """What ``weights`` are, to send (read as they are when each piece goes)."""
    if not weights.params:
        raise WeightsLoadError("the engine's weights are offloaded (asleep): nothing to stream")
    tensors = tuple(StreamTensor(name=s.name, shape=s.shape, dtype=s.dtype) for s in specs_of(weights.params))
    sources = [weights.flat] if weights.flat is not None else list(weights.params.values())
    return WeightsExport(tensors, _pieces(sources, worker))


async def _pieces(sources: list[Any], worker: GpuWorker) -> AsyncIterator[bytes | memoryview]:
    for source in sources:
        flat = await worker.run(_as_bytes, source)
        for start in range(0, int(flat.numel()), RECEIVE_PIECE_BYTES):
            host = await worker.run(_to_host, flat, start)
            yield memoryview(host.numpy())


def _as_bytes(tensor: Any) -> Any:
    return tensor.detach().contiguous().view(torch.uint8).reshape(-1)


def _to_host(flat: Any, start: int) -> Any:
    return flat[start : start + RECEIVE_PIECE_BYTES].to("cpu")


def check_layout(header: WeightsStreamHeader, params: dict[str, Any]) -> list[TensorSpec]:
    """The stream's tensors, when they are this model's (else :class:`WeightsLoadError` naming the first difference)."""
    theirs = [t.spec() for t in header.tensors]
    mine = specs_of(params)
    if len(theirs) != len(mine):
        raise WeightsLoadError(f"the peer's weights have {len(theirs)} tensors, this model {len(mine)}")
    for i, (a, b) in enumerate(zip(theirs, mine, strict=True)):
        if a != b:
            raise WeightsLoadError(f"the peer's tensor {i} is {a}, this model's {b}")
    return theirs


async def receive(
    header: WeightsStreamHeader, pieces: AsyncIterator[bytes], specs: list[TensorSpec], device: Any, worker: GpuWorker
) -> PackedWeights:
    """The stream's weights in a new buffer on ``device``, once their digest is the header's."""
    flat = await worker.run(_empty, header.nbytes, device)
    on_host = Digester() if flat.device.type == "cpu" else None  # on the CPU: digest as the bytes arrive

    async def take(piece: bytes, at: int) -> None:
        copy = worker.run(_copy_in, flat, at, piece)
        if on_host is None:
            await copy
        else:
            await asyncio.gather(copy, asyncio.to_thread(on_host.update, piece))

    offset = 0
    busy: asyncio.Task[None] | None = None  # the previous piece's copy, while the next one arrives
    try:
        async for piece in pieces:
            if busy is not None:
                await busy
            busy = asyncio.ensure_future(take(piece, offset))
            offset += len(piece)
        if busy is not None:
            await busy
    finally:
        if busy is not None and not busy.done():
            busy.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await busy
    if offset != header.nbytes:
        raise WeightsLoadError(f"the stream carried {offset} of its {header.nbytes} bytes")
    reached = on_host.hexdigest() if on_host is not None else await worker.run(fused_digest, flat)
    if reached != header.digest:
        raise WeightsLoadError(
            f"the bytes received have digest {reached}, not the {header.digest} the sender announced", param="digest"
        )
    return await worker.run(adopt, flat, specs)


def verified_digest(header: WeightsStreamHeader) -> str:
    """The digest :func:`receive` proved of the buffer it returned (the header's, once checked)."""
    return header.digest


def _empty(nbytes: int, device: Any) -> Any:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _copy_in(flat: Any, offset: int, piece: bytes) -> None:
    with warnings.catch_warnings():  # read only: torch warns that the buffer is not writable
        warnings.simplefilter("ignore", UserWarning)
        source = torch.frombuffer(piece, dtype=torch.uint8)
    flat[offset : offset + len(piece)].copy_(source)


def adopt(flat: Any, specs: list[TensorSpec]) -> PackedWeights:
    """``flat`` (the refit layout of ``specs``) as the packed weights, its parameters views of it;
    a layout whose tensors do not start aligned to their dtypes is kept as separate copies."""
    slots = flat_slots(specs)
    if any(s.offset % _itemsize(s.spec.dtype) for s in slots):
        params = {
            s.spec.name: flat[s.offset : s.offset + s.spec.nbytes]
            .clone()
            .view(_torch_dtype(s.spec.dtype))
            .view(s.spec.shape)
            for s in slots
        }
        return PackedWeights(params)
    views = {
        s.spec.name: flat[s.offset : s.offset + s.spec.nbytes].view(_torch_dtype(s.spec.dtype)).view(s.spec.shape)
        for s in slots
    }
    return PackedWeights(views, flat, {s.spec.name: s for s in slots})
