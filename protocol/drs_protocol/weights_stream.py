"""Weights from a serving peer engine: the stream one engine sends and another loads, and what an
engine says while it is not at the fleet's desired weights yet.

**Who sends.** An engine that starts while the fleet desires weights with no checkpoint path
(they came by broadcast or CUDA IPC) asks the fleet's serving engines, one after the other, for
what they hold: ``GET`` :data:`drs_protocol.routes.CONTROL_WEIGHTS_STREAM` with the fleet's
control token. The peers are the engines the operator observed holding the desired digest; it
puts their base URLs in the fleet's weights ConfigMap (key :data:`drs_protocol.env.WEIGHTS_PEERS_KEY`),
which every engine pod mounts at :data:`WEIGHTS_MOUNT_PATH` (:data:`drs_protocol.env.WEIGHTS_DIR`)
and reads again on every catch-up attempt, so peers placed after the engine started are asked too;
:data:`drs_protocol.env.WEIGHTS_PEERS_JSON` (read at its start) is the fallback where no file is
mounted (:class:`WeightsPeers`, the same JSON in both).

**The stream** (``application/vnd.drs.weights-stream``, with a ``content-length``):
:data:`STREAM_MAGIC`, the header's length as 4 big-endian bytes, the header
(:class:`WeightsStreamHeader`, JSON, at most :data:`MAX_STREAM_HEADER_BYTES`), then the weights'
bytes in the one refit layout (:mod:`drs_protocol.weights_pack`: the header's tensors in order,
each ``prod(shape) * itemsize`` bytes, no padding; ``nbytes`` in all). The header's ``digest`` is
the sender's measured :mod:`drs_protocol.weights_digest` of exactly those bytes; the receiver
computes it again over what arrived and loads nothing unless both agree with the desired digest.

**While not there yet** an engine is up but not ready: ``GET /health`` and every turn answer 503
with the error type :data:`drs_protocol.lifecycle.WEIGHTS_PENDING_ERROR_TYPE` and the reason; ``GET /control/weights``
carries :class:`drs_protocol.control.CatchUpStatus` (``catch_up``) saying what it tries, how often it failed and why.
"""

from __future__ import annotations

import json
import math
from typing import Final

from pydantic import BaseModel, ConfigDict, Field, RootModel, model_validator

from drs_protocol.control import Digest, Version
from drs_protocol.nemo_rl_refit import DTYPE_ITEMSIZE, TensorSpec

#: The first bytes of a weights stream (its format's version is in it).
STREAM_MAGIC: Final = b"drs-weights-stream-1\n"
#: Bytes of the header's length, big-endian, after the magic.
STREAM_HEADER_LENGTH_BYTES: Final = 4
#: The longest header an engine reads (a model of ~100k tensors fits).
MAX_STREAM_HEADER_BYTES: Final = 16 * 1024 * 1024
#: The stream's media type.
STREAM_MEDIA_TYPE: Final = "application/vnd.drs.weights-stream"
#: The most peers an engine is given (it tries them in order).
MAX_WEIGHTS_PEERS: Final = 64
#: Where engine pods mount the fleet's weights ConfigMap (its keys as files).
WEIGHTS_MOUNT_PATH: Final = "/etc/drs/weights"


class StreamTensor(BaseModel):
    """One tensor of the stream's layout (a ``sim`` engine's: one checkpoint file, ``uint8``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=4096)
    shape: tuple[int, ...] = Field(max_length=16)
    dtype: str

    @model_validator(mode="after")
    def _known(self) -> StreamTensor:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(sorted(DTYPE_ITEMSIZE))}")
        if any(d < 0 for d in self.shape):
            raise ValueError("shape: dimensions must be >= 0")
        return self

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]

    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.shape, self.dtype)


class WeightsStreamHeader(BaseModel):
    """What the stream's bytes are: the sender's version and measured digest, the tensors in
    layout order, and their byte count (the sum of the tensors')."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Version
    digest: Digest
    backend: str
    nbytes: int = Field(ge=0)
    tensors: tuple[StreamTensor, ...]

    @model_validator(mode="after")
    def _adds_up(self) -> WeightsStreamHeader:
        total = sum(t.nbytes for t in self.tensors)
        if total != self.nbytes:
            raise ValueError(f"nbytes: {self.nbytes} is not the tensors' {total} bytes")
        return self


def encode_prefix(header: WeightsStreamHeader) -> bytes:
    """The bytes before the weights: magic, header length, header."""
    raw = header.model_dump_json().encode()
    if len(raw) > MAX_STREAM_HEADER_BYTES:
        raise ValueError(f"header: {len(raw)} bytes, more than {MAX_STREAM_HEADER_BYTES}")
    return STREAM_MAGIC + len(raw).to_bytes(STREAM_HEADER_LENGTH_BYTES, "big") + raw


def stream_length(header: WeightsStreamHeader) -> int:
    """The whole stream's byte count (its ``content-length``)."""
    return len(encode_prefix(header)) + header.nbytes


class WeightsPeers(RootModel[tuple[str, ...]]):
    """:data:`drs_protocol.env.WEIGHTS_PEERS_JSON`: the base URLs (``http://host:port``) of the
    engines that held the desired weights when the pod started, in the order to try them."""

    root: tuple[str, ...] = Field(max_length=MAX_WEIGHTS_PEERS)

    @model_validator(mode="after")
    def _urls(self) -> WeightsPeers:
        for url in self.root:
            if not url.startswith(("http://", "https://")) or len(url) > 2048:
                raise ValueError(f"peer {url!r}: must be an http:// or https:// base URL")
        return self

    def dump(self) -> str:
        return json.dumps(list(self.root), separators=(",", ":"))
