"""What a ``trtllm`` engine keeps so a peer can catch up from it: the trainer-layout bytes of its
last collective update or peer load, in a file.

TensorRT-LLM fuses and re-lays the parameters it is handed, so the engine cannot read the
trainer's layout back from the model. Instead the worker extension writes what a collective
update received to :meth:`Retained.file` as it receives it (``retain_to``), and a peer's stream
is written to :meth:`Retained.incoming` before the workers load it from there. Either way the
bytes are in the one refit layout (``drs_protocol.weights_stream``) and their digest is the one
the workers report. A path load keeps nothing (a peer loads the path itself), and nothing is
exported unless the file's layout and digest are those of the weights held now (:meth:`export`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drs_protocol import env
from drs_protocol.nemo_rl_refit import parse_state_dict_info
from drs_protocol.weights_digest import Digester
from drs_protocol.weights_stream import StreamTensor, WeightsStreamHeader

from drs_engine.errors import NotSupportedError, WeightsLoadError
from drs_engine.weights.stream import RECEIVE_PIECE_BYTES, WeightsExport

#: The kept bytes, and a peer's stream while it arrives.
KEPT_NAME = "weights.bin"
INCOMING_NAME = "incoming.bin"


def retain_dir() -> Path:
    """:data:`drs_protocol.env.WEIGHTS_RETAIN_DIR`, else ``<TMPDIR>/drs-weights``."""
    return Path(os.environ.get(env.WEIGHTS_RETAIN_DIR) or Path(tempfile.gettempdir()) / "drs-weights")


@dataclass(frozen=True, slots=True)
class _Kept:
    tensors: tuple[StreamTensor, ...]
    digest: str


class Retained:
    """The engine's kept copy: where it lives, and which weights it is a copy of."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._kept: _Kept | None = None
        #: why nothing can be streamed now (None while a copy is kept)
        self.missing = "the engine holds the weights it started with: peers load those from the model path"

    @property
    def file(self) -> Path:
        return self.directory / KEPT_NAME

    @property
    def incoming(self) -> Path:
        return self.directory / INCOMING_NAME

    def prepare(self) -> str:
        """Before an update: forget the copy (it stops being the weights held) and make room;
        the path the workers write the new one to."""
        self._kept = None
        self.missing = "the last weights update did not finish keeping a copy"
        self.directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.file.unlink()
        return str(self.file)

    def after_path_load(self) -> None:
        self._kept = None
        self.missing = "the engine's weights came from a checkpoint path: peers load that path themselves"
        with contextlib.suppress(FileNotFoundError):
            self.file.unlink()

    def kept(self, state_dict_info: dict[str, Any], digest: str | None) -> None:
        """After a collective update: the workers wrote :attr:`file` (or could not: see their log)."""
        if digest is None or not self.file.is_file():
            self.missing = f"the workers kept no copy of the last update at {self.file} (see the engine's log)"
            return
        tensors = tuple(
            StreamTensor(name=s.name, shape=s.shape, dtype=s.dtype) for s in parse_state_dict_info(state_dict_info)
        )
        size = self.file.stat().st_size
        if size != sum(t.nbytes for t in tensors):
            self.missing = (
                f"the copy at {self.file} has {size} bytes, not the update's {sum(t.nbytes for t in tensors)}"
            )
            return
        self._kept = _Kept(tensors, digest)

    def adopt_incoming(self, header: WeightsStreamHeader) -> None:
        """After a peer load from :attr:`incoming`: it is the copy now."""
        os.replace(self.incoming, self.file)
        self._kept = _Kept(header.tensors, header.digest)

    def export(self, digest: str | None) -> WeightsExport:
        """The kept copy, to send, when it is the weights held now (``digest``)."""
        kept = self._kept
        if kept is None:
            raise NotSupportedError(f"the trtllm backend has no copy of its weights to stream: {self.missing}")
        if digest != kept.digest:
            raise NotSupportedError(
                f"the trtllm backend's kept copy ({kept.digest}) is not the weights it holds ({digest})"
            )
        handle = self.file.open("rb")  # opened now: a later update replaces the file, not these bytes
        return WeightsExport(kept.tensors, _pieces(handle))

    async def receive(self, header: WeightsStreamHeader, pieces: AsyncIterator[bytes]) -> dict[str, Any]:
        """Write the stream to :attr:`incoming`, checking its digest is the header's; the layout as
        ``state_dict_info`` for the workers (:class:`WeightsLoadError` when the bytes are other)."""
        info: dict[str, Any] = {t.name: [list(t.shape), t.dtype] for t in header.tensors}
        if len(info) != len(header.tensors):
            raise WeightsLoadError("the peer's layout names a tensor twice")
        self.directory.mkdir(parents=True, exist_ok=True)
        digester = Digester()
        try:
            with self.incoming.open("wb") as fh:
                async for piece in pieces:
                    digester.update(piece)
                    await asyncio.to_thread(fh.write, piece)
        except OSError as exc:
            self.incoming.unlink(missing_ok=True)
            raise WeightsLoadError(f"cannot write the peer's weights to {self.incoming}: {exc}") from exc
        got = digester.hexdigest()
        if got != header.digest:
            self.incoming.unlink(missing_ok=True)
            raise WeightsLoadError(f"the peer's bytes have digest {got}, not the announced {header.digest}")
        return info


async def _pieces(handle: Any) -> AsyncIterator[bytes | memoryview]:
    with handle:
        while piece := await asyncio.to_thread(handle.read, RECEIVE_PIECE_BYTES):
            yield piece
