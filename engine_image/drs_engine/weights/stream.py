"""The weights stream both ways (:mod:`drs_protocol.weights_stream`): the bytes an engine sends
from what it holds, and the reader a receiving engine takes them in with.

Sending: :func:`stream_body` puts the prefix (magic, header length, header) before the backend's
pieces and checks, as it goes, that the backend gave exactly the header's byte count (a backend
that gives fewer or more bytes breaks the stream: the sender stops, and the receiver sees a short
stream). Receiving: :class:`StreamReader` turns the pieces of an HTTP body, of whatever sizes they
arrive in, into the header and then the weights' bytes in pieces of at most
:data:`RECEIVE_PIECE_BYTES` (16 MiB: the unit the backends copy and digest in), and fails with
:class:`StreamError` at the first byte that is not what the stream promised.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

from drs_protocol.weights_stream import (
    MAX_STREAM_HEADER_BYTES,
    STREAM_HEADER_LENGTH_BYTES,
    STREAM_MAGIC,
    StreamTensor,
    WeightsStreamHeader,
    encode_prefix,
)
from pydantic import ValidationError

#: The pieces a receiving backend gets (and a sending one should give): 16 MiB, 16 digest chunks.
RECEIVE_PIECE_BYTES: Final = 16 * 1024 * 1024


class StreamError(ValueError):
    """The bytes are not a weights stream, or it ended early (the message says which byte)."""


@dataclass(frozen=True, slots=True)
class WeightsExport:
    """What a backend holds, ready to send: its layout and its bytes, in order."""

    tensors: tuple[StreamTensor, ...]
    pieces: AsyncIterator[bytes | memoryview]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


async def stream_body(
    header: WeightsStreamHeader, pieces: AsyncIterator[bytes | memoryview]
) -> AsyncIterator[bytes | memoryview]:
    """The stream's bytes: the prefix, then ``pieces``, which must add up to ``header.nbytes``."""
    yield encode_prefix(header)
    sent = 0
    async for piece in pieces:
        sent += len(piece)
        if sent > header.nbytes:
            raise StreamError(f"the backend gave more than the {header.nbytes} bytes it announced")
        yield piece
    if sent != header.nbytes:
        raise StreamError(f"the backend gave {sent} of the {header.nbytes} bytes it announced")


class StreamReader:
    """Reads one weights stream from ``chunks`` (an HTTP body's pieces)."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._buffer = bytearray()
        self._offset = 0  #: bytes of the stream consumed so far

    async def _fill(self, n: int, what: str) -> None:
        while len(self._buffer) < n:
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                raise StreamError(
                    f"the stream ended at byte {self._offset + len(self._buffer)}, in the {what}"
                ) from None
            self._buffer += chunk

    async def _take(self, n: int, what: str) -> bytes:
        await self._fill(n, what)
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        self._offset += n
        return out

    async def header(self) -> WeightsStreamHeader:
        magic = await self._take(len(STREAM_MAGIC), "magic")
        if magic != STREAM_MAGIC:
            raise StreamError(f"not a weights stream: it starts {magic[:32]!r}, not {STREAM_MAGIC!r}")
        length = int.from_bytes(await self._take(STREAM_HEADER_LENGTH_BYTES, "header length"), "big")
        if length > MAX_STREAM_HEADER_BYTES:
            raise StreamError(f"header: {length} bytes, more than {MAX_STREAM_HEADER_BYTES}")
        raw = await self._take(length, "header")
        try:
            return WeightsStreamHeader.model_validate_json(raw)
        except ValidationError as exc:
            raise StreamError(f"header: not a weights stream header: {exc}") from exc

    async def pieces(self, nbytes: int) -> AsyncIterator[bytes]:
        """The next ``nbytes`` of the stream, in pieces of at most :data:`RECEIVE_PIECE_BYTES`
        (each joined once from the body's chunks); the stream must end right after them."""
        left = nbytes
        held: list[bytes] = [bytes(self._buffer)] if self._buffer else []
        size = len(self._buffer)
        self._buffer = bytearray()
        while left:
            want = min(left, RECEIVE_PIECE_BYTES)
            while size < want:
                try:
                    chunk = await anext(self._chunks)
                except StopAsyncIteration:
                    raise StreamError(
                        f"the stream ended at byte {self._offset + size}: "
                        f"{nbytes - left + size} of the {nbytes} weights bytes received"
                    ) from None
                held.append(chunk)
                size += len(chunk)
            joined = held[0] if len(held) == 1 else b"".join(held)
            piece, rest = joined[:want], joined[want:]
            held, size = ([rest] if rest else []), len(rest)
            self._offset += want
            left -= want
            yield piece
        if size:
            raise StreamError(f"the stream goes on after its {nbytes} weights bytes")
        async for extra in self._chunks:
            if extra:
                raise StreamError(f"the stream goes on after its {nbytes} weights bytes")
