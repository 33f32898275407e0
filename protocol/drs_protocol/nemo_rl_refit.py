"""NeMo RL's collective-refit wire layout, as the trtllm engines receive it (pure arithmetic).

The contract is between NeMo RL's trainer (external) and this project's TensorRT-LLM worker
extension (``drs_engine.trtllm_worker``); the engine validates ``state_dict_info`` with it too.
It is NOT :mod:`drs_protocol.weights_pack` (the ``torch`` backend's own refit: 256-byte aligned
slots, bucket size and backend from the trainer's store): NeMo RL's collective path packs with no
padding and sizes batches from the GPU's memory, as below.

NeMo RL's non-colocated refit (``nemo_rl/utils/packed_tensor.py``, ``stateless_process_group.py``
at the commit in ``trtllm/surface.json``) broadcasts the weights as packed ``uint8`` buffers:

* ranks: the trainer holds ``0 … train_world_size-1``; an engine worker's rank is
  ``train_world_size + rank_prefix + local_rank`` (the sidecar computes ``rank_prefix``);
* order: tensors in ``state_dict_info`` order, each ``prod(shape) * itemsize`` bytes, concatenated
  with no padding;
* batches: a batch closes right after its size first exceeds the target, so every batch but the
  last is larger than the target; the target is ``min(int(total_gpu_memory * ratio), 5 GiB)`` with
  ``ratio`` from ``NRL_REFIT_BUFFER_MEMORY_RATIO`` (default 0.02) — sender and receiver must agree.

Consumer and producer compute the same batches from the same ``state_dict_info``; these functions
are that computation, kept free of torch so CI checks it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

#: Bytes per element of the dtypes a checkpoint may carry (torch names).
DTYPE_ITEMSIZE: Final = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
_ALIASES: Final = {"float": "float32", "half": "float16", "double": "float64", "long": "int64", "int": "int32"}
MAX_TARGET_BYTES: Final = 5 * 1024**3
DEFAULT_MEMORY_RATIO: Final = 0.02
MEMORY_RATIO_ENV: Final = "NRL_REFIT_BUFFER_MEMORY_RATIO"


class RefitSpecError(ValueError):
    """A ``state_dict_info`` entry (named in the message) is not ``[shape, dtype]``."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  #: torch name, e.g. ``bfloat16`` (the worker turns it into ``torch.bfloat16``)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class Slot:
    """One tensor inside a packed batch: ``buffer[offset : offset + nbytes]``."""

    spec: TensorSpec
    offset: int


def dtype_name(value: Any) -> str:
    """``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bfloat16"`` / ``"bf16"`` -> ``"bfloat16"``."""
    text = str(value).strip().lower().removeprefix("torch.")
    text = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(text, text)
    text = _ALIASES.get(text, text)
    if text not in DTYPE_ITEMSIZE:
        raise RefitSpecError(f"unknown dtype {value!r} (one of {', '.join(sorted(DTYPE_ITEMSIZE))})")
    return text


def parse_state_dict_info(info: Mapping[str, Any]) -> list[TensorSpec]:
    """``{name: [shape, dtype]}`` (JSON from the trainer) -> specs in the order given."""
    specs: list[TensorSpec] = []
    for name, entry in info.items():
        if not isinstance(entry, Sequence) or isinstance(entry, str) or len(entry) != 2:
            raise RefitSpecError(f"state_dict_info[{name!r}]: must be [shape, dtype]")
        shape, dtype = entry
        if not isinstance(shape, Sequence) or isinstance(shape, str):
            raise RefitSpecError(f"state_dict_info[{name!r}]: shape must be a list of ints")
        dims = tuple(shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise RefitSpecError(f"state_dict_info[{name!r}]: shape must be non-negative ints, got {list(dims)}")
        try:
            specs.append(TensorSpec(name, dims, dtype_name(dtype)))
        except RefitSpecError as exc:
            raise RefitSpecError(f"state_dict_info[{name!r}]: {exc}") from exc
    return specs


def target_packed_bytes(total_memory_bytes: int, ratio: float | None = None) -> int:
    """NeMo RL's ``get_target_packed_tensor_size`` for a GPU of ``total_memory_bytes``."""
    if ratio is None:
        ratio = float(os.environ.get(MEMORY_RATIO_ENV, DEFAULT_MEMORY_RATIO))
    return min(int(total_memory_bytes * ratio), MAX_TARGET_BYTES)


def packed_batches(specs: Iterable[TensorSpec], target_bytes: int) -> list[list[Slot]]:
    """The broadcast batches, as ``packed_broadcast_consumer`` forms them."""
    batches: list[list[Slot]] = []
    current: list[Slot] = []
    size = 0
    for spec in specs:
        current.append(Slot(spec, size))
        size += spec.nbytes
        if size > target_bytes:
            batches.append(current)
            current, size = [], 0
    if current:
        batches.append(current)
    return batches


def batch_bytes(batch: Sequence[Slot]) -> int:
    return sum(slot.spec.nbytes for slot in batch)


def worker_rank(train_world_size: int, rank_prefix: int, local_rank: int) -> int:
    """A worker's rank in the trainer's NCCL group (NeMo RL's ``init_collective``)."""
    if train_world_size < 1 or rank_prefix < 0 or local_rank < 0:
        raise ValueError("train_world_size >= 1, rank_prefix >= 0 and local_rank >= 0 are required")
    return train_world_size + rank_prefix + local_rank


def checkpoint_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint (a directory, or one file), sorted."""
    root = Path(path)
    if root.is_file():
        if root.suffix != ".safetensors":
            raise FileNotFoundError(f"{root}: not a .safetensors file")
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such checkpoint file or directory")
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix == ".safetensors")
    if not files:
        raise FileNotFoundError(f"{root}: no .safetensors files")
    return files
