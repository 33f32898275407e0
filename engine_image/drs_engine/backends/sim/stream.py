"""The ``sim`` backend's weights to and from a peer (:mod:`drs_engine.weights.stream`).

Sending: the files of the checkpoint the engine loaded (read again from its path, in
:func:`drs_protocol.weights_digest.checkpoint_order`), the parts it received from a peer, or, for
the weights it started with, the model label's bytes. Receiving: every byte is counted into the
digest and the content hash as it arrives and kept in memory; nothing is swapped unless the
digest is the header's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from drs_protocol.weights_digest import Digester, checkpoint_order
from drs_protocol.weights_stream import StreamTensor, WeightsStreamHeader

from drs_engine.backends.sim.weights import (
    MAX_HASHED_BYTES_PER_FILE,
    SimWeights,
    content_hasher,
    hash_file_start,
)
from drs_engine.errors import WeightsLoadError
from drs_engine.weights.stream import RECEIVE_PIECE_BYTES, WeightsExport


def _tensor(name: str, size: int) -> StreamTensor:
    return StreamTensor(name=name, shape=(size,), dtype="uint8")


def export(weights: SimWeights) -> WeightsExport:
    """What ``weights`` are, to send."""
    if weights.parts is not None:
        parts = weights.parts
        return WeightsExport(tuple(_tensor(n, len(b)) for n, b in parts), _memory_pieces([b for _, b in parts]))
    if not weights.loaded:
        label = weights.source.encode()
        return WeightsExport((_tensor("label", len(label)),), _memory_pieces([label]))
    root = Path(weights.source)
    try:
        files = checkpoint_order(root)
        names = [f.name if root.is_file() else f.relative_to(root).as_posix() for f in files]
        sizes = [f.stat().st_size for f in files]
    except OSError as exc:
        raise WeightsLoadError(f"cannot read the weights at {weights.source!r} to send: {exc}") from exc
    return WeightsExport(tuple(_tensor(n, s) for n, s in zip(names, sizes, strict=True)), _file_pieces(files))


async def _memory_pieces(blobs: list[bytes]) -> AsyncIterator[bytes | memoryview]:
    for blob in blobs:
        view = memoryview(blob)
        for i in range(0, len(view), RECEIVE_PIECE_BYTES):
            yield view[i : i + RECEIVE_PIECE_BYTES]


async def _file_pieces(files: list[Path]) -> AsyncIterator[bytes | memoryview]:
    for file in files:
        with file.open("rb") as fh:
            while piece := await asyncio.to_thread(fh.read, RECEIVE_PIECE_BYTES):
                yield piece


async def receive(header: WeightsStreamHeader, pieces: AsyncIterator[bytes], version: str) -> SimWeights:
    """The weights in the stream, once their digest is the header's (else :class:`WeightsLoadError`)."""
    digester = Digester()
    hasher = content_hasher()
    parts: list[tuple[str, bytes]] = []
    tensors = iter(header.tensors)
    current: StreamTensor | None = None
    buffer = bytearray()
    hashed = 0

    def begin() -> StreamTensor | None:
        nonlocal hashed
        for tensor in tensors:
            hash_file_start(hasher, tensor.name, tensor.nbytes)
            if tensor.nbytes:
                hashed = 0
                return tensor
            parts.append((tensor.name, b""))
        return None

    current = begin()
    async for piece in pieces:
        digester.update(piece)
        view = memoryview(piece)
        while view and current is not None:
            take = view[: current.nbytes - len(buffer)]
            buffer += take
            room = MAX_HASHED_BYTES_PER_FILE - hashed
            if room > 0:
                hasher.update(take[:room])
                hashed += min(room, len(take))
            view = view[len(take) :]
            if len(buffer) == current.nbytes:
                parts.append((current.name, bytes(buffer)))
                buffer = bytearray()
                current = begin()
    reached = digester.hexdigest()
    if digester.total_bytes != header.nbytes or current is not None:
        raise WeightsLoadError(f"the stream carried {digester.total_bytes} of its {header.nbytes} bytes")
    if reached != header.digest:
        raise WeightsLoadError(
            f"the bytes received have digest {reached}, not the {header.digest} the sender announced", param="digest"
        )
    return SimWeights(
        version=version,
        content_hash=hasher.digest(),
        source=f"peer stream ({header.version})",
        digest=reached,
        parts=tuple(parts),
        loaded=True,
    )
