"""The weights digest: proof of the bytes an engine holds, over the one packed refit layout.

The layout is :mod:`drs_protocol.nemo_rl_refit`'s (the tensors in ``state_dict_info`` order, each
``prod(shape) * itemsize`` bytes, concatenated with no padding; :mod:`drs_protocol.weights_pack`).
The digest is a function of those bytes in that order and of their count, nothing else (names,
shapes and dtypes are not in it: two layouts of the same bytes digest the same).

It is built so that a GPU computes it at memory speed and gets the identical value:

1. the bytes are cut into chunks of :data:`CHUNK_BYTES` (the last one may be shorter);
2. each chunk is read as little-endian 64-bit lanes (a short last lane is padded with zero
   bytes), and its *chunk sum* is ``Σ lane[i] * LANE_WEIGHTS[i]`` modulo 2**64 — a wrapping
   ``int64`` multiply-accumulate, which is exact in any order (addition modulo 2**64 is
   associative), so a GPU's parallel reduction gives the same value as this module's loop;
   ``LANE_WEIGHTS[i]`` is SplitMix64 of ``i + 1`` made odd (so every lane matters and a swap of
   two lanes changes the sum);
3. the digest is SHA-256 over ``DIGEST_DOMAIN``, the byte count (8 bytes, little-endian) and the
   chunk sums (8 bytes each, little-endian, in order), written ``wd1:<64 hex digits>``.

Only step 2 touches every byte; step 3 hashes 8 bytes per MiB. :func:`digest_bytes` is the
reference, in pure Python (for small buffers: the sim engine's weights, tests);
:func:`digest_torch` computes the same over a flat ``uint8`` torch tensor on its own device
(the torch engine's packed weights, the example trainer's); :func:`digest_numpy` over a NumPy
buffer (checkpoint files). :class:`Digester` takes the bytes in pieces of any size.

Not a cryptographic MAC of the weights: the chunk sums are linear, so an adversary could build a
collision. It proves that a load moved the bytes it was meant to (a load that transferred
nothing, or part, or the wrong checkpoint, gives another digest), which is what it is for.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

#: Bytes per chunk: one chunk sum per MiB (the lane weights are 1 MiB of int64, cache-resident).
CHUNK_BYTES: Final = 1 << 20
LANE_BYTES: Final = 8
LANES: Final = CHUNK_BYTES // LANE_BYTES
#: The digest's name and version, first in what SHA-256 hashes and before the hex digits.
DIGEST_PREFIX: Final = "wd1:"
DIGEST_DOMAIN: Final = b"drs-weights-digest-v1\0"
DIGEST_PATTERN: Final = r"^wd1:[0-9a-f]{64}$"
_MASK: Final = (1 << 64) - 1
_DIGEST_RE: Final = re.compile(DIGEST_PATTERN)


class DigestFormatError(ValueError):
    """A digest that is not ``wd1:`` and 64 lower-case hex digits."""


def check_digest(value: str) -> str:
    """``value`` when it is a digest this module writes, else :class:`DigestFormatError`."""
    if not _DIGEST_RE.match(value):
        raise DigestFormatError(f"must be {DIGEST_PREFIX!r} followed by 64 lower-case hex digits (SHA-256)")
    return value


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@functools.cache
def lane_weights() -> tuple[int, ...]:
    """``LANE_WEIGHTS``: one odd 64-bit multiplier per lane of a chunk (unsigned)."""
    return tuple(_splitmix64(i + 1) | 1 for i in range(LANES))


def signed(value: int) -> int:
    """An unsigned 64-bit value as the ``int64`` of the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def chunk_sum(chunk: bytes | bytearray | memoryview) -> int:
    """One chunk's sum (unsigned), as in step 2: ``len(chunk) <= CHUNK_BYTES``."""
    data = bytes(chunk)
    if len(data) > CHUNK_BYTES:
        raise ValueError(f"a chunk holds at most {CHUNK_BYTES} bytes, got {len(data)}")
    if len(data) % LANE_BYTES:
        data += b"\0" * (LANE_BYTES - len(data) % LANE_BYTES)
    lanes = memoryview(data).cast("Q") if struct.pack("=Q", 1) == struct.pack("<Q", 1) else _lanes_le(data)
    return sum(a * b for a, b in zip(lanes, lane_weights(), strict=False)) & _MASK


def _lanes_le(data: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(data) // LANE_BYTES}Q", data)  # big-endian hosts


def finish(total_bytes: int, sums: Iterable[int]) -> str:
    """Step 3: the digest of ``total_bytes`` bytes whose chunk sums (any int, taken modulo 2**64)
    are ``sums``, in order."""
    h = hashlib.sha256(DIGEST_DOMAIN)
    h.update(struct.pack("<Q", total_bytes))
    for s in sums:
        h.update(struct.pack("<Q", s & _MASK))
    return DIGEST_PREFIX + h.hexdigest()


def digest_bytes(data: bytes | bytearray | memoryview) -> str:
    """The digest of ``data`` (the reference implementation; pure Python, tens of MB/s)."""
    view = memoryview(data).cast("B")
    sums = [chunk_sum(view[i : i + CHUNK_BYTES]) for i in range(0, len(view), CHUNK_BYTES)]
    return finish(len(view), sums)


class Digester:
    """The digest of bytes given in pieces of any size (a weights stream, checkpoint files)."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self._sums: list[int] = []
        self.total_bytes = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        piece = memoryview(data).cast("B")
        self.total_bytes += len(piece)
        if self._pending:
            need = CHUNK_BYTES - len(self._pending)
            self._pending += piece[:need]
            piece = piece[need:]
            if len(self._pending) < CHUNK_BYTES:
                return
            self._sums.append(chunk_sum(self._pending))
            self._pending = bytearray()
        whole = len(piece) - len(piece) % CHUNK_BYTES
        if whole:
            self._sums.extend(_sums_numpy(piece[:whole]))
        self._pending += piece[whole:]

    def hexdigest(self) -> str:
        tail = [chunk_sum(self._pending)] if self._pending else []
        return finish(self.total_bytes, [*self._sums, *tail])


def _sums_numpy(data: memoryview) -> list[int]:
    """Chunk sums of whole chunks, vectorised (NumPy's ``uint64`` arithmetic wraps modulo 2**64)."""
    import numpy as np

    lanes = np.frombuffer(data, dtype="<u8").reshape(-1, LANES)
    weights = np.array(lane_weights(), dtype=np.uint64)
    with np.errstate(over="ignore"):
        return [int(v) for v in (lanes * weights).sum(axis=1, dtype=np.uint64)]


def digest_numpy(data: bytes | bytearray | memoryview) -> str:
    """:func:`digest_bytes` at NumPy speed (the same value)."""
    digester = Digester()
    digester.update(data)
    return digester.hexdigest()


def checkpoint_order(path: str | Path) -> list[Path]:
    """A file, or every file under a directory in the order of their relative POSIX paths."""
    root = Path(path)
    if root.is_file():
        return [root]
    return sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def digest_files(path: str | Path, *, piece_bytes: int = 16 * CHUNK_BYTES) -> str:
    """The digest of a file's bytes, or of a directory's files' bytes one after the other (in
    :func:`checkpoint_order`): the layout of the ``sim`` engine's weights. ``OSError`` when a file
    cannot be read."""
    digester = Digester()
    for file in checkpoint_order(path):
        with Path(file).open("rb") as fh:
            while piece := fh.read(piece_bytes):
                digester.update(piece)
    return digester.hexdigest()


#: Rows of chunks multiplied at once on a torch device (bounds the temporary to 16 MiB).
TORCH_ROWS_PER_STEP: Final = 16


def digest_torch(flat: Any) -> str:
    """The digest of a flat ``uint8`` torch tensor, computed on its device (the torch engine's
    packed weights; the trainer's packed buffer). The same value as :func:`digest_bytes` over
    ``flat``'s bytes: ``int64`` multiply and sum wrap modulo 2**64 on CPU and CUDA alike. One
    host sync at the end (the chunk sums, 8 bytes per MiB)."""
    import torch

    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("digest_torch: needs a flat uint8 tensor")
    sums = _torch_sums(flat)
    return finish(int(flat.numel()), torch.cat(sums).cpu().tolist() if sums else [])


def digest_torch_tensors(tensors: Iterable[Any]) -> str:
    """The digest of tensors in layout order (each one's bytes, no padding), for weights not held
    in one packed buffer: their bytes go through one staging buffer on their device."""
    import torch

    sums: list[Any] = []
    total = 0
    staging: Any = None
    filled = 0
    for tensor in tensors:
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        if staging is None:
            staging = torch.empty(CHUNK_BYTES * TORCH_ROWS_PER_STEP, dtype=torch.uint8, device=raw.device)
        n = int(raw.numel())
        total += n
        offset = 0
        while offset < n:
            take = min(n - offset, int(staging.numel()) - filled)
            staging[filled : filled + take] = raw[offset : offset + take]
            filled += take
            offset += take
            if filled == staging.numel():
                sums.extend(_torch_sums(staging.clone()))
                filled = 0
    if filled:
        sums.extend(_torch_sums(staging[:filled].clone()))
    return finish(total, torch.cat(sums).cpu().tolist() if sums else [])


class TorchDigester:
    """The digest of ``uint8`` torch tensors given one after the other (in layout order), on their
    device: whole chunks are summed where they lie, a piece shorter than a chunk waits for the next
    (the ``trtllm`` worker extension digests each batch as it hands it to the engine)."""

    def __init__(self) -> None:
        self._sums: list[Any] = []
        self._pending: Any = None
        self.total_bytes = 0

    def update(self, flat: Any) -> None:
        import torch

        piece = flat.detach().reshape(-1).view(torch.uint8)
        self.total_bytes += int(piece.numel())
        if self._pending is not None:
            need = CHUNK_BYTES - int(self._pending.numel())
            self._pending = torch.cat([self._pending, piece[:need]])
            piece = piece[need:]
            if self._pending.numel() < CHUNK_BYTES:
                return
            self._sums.extend(_torch_sums(self._pending))
            self._pending = None
        whole = int(piece.numel()) - int(piece.numel()) % CHUNK_BYTES
        if whole:
            self._sums.extend(_torch_sums(piece[:whole]))
        if whole < piece.numel():
            self._pending = piece[whole:].clone()

    def hexdigest(self) -> str:
        import torch

        sums = [*self._sums, *(_torch_sums(self._pending) if self._pending is not None else [])]
        return finish(self.total_bytes, torch.cat(sums).cpu().tolist() if sums else [])


def _torch_sums(flat: Any) -> list[Any]:
    """``flat``'s chunk sums as ``int64`` tensors on its device, in order (none for no bytes)."""
    import torch

    total = int(flat.numel())
    weights = _torch_weights(str(flat.device))
    whole = total // CHUNK_BYTES
    sums: list[Any] = []
    if whole:
        rows = flat[: whole * CHUNK_BYTES]
        if rows.storage_offset() % LANE_BYTES or not rows.is_contiguous():
            rows = rows.clone()  # a view as int64 needs a contiguous, 8-byte aligned start
        lanes = rows.view(torch.int64).view(whole, LANES)
        for start in range(0, whole, TORCH_ROWS_PER_STEP):
            block = lanes[start : start + TORCH_ROWS_PER_STEP]
            sums.append(torch.mul(block, weights).sum(dim=1, dtype=torch.int64))
    rest = total - whole * CHUNK_BYTES
    if rest:
        tail = torch.zeros(-(-rest // LANE_BYTES) * LANE_BYTES, dtype=torch.uint8, device=flat.device)
        tail[:rest] = flat[whole * CHUNK_BYTES :]
        lanes = tail.view(torch.int64)
        sums.append(torch.mul(lanes, weights[: lanes.numel()]).sum(dtype=torch.int64).reshape(1))
    return sums


@functools.cache
def _torch_weights(device: str) -> Any:
    import torch

    return torch.tensor([signed(w) for w in lane_weights()], dtype=torch.int64, device=device)
