"""The ``torch`` backend's collective refit: join the trainer's group, receive packed weights.

NeMo RL's non-colocated refit, on ``torch.distributed``: ``init`` connects to the TCPStore the
trainer hosts at ``ip:port``, reads the group's backend and bucket size from it
(:mod:`drs_protocol.weights_pack`), and joins as rank ``train_world_size + rank_prefix``;
``prepare`` checks the announced tensors against the model; ``update`` receives each bucket by
broadcast from rank 0 and copies the tensors out of it. The group is a process group object of
its own (never the default group), so a later ``init`` replaces it cleanly.

Every function here blocks (a collective waits for every rank): the backend runs them on its GPU
worker thread.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

import torch
import torch.distributed as dist
from drs_protocol.weights_pack import (
    REFIT_BACKENDS,
    STORE_KEY_BACKEND,
    STORE_KEY_BUCKET_BYTES,
    STORE_KEY_WORLD_SIZE,
    STORE_PREFIX,
    Bucket,
    PackError,
    TensorSpec,
    parse_state_dict_info,
    plan_buckets,
)

from drs_engine.backends.torch_model import DTYPES
from drs_engine.errors import BadRequestError, WeightsLoadError

#: How long joining the group, and each broadcast, may wait for the other ranks.
GROUP_TIMEOUT: Final = timedelta(seconds=300)


@dataclass
class RefitGroup:
    """This engine's membership in a trainer's refit group."""

    group: Any
    backend: str
    rank: int
    world_size: int
    bucket_bytes: int
    specs: list[TensorSpec] | None = None


def join_group(*, ip: str, port: int, rank: int, world_size: int, device: Any) -> RefitGroup:
    """Connect to the trainer's store and join its group (blocks until every rank has joined)."""
    try:
        store = dist.TCPStore(ip, port, is_master=False, timeout=GROUP_TIMEOUT)
        store.set(STORE_KEY_WORLD_SIZE, str(world_size))
        backend = store.get(STORE_KEY_BACKEND).decode()
        bucket_bytes = int(store.get(STORE_KEY_BUCKET_BYTES).decode())
    except (RuntimeError, ValueError, OSError) as exc:
        raise WeightsLoadError(f"cannot reach the trainer's refit store at {ip}:{port}: {exc}") from exc
    if backend not in REFIT_BACKENDS:
        raise WeightsLoadError(f"the trainer's refit group uses backend {backend!r}; this engine speaks nccl or gloo")
    if backend == "nccl" and device.type != "cuda":
        raise WeightsLoadError("the trainer's refit group is NCCL, and this engine runs on the CPU")
    group = make_group(store, backend, rank, world_size, device)
    return RefitGroup(group=group, backend=backend, rank=rank, world_size=world_size, bucket_bytes=bucket_bytes)


def make_group(store: Any, backend: str, rank: int, world_size: int, device: Any) -> Any:
    """This rank's process group over ``store`` (trainer and engines alike), after the probe
    broadcast that makes every rank's communicator real."""
    prefixed = dist.PrefixStore(STORE_PREFIX, store)
    if backend == "nccl":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, GROUP_TIMEOUT)
    probe = torch.ones(1, device=device if backend == "nccl" else "cpu")
    group.broadcast([probe], dist.BroadcastOptions()).wait()
    return group


def pack_bucket(bucket: Bucket, tensors: dict[str, Any], where: Any) -> Any:
    """The trainer's side of one bucket: its tensors laid into one flat ``uint8`` buffer."""
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=where)
    for slot in bucket.slots:
        flat = tensors[slot.spec.name].detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[slot.offset : slot.offset + slot.spec.nbytes].copy_(flat)
    return buffer


def check_specs(info: dict[str, Any], params: dict[str, Any]) -> list[TensorSpec]:
    """``state_dict_info`` parsed and checked against the model (every name known, shapes equal)."""
    try:
        specs = parse_state_dict_info(info)
    except PackError as exc:
        raise BadRequestError(str(exc), param="state_dict_info") from exc
    for spec in specs:
        if spec.name not in params:
            raise BadRequestError(
                f"state_dict_info.{spec.name}: this model has no such tensor", param="state_dict_info"
            )
        have = tuple(params[spec.name].shape)
        if have != spec.shape:
            raise BadRequestError(
                f"state_dict_info.{spec.name}: shape {list(spec.shape)} differs from the model's {list(have)}",
                param="state_dict_info",
            )
    return specs


def receive_update(member: RefitGroup, params: dict[str, Any], device: Any) -> dict[str, Any]:
    """Receive every bucket the trainer broadcasts and copy its tensors into ``params``."""
    if member.specs is None:
        raise BadRequestError("update_weights_from_collective before prepare_refit_info")
    started = time.perf_counter()
    buckets = plan_buckets(member.specs, member.bucket_bytes)
    where = device if member.backend == "nccl" else torch.device("cpu")
    total = 0
    for bucket in buckets:
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=where)
        member.group.broadcast([buffer], dist.BroadcastOptions()).wait()
        for slot in bucket.slots:
            spec = slot.spec
            raw = buffer[slot.offset : slot.offset + spec.nbytes]
            tensor = raw.view(DTYPES[spec.dtype]).view(spec.shape)
            params[spec.name].copy_(tensor, non_blocking=True)
        total += bucket.nbytes
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    return {
        "tensors": len(member.specs),
        "buckets": len(buckets),
        "bytes": total,
        "seconds": round(seconds, 6),
        "gb_per_s": round(total / seconds / 1e9, 3) if seconds > 0 else None,
        "backend": member.backend,
    }


def leave_group(member: RefitGroup | None) -> None:
    if member is None:
        return
    shutdown = getattr(member.group, "shutdown", None)
    if callable(shutdown):
        with contextlib.suppress(RuntimeError):
            shutdown()
