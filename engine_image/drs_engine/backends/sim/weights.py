"""The ``sim`` backend's "weights" (part of the test double): a version name and a content hash.

A load names a path that must exist and be readable (a file, or a directory of files); its
content hash and the version string seed the token function, so new weights give new tokens.
Each file contributes its relative path, its size and at most :data:`MAX_HASHED_BYTES_PER_FILE`
of its bytes (a multi-GB checkpoint is fingerprinted, not read whole).

The weights digest (:mod:`drs_protocol.weights_digest`) of sim weights: a sim engine's "tensors"
are its checkpoint's files, in the order of their relative paths, each its whole bytes
(:func:`drs_protocol.weights_digest.digest_files`, which a trainer computes over what it wrote); the
weights a sim engine starts with are one "tensor", the model label's UTF-8 bytes.

To a peer catching up (:mod:`drs_engine.weights.stream`) a sim engine sends the same layout: each
file one ``uint8`` tensor named by its relative path (a checkpoint that is one file: its name), read
from where it loaded them; weights it received from a peer it keeps in memory
(:attr:`SimWeights.parts`) and sends from there. The receiver's content hash is the one a path load
of those files gives (names, sizes, bytes), so it generates the peer's tokens.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from drs_protocol.weights_digest import CHUNK_BYTES, Digester, checkpoint_order, digest_bytes

from drs_engine.backends.sim.model import weights_seed
from drs_engine.errors import WeightsLoadError

MAX_HASHED_BYTES_PER_FILE: Final = 64 * 1024 * 1024
#: Bytes read at once: a whole number of digest chunks (the digest sums them without copying).
_PIECE: Final = 16 * CHUNK_BYTES


@dataclass(frozen=True, slots=True)
class SimWeights:
    version: str
    content_hash: bytes
    source: str
    digest: str  #: :mod:`drs_protocol.weights_digest` of the weights' bytes
    #: What the weights are, to send to a peer: ``(name, bytes)`` received from one (None: read
    #: from ``source``; ``loaded`` False: the model label itself).
    parts: tuple[tuple[str, bytes], ...] | None = None
    loaded: bool = False

    @property
    def seed(self) -> bytes:
        return weights_seed(self.version, self.content_hash)


def initial_weights(model_path: str, version: str) -> SimWeights:
    """The weights a sim engine starts with: keyed by the model label (the path need not exist)."""
    return SimWeights(
        version=version,
        content_hash=hashlib.blake2b(model_path.encode()).digest(),
        source=model_path,
        digest=digest_bytes(model_path.encode()),
    )


def read_weights_path(path: str) -> tuple[bytes, str]:
    """The content hash and the weights digest of a weights file or directory, each file read
    once (in :func:`~drs_protocol.weights_digest.checkpoint_order`, the order a peer sends them, so
    a stream of the same files gives the same hash); :class:`WeightsLoadError` saying why not."""
    root = Path(path)
    if not root.exists():
        raise WeightsLoadError(f"weights path {path!r} does not exist", param="path")
    if not os.access(root, os.R_OK):
        raise WeightsLoadError(f"weights path {path!r} is not readable", param="path")
    if not (root.is_file() or root.is_dir()):
        raise WeightsLoadError(f"weights path {path!r} is neither a file nor a directory", param="path")
    try:
        files = checkpoint_order(root)
    except OSError as exc:
        raise WeightsLoadError(f"cannot read weights path {path!r}: {exc.strerror or exc}", param="path") from exc
    if not files:
        raise WeightsLoadError(f"weights directory {path!r} holds no files", param="path")
    hasher, digester = content_hasher(), Digester()
    for file in files:
        _read_file(hasher, digester, file, root.name if file == root else file.relative_to(root).as_posix())
    return hasher.digest(), digester.hexdigest()


def hash_weights_path(path: str) -> bytes:
    """Content hash of a weights file or directory; raises :class:`WeightsLoadError` saying why not."""
    return read_weights_path(path)[0]


def content_hasher() -> hashlib.blake2b:
    """The content hash :func:`hash_weights_path` computes, to feed file by file
    (:func:`hash_file_start`, then at most :data:`MAX_HASHED_BYTES_PER_FILE` of its bytes)."""
    return hashlib.blake2b()


def hash_file_start(digest: hashlib.blake2b, name: str, size: int) -> None:
    digest.update(f"{name}\0{size}\0".encode())


def _read_file(hasher: hashlib.blake2b, digester: Digester, file: Path, name: str) -> None:
    """One file into the content hash (its name, size and first :data:`MAX_HASHED_BYTES_PER_FILE`)
    and into the digest (all of it)."""
    try:
        hash_file_start(hasher, name, file.stat().st_size)
        hashed = 0
        with file.open("rb") as fh:
            while chunk := fh.read(_PIECE):
                digester.update(chunk)
                if hashed < MAX_HASHED_BYTES_PER_FILE:
                    hasher.update(chunk[: MAX_HASHED_BYTES_PER_FILE - hashed])
                    hashed += len(chunk)
    except OSError as exc:
        raise WeightsLoadError(f"cannot read weights file {str(file)!r}: {exc.strerror or exc}", param="path") from exc
