"""The collective refit's wire contract between a trainer and the ``torch`` engines.

A refit group forms over a ``torch.distributed`` TCPStore that the trainer (rank 0) hosts at the
``ip:port`` it gives the sidecar. Before the engines join, the trainer writes into that store:

- :data:`STORE_KEY_BACKEND`: ``nccl`` (GPU to GPU; every rank on its own GPU) or ``gloo``
  (host memory; for a test fleet with more ranks than GPUs: NCCL refuses two ranks on one GPU);
- :data:`STORE_KEY_BUCKET_BYTES`: the packing bucket size, in bytes.

Each engine writes :data:`STORE_KEY_WORLD_SIZE` (the ``world_size`` the sidecar gave it), which
the trainer waits for: it learns the group's size from the sidecar's ranks, not by counting.
Once joined, every rank takes part in one probe broadcast (one float32 from rank 0), so the
communicator exists before the first update.

``prepare`` names the tensors: ``state_dict_info`` maps each name to ``[shape, dtype]`` (NeMo RL's
``(shape, dtype)`` pair as JSON; ``dtype`` like ``"bfloat16"`` or ``"torch.bfloat16"``). ``update``
receives them packed, as NeMo RL packs them: both sides walk ``state_dict_info`` in its order and
cut it into buckets with :func:`plan_buckets`; the trainer broadcasts each bucket as one flat
``uint8`` buffer from rank 0, and every engine slices the same buffer back into tensors. One large
broadcast per bucket runs near link speed, where one broadcast per parameter does not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

STORE_KEY_BACKEND: Final = "drs/refit/backend"
STORE_KEY_BUCKET_BYTES: Final = "drs/refit/bucket_bytes"
STORE_KEY_WORLD_SIZE: Final = "drs/refit/world_size"
#: The process groups' own keys live under this prefix of the store.
STORE_PREFIX: Final = "drs-refit"
REFIT_BACKENDS: Final = ("nccl", "gloo")
DEFAULT_BUCKET_BYTES: Final = 1 << 30
#: Each tensor starts at a multiple of this many bytes inside its bucket (any dtype can view it).
ALIGN_BYTES: Final = 256
DTYPE_BYTES: Final = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1, "int32": 4}


class PackError(ValueError):
    """``state_dict_info`` is malformed (names the tensor and the rule)."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  #: a key of DTYPE_BYTES

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one tensor lies in a bucket."""

    spec: TensorSpec
    offset: int


@dataclass(frozen=True, slots=True)
class Bucket:
    slots: tuple[Slot, ...]
    nbytes: int


def parse_state_dict_info(info: Mapping[str, Any]) -> list[TensorSpec]:
    """``{name: [shape, dtype]}`` (or ``{name: {"shape", "dtype"}}``) as specs, in the mapping's order."""
    specs: list[TensorSpec] = []
    for name, entry in info.items():
        if isinstance(entry, Mapping):
            shape, dtype = entry.get("shape"), entry.get("dtype")
        elif isinstance(entry, Sequence) and not isinstance(entry, str) and len(entry) == 2:
            shape, dtype = entry
        else:
            raise PackError(f"state_dict_info.{name}: expected [shape, dtype] or {{shape, dtype}}")
        if not isinstance(shape, Sequence) or isinstance(shape, str) or not all(isinstance(d, int) for d in shape):
            raise PackError(f"state_dict_info.{name}: shape must be a list of integers")
        if any(d < 0 for d in shape):
            raise PackError(f"state_dict_info.{name}: shape has a negative dimension")
        key = str(dtype).removeprefix("torch.")
        if key not in DTYPE_BYTES:
            raise PackError(f"state_dict_info.{name}: dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        specs.append(TensorSpec(str(name), tuple(int(d) for d in shape), key))
    return specs


def _aligned(offset: int) -> int:
    return (offset + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Cut ``specs`` (in order) into buckets of at most ``bucket_bytes`` each; a tensor larger than
    that gets a bucket of its own. Both sides of a broadcast compute the same plan."""
    if bucket_bytes < 1:
        raise PackError("bucket_bytes: must be at least 1")
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    used = 0
    for spec in specs:
        start = _aligned(used)
        if slots and start + spec.nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(slots), used))
            slots, start = [], 0
        slots.append(Slot(spec, start))
        used = start + spec.nbytes
    if slots:
        buckets.append(Bucket(tuple(slots), used))
    return buckets
