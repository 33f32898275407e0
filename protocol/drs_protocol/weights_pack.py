"""The ``torch`` backend's refit group contract, over the one packed layout every refit uses.

Layout: :mod:`drs_protocol.nemo_rl_refit` (NeMo RL's): the tensors of ``state_dict_info`` in its
order, each ``prod(shape) * itemsize`` bytes, concatenated with no padding; cut into batches that
close right after their size first exceeds a target. Every batch is therefore one contiguous byte
range of that one concatenation (:func:`batch_ranges`), and the same trainer refits ``trtllm``
engines (NeMo RL's broadcast) and ``torch`` engines (broadcast, or CUDA IPC when colocated) alike.

The collective group forms over a ``torch.distributed`` TCPStore that the trainer (rank 0) hosts at
the ``ip:port`` it gives the sidecar. Before the engines join, the trainer writes into it:

- :data:`STORE_KEY_BACKEND`: ``nccl`` (GPU to GPU; every rank on its own GPU) or ``gloo`` (host
  memory; for a test fleet with more ranks than GPUs: NCCL refuses two ranks on one GPU);
- :data:`STORE_KEY_TARGET_BYTES`: the batches' target size in bytes (NeMo RL derives it from the
  GPU's memory, :func:`~drs_protocol.nemo_rl_refit.target_packed_bytes`; the store carries it so
  ranks on different GPUs, or on the CPU, agree).

Each engine writes :data:`STORE_KEY_WORLD_SIZE` (the ``world_size`` the sidecar gave it), which the
trainer waits for. Once joined, every rank takes part in one probe broadcast (one float32 from
rank 0), so the communicator exists before the first update. ``update`` broadcasts each batch as
one flat ``uint8`` buffer from rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from drs_protocol.nemo_rl_refit import Slot, TensorSpec, packed_batches

STORE_KEY_BACKEND: Final = "drs/refit/backend"
STORE_KEY_TARGET_BYTES: Final = "drs/refit/target_packed_bytes"
STORE_KEY_WORLD_SIZE: Final = "drs/refit/world_size"
#: The process groups' own keys live under this prefix of the store.
STORE_PREFIX: Final = "drs-refit"
REFIT_BACKENDS: Final = ("nccl", "gloo")
#: The example trainer's default batch target (NeMo RL's on a 141 GB GPU is 2.8 GB).
DEFAULT_TARGET_BYTES: Final = 1 << 30


def flat_slots(specs: Sequence[TensorSpec]) -> list[Slot]:
    """Every tensor's byte offset in the one concatenation (no padding)."""
    slots: list[Slot] = []
    offset = 0
    for spec in specs:
        slots.append(Slot(spec, offset))
        offset += spec.nbytes
    return slots


def batch_ranges(specs: Sequence[TensorSpec], target_bytes: int) -> list[tuple[int, int, list[Slot]]]:
    """The batches as ``(start, end, slots)``: byte ranges of the one concatenation, consecutive
    and covering it, with each slot's offset relative to its batch's start."""
    if target_bytes < 1:
        raise ValueError("target_bytes: must be at least 1")
    ranges: list[tuple[int, int, list[Slot]]] = []
    start = 0
    for batch in packed_batches(specs, target_bytes):
        end = start + sum(slot.spec.nbytes for slot in batch)
        ranges.append((start, end, batch))
        start = end
    return ranges
