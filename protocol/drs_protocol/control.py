"""Request bodies of the engine control API: the sidecar builds them, the engine validates them.

Routes and operation names: :mod:`drs_protocol.routes` (:class:`~drs_protocol.routes.ControlOp`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from drs_protocol.limits import MAX_WEIGHTS_VERSION_CHARS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoadWeights(_Strict):
    """Load weights from a path (a checkpoint directory or file) and serve them as ``version``."""

    path: str = Field(min_length=1)
    version: str = Field(min_length=1, max_length=MAX_WEIGHTS_VERSION_CHARS)


class CollectiveInit(_Strict):
    """NeMo RL's ``init_collective``: join the trainer's NCCL group for weight broadcasts."""

    rank_prefix: int = Field(ge=0)
    ip: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=1)
    train_world_size: int = Field(ge=1)


class PrepareRefitInfo(_Strict):
    """NeMo RL's ``prepare_refit_info``: names, shapes and dtypes of the tensors to come."""

    state_dict_info: dict[str, Any]


class CollectiveUpdate(_Strict):
    """NeMo RL's ``update_weights_from_collective``, then serve the result as ``version``."""

    version: str = Field(min_length=1, max_length=MAX_WEIGHTS_VERSION_CHARS)
    drain: bool = True
    recompute_kv: bool = False


class IpcBuffer(_Strict):
    """One packed weights buffer a colocated trainer shares by CUDA IPC: ``nbytes`` bytes of the
    packed layout (:mod:`drs_protocol.nemo_rl_refit`) from byte ``offset`` on, on the GPU
    ``gpu_uuid``. ``ipc``: the CUDA IPC fields of the buffer (handle, sizes, reference counter,
    event; plain base64/ints, never a pickle), as the engine's ``backends.torch.ipc.ipc_export`` writes them."""

    gpu_uuid: str = Field(min_length=1)
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    ipc: dict[str, Any]


class IpcUpdate(_Strict):
    """The colocated refit (NeMo RL's colocated path: the trainer on the engines' GPUs shares its
    packed weight buffers by CUDA IPC handles): copy the tensors of ``state_dict_info``, packed in
    that order with no padding, out of ``buffers`` into the engine's weights; serve them as
    ``version``. The trainer keeps the buffers alive and unchanged until the call returns."""

    version: str = Field(min_length=1, max_length=MAX_WEIGHTS_VERSION_CHARS)
    state_dict_info: dict[str, Any]
    buffers: list[IpcBuffer] = Field(min_length=1)


class MemoryTags(_Strict):
    """Memory to release (sleep) or resume (wake); empty means every tag (TensorRT-LLM's tags:
    ``model``, ``kv_cache``, ``sampler``, ``drafter``, … — any string is accepted)."""

    tags: list[str] = Field(default_factory=list)
