"""The ``torch`` backend's refit: receive packed weights by collective broadcast, or by CUDA IPC.

Collective (NeMo RL's non-colocated refit, on ``torch.distributed``): ``init`` connects to the
TCPStore the trainer hosts at ``ip:port``, reads the group's backend and batch target from it
(:mod:`drs_protocol.weights_pack`), and joins as rank ``train_world_size + rank_prefix``;
``prepare`` checks the announced tensors against the model; ``update`` receives each batch by
broadcast from rank 0, straight into the engine's packed weights when the batch is one range of
them (:mod:`.packed`). The group is a process group object of its own (never the default
group), so a later ``init`` replaces it cleanly. Nothing waits for the other ranks unbounded: the
store and the group's creation share the control call's ``timeout_s`` (the caller stops waiting
at it, :class:`JoinProgress`), each batch's broadcast gets the update's ``timeout_s``
(:func:`broadcast_within` sets the group's timeout to the time left before every batch; gloo
fails the operation then), and a failure raises :class:`CollectiveError` naming the rank, the batch
and whether bytes had already landed.

Colocated (NeMo RL's colocated refit: the trainer shares its packed buffers by CUDA IPC handles,
on the same host; one GPU, or any GPU this engine sees): :func:`receive_ipc` maps each buffer
(once: mappings are kept by handle) and copies it into the weights, one copy per buffer when the
layouts agree. The same layout both ways, so one trainer refits either way.

Every function here blocks: the backend runs them on its GPU worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

import torch
import torch.distributed as dist
from drs_protocol.control import CollectiveInit, IpcBuffer
from drs_protocol.nemo_rl_refit import RefitSpecError, Slot, TensorSpec, parse_state_dict_info
from drs_protocol.weights_pack import (
    REFIT_BACKENDS,
    STORE_KEY_BACKEND,
    STORE_KEY_TARGET_BYTES,
    STORE_KEY_WORLD_SIZE,
    STORE_PREFIX,
    batch_ranges,
    flat_slots,
)

from drs_engine.backends.torch import ipc
from drs_engine.backends.torch.weights.packed import PackedWeights
from drs_engine.errors import BadRequestError, CollectiveError, WeightsLoadError

#: How long joining the group, and each broadcast, may wait for the other ranks, unless the
#: caller gives its own timeout (the control API's ``timeout_s``).
GROUP_TIMEOUT: Final = timedelta(seconds=300)
#: The least time a group is given to form once the store answered (the join's deadline rules anyway).
MIN_GROUP_TIMEOUT_S: Final = 0.05
#: CUDA IPC mappings of trainers' buffers kept open (a trainer reuses its buffers refit after refit).
IPC_MAPS_KEPT: Final = 4


@dataclass
class RefitGroup:
    """This engine's membership in a trainer's refit group."""

    group: Any
    backend: str
    rank: int
    world_size: int
    target_bytes: int
    specs: list[TensorSpec] | None = None


@dataclass
class JoinProgress:
    """How far a join got, for the caller that stops waiting at its own deadline: torch's
    TCPStore connect can outrun the timeout it is given by a retry delay (3.7 s for 2.4 s seen here),
    so the caller owns the deadline and names what was slow from this."""

    connected: bool = False  #: the trainer's store answered (what is left is the group forming)


def join_group(
    *,
    ip: str,
    port: int,
    rank: int,
    world_size: int,
    device: Any,
    timeout: timedelta = GROUP_TIMEOUT,
    progress: JoinProgress | None = None,
) -> RefitGroup:
    """Connect to the trainer's store and join its group (blocks until every rank has joined, at
    most ``timeout`` in all, store and group: then :class:`CollectiveError`; the store's connect
    may outrun it, see :class:`JoinProgress` and :func:`join_overrun`)."""
    progress = progress or JoinProgress()
    started = time.monotonic()
    try:
        store = dist.TCPStore(ip, port, is_master=False, timeout=timeout)
    except (RuntimeError, ValueError, OSError) as exc:
        raise WeightsLoadError(f"cannot reach the trainer's refit store at {ip}:{port}: {exc}") from exc
    progress.connected = True
    try:  # the trainer publishes its group's backend and batch target; wait for them only the time left
        store.set_timeout(timedelta(seconds=max(timeout.total_seconds() - (time.monotonic() - started), 0.001)))
        store.set(STORE_KEY_WORLD_SIZE, str(world_size))
        backend = store.get(STORE_KEY_BACKEND).decode()
        target_bytes = int(store.get(STORE_KEY_TARGET_BYTES).decode())
    except (RuntimeError, ValueError, OSError) as exc:
        raise CollectiveError(
            f"rank {rank}: connected to the trainer's store at {ip}:{port}, but it published no group within "
            f"{timeout.total_seconds():g}s (the trainer did not set up its group: hung): {exc}"
        ) from exc
    if backend not in REFIT_BACKENDS:
        raise WeightsLoadError(f"the trainer's refit group uses backend {backend!r}; this engine speaks nccl or gloo")
    if backend == "nccl" and device.type != "cuda":
        raise WeightsLoadError("the trainer's refit group is NCCL, and this engine runs on the CPU")
    left = timedelta(seconds=max(timeout.total_seconds() - (time.monotonic() - started), MIN_GROUP_TIMEOUT_S))
    try:
        group = make_group(store, backend, rank, world_size, device, left)
    except RuntimeError as exc:
        raise CollectiveError(
            f"rank {rank}: the group of {world_size} ranks did not form within {timeout.total_seconds():g}s: {exc}"
        ) from exc
    return RefitGroup(group=group, backend=backend, rank=rank, world_size=world_size, target_bytes=target_bytes)


def engine_rank(params: CollectiveInit) -> int:
    """This engine's rank in the trainer's group: ``train_world_size + rank_prefix`` (a 400 naming
    ``rank_prefix`` when it falls outside ``world_size``)."""
    rank = params.train_world_size + params.rank_prefix
    if rank >= params.world_size:
        raise BadRequestError(
            f"rank_prefix: rank {rank} (train_world_size + rank_prefix) is outside world_size {params.world_size}",
            param="rank_prefix",
        )
    return rank


async def join_within(params: CollectiveInit, device: Any) -> RefitGroup:
    """:func:`join_group` (in a thread) answered within ``params.timeout_s``, a deadline this code
    owns: torch's store connect can outrun the timeout it is given. Past it, a
    :class:`CollectiveError` says what was slow (:func:`join_overrun`), and a join that ends later
    leaves the group it formed."""
    rank = engine_rank(params)
    progress = JoinProgress()
    joining = asyncio.ensure_future(
        asyncio.to_thread(
            join_group,
            ip=params.ip,
            port=params.port,
            rank=rank,
            world_size=params.world_size,
            device=device,
            timeout=timedelta(seconds=params.timeout_s),
            progress=progress,
        )
    )
    try:
        return await asyncio.wait_for(asyncio.shield(joining), params.timeout_s)
    except TimeoutError:
        joining.add_done_callback(_leave_late)
        why = join_overrun(rank, params.ip, params.port, params.world_size, params.timeout_s, progress)
        raise CollectiveError(why) from None


def _leave_late(joining: asyncio.Future[RefitGroup]) -> None:
    """A join that ended after its answer was given: leave the group it formed."""
    if not joining.cancelled() and joining.exception() is None:
        leave_group(joining.result())


def join_overrun(rank: int, ip: str, port: int, world_size: int, timeout_s: float, progress: JoinProgress) -> str:
    """Why a join still running at its caller's deadline (``timeout_s``) failed: the trainer's
    store slow to accept a connection, or the group not formed (a rank that did not join: hung)."""
    if not progress.connected:
        return (
            f"rank {rank}: the trainer's refit store at {ip}:{port} did not accept a connection within "
            f"{timeout_s:g}s (slow to connect)"
        )
    return (
        f"rank {rank}: connected to the trainer's store at {ip}:{port}, but the group of {world_size} ranks "
        f"did not form within {timeout_s:g}s (a rank did not join: hung)"
    )


def make_group(
    store: Any, backend: str, rank: int, world_size: int, device: Any, timeout: timedelta = GROUP_TIMEOUT
) -> Any:
    """This rank's process group over ``store`` (trainer and engines alike), after the probe
    broadcast that makes every rank's communicator real; ``timeout`` bounds each of its operations."""
    prefixed = dist.PrefixStore(STORE_PREFIX, store)
    if backend == "nccl":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    probe = torch.ones(1, device=device if backend == "nccl" else "cpu")
    group.broadcast([probe], dist.BroadcastOptions()).wait()
    return group


def broadcast_within(group: Any, buffer: Any, deadline: float) -> None:
    """One broadcast from rank 0 into ``buffer`` that waits at most until ``deadline``
    (``time.monotonic()``): the group's timeout is set to the time left first (gloo honours it for
    the operation: a peer that stopped answering fails it then). :class:`TimeoutError` when no time
    is left."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no time left")
    set_timeout = getattr(group, "set_timeout", None)
    if callable(set_timeout):
        set_timeout(timedelta(seconds=left))
    group.broadcast([buffer], dist.BroadcastOptions()).wait()


def check_specs(info: dict[str, Any], params: dict[str, Any]) -> list[TensorSpec]:
    """``state_dict_info`` parsed and checked against the model (every name known, shapes equal)."""
    try:
        specs = parse_state_dict_info(info)
    except RefitSpecError as exc:
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


def receive_update(member: RefitGroup, weights: PackedWeights, device: Any, deadline: float) -> dict[str, Any]:
    """Receive every batch the trainer broadcasts into ``weights`` (in place where it is one range),
    all of them by ``deadline`` (``time.monotonic()``). A broadcast that fails or runs past it raises
    :class:`CollectiveError` naming this rank and the batch, with ``weights_changed`` when bytes of
    the update had already landed."""
    if member.specs is None:
        raise BadRequestError("update_weights_from_collective before prepare_refit_info")
    started = time.perf_counter()
    ranges = batch_ranges(member.specs, member.target_bytes)
    where = device if member.backend == "nccl" else torch.device("cpu")
    in_place = 0
    changed = False
    for i, (start, end, batch) in enumerate(ranges):
        place = weights.target(batch, end - start) if member.backend == "nccl" else None
        buffer = place if place is not None else torch.empty(end - start, dtype=torch.uint8, device=where)
        changed = changed or place is not None  # an in-place broadcast writes the weights as it lands
        try:
            broadcast_within(member.group, buffer, deadline)
        except (RuntimeError, TimeoutError) as exc:
            raise CollectiveError(
                f"rank {member.rank}: batch {i + 1}/{len(ranges)} of the trainer's broadcast did not arrive "
                f"by the step's deadline: {exc}",
                weights_changed=changed,
            ) from exc
        if place is None:
            weights.copy_batch(batch, buffer)
            changed = True
        else:
            in_place += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    total = ranges[-1][1] if ranges else 0
    return _report(member.backend, len(member.specs), len(ranges), in_place, total, seconds)


def _report(how: str, tensors: int, batches: int, in_place: int, total: int, seconds: float) -> dict[str, Any]:
    return {
        "backend": how,
        "tensors": tensors,
        "buckets": batches,
        "buckets_in_place": in_place,
        "bytes": total,
        "seconds": round(seconds, 6),
        "gb_per_s": round(total / seconds / 1e9, 3) if seconds > 0 else None,
    }


class IpcMaps:
    """Trainers' buffers mapped into this process by CUDA IPC, kept by handle (most recent few)."""

    def __init__(self) -> None:
        self._maps: OrderedDict[str, Any] = OrderedDict()

    def get(self, buffer: IpcBuffer) -> Any:
        """``buffer``'s bytes, from its allocation mapped once (every batch of a trainer's packed
        buffer shares one handle: the mapping covers the allocation, the batch is a slice of it)."""
        fields = buffer.ipc.model_dump()
        key = f"{buffer.gpu_uuid}/{fields.get('handle')}/{fields.get('storage_offset_bytes')}"
        whole = self._maps.get(key)
        if whole is None:
            producer = ipc.local_gpu_uuids().get(buffer.gpu_uuid)
            if producer is None:
                raise BadRequestError(
                    f"buffers: GPU {buffer.gpu_uuid} is not visible to this engine (CUDA IPC needs the same host "
                    "and the trainer's GPU visible here)",
                    param="buffers",
                )
            storage = {**fields, "offset": 0, "size": [int(fields.get("storage_size_bytes", 0))], "stride": [1]}
            whole = ipc.ipc_import(storage, torch.uint8, producer)
            self._maps[key] = whole
            while len(self._maps) > IPC_MAPS_KEPT:
                self._maps.popitem(last=False)
        self._maps.move_to_end(key)
        start = int(fields.get("offset", 0))
        if list(fields.get("size", [])) != [buffer.nbytes] or start + buffer.nbytes > whole.numel():
            raise BadRequestError(
                f"buffers: the shared buffer's fields (offset {start}, size {fields.get('size')}) do not hold "
                f"{buffer.nbytes} bytes",
                param="buffers",
            )
        return whole[start : start + buffer.nbytes]

    def clear(self) -> None:
        self._maps.clear()


def receive_ipc(
    maps: IpcMaps, weights: PackedWeights, specs: list[TensorSpec], buffers: list[IpcBuffer], device: Any
) -> dict[str, Any]:
    """Copy the tensors of ``specs`` (the packed layout) out of the trainer's shared ``buffers``."""
    if device.type != "cuda":
        raise BadRequestError("update_weights_from_ipc: this engine runs on the CPU (CUDA IPC needs a GPU)")
    started = time.perf_counter()
    slots = flat_slots(specs)
    copied = in_place = 0
    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began.record()
    for buf in buffers:
        end = buf.offset + buf.nbytes
        batch = [Slot(s.spec, s.offset - buf.offset) for s in slots if buf.offset <= s.offset < end]
        if any(s.offset + s.spec.nbytes > buf.nbytes for s in batch):
            raise BadRequestError("buffers: a tensor straddles two buffers (cut them at tensor boundaries)")
        in_place += weights.copy_batch(batch, maps.get(buf))
        copied += len(batch)
    if copied != len(specs):
        raise BadRequestError(f"buffers: they hold {copied} of the {len(specs)} tensors of state_dict_info")
    ended.record()
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    total = sum(s.nbytes for s in specs)
    copy_s = began.elapsed_time(ended) / 1000.0  # the GPU's time from the first copy to the last
    return {
        **_report("cuda_ipc", len(specs), len(buffers), in_place, total, seconds),
        "copy_seconds": round(copy_s, 6),
        "copy_gb_per_s": round(total / copy_s / 1e9, 3) if copy_s > 0 else None,
    }


def leave_group(member: RefitGroup | None) -> None:
    if member is None:
        return
    shutdown = getattr(member.group, "shutdown", None)
    if callable(shutdown):
        with contextlib.suppress(RuntimeError):
            shutdown()


def abort_group(member: RefitGroup) -> None:
    """Abort the group at once, from any thread: NCCL's abort unblocks the operations in flight;
    gloo's leaves an operation in flight to fail by the timeout :func:`broadcast_within` gave it."""
    abort = getattr(member.group, "abort", None)
    if callable(abort):
        with contextlib.suppress(RuntimeError):
            abort()
