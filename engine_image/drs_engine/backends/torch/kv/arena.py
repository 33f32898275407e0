"""Same-host KV handoff through the prefill engine's handoff arena (CUDA IPC, mapped once).

A prefill engine on a GPU computes a context-only leg's KV straight into a region of one large
buffer it allocates once (:class:`KvArena`), and names the region in the leg's
``encoded_opaque_state``: the arena's id, its CUDA IPC fields, the region's offset and shape. A
decode engine on the same host maps the arena once (:class:`ArenaMaps`, kept by id), copies the
region into its own KV in one bulk copy on a stream of its own (:func:`start_copy`), and takes the
context (``GET …?transport=cuda_ipc_arena``: the header alone) while that copy runs: the take names
an interprocess CUDA event recorded after the copy (``copy_event``), and the prefill engine frees
the region only once that event has completed (:meth:`KvArena.free_after`; checked without waiting
when a region is next allocated). The take succeeding proves the region was the context's
throughout the copy: a region is reused only after a take and its copy, or after the context
expired or was evicted, and then the take fails (404) and the copy is dropped. No memory handle is
exported, opened or closed per handoff (one event handle is), and the prefill engine's GPU thread
is not involved in the take.
"""

from __future__ import annotations

import bisect
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final

import torch

from drs_engine.backends.torch.ipc import event_handle, ipc_export, ipc_import
from drs_engine.errors import KvTransferError

#: Regions start at multiples of this many bytes.
REGION_ALIGN: Final = 1 << 16
#: Key of the arena description (``encoded_opaque_state``): the prefill engine takes ``copy_event``.
COPY_EVENT_KEY: Final = "takes_copy_event"
#: Arenas of other engines mapped at once by a decode engine (the latest of each producer wins).
ARENAS_MAPPED: Final = 8


class KvArena:
    """One buffer on the GPU, allocated on first use, carved into regions (first fit)."""

    def __init__(self, device: Any, capacity: int) -> None:
        self.device = device
        self.capacity = capacity // REGION_ALIGN * REGION_ALIGN
        self.id = uuid.uuid4().hex
        self._buffer: Any = None
        self._fields: dict[str, Any] | None = None
        #: free (offset, size) runs, sorted by offset; regions in use: offset -> size
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []
        self._used: dict[int, int] = {}
        #: regions taken while a decode engine's copy out of them may still run: (offset, its event)
        self._draining: list[tuple[int, Any]] = []

    @property
    def regions(self) -> int:
        return len(self._used)

    def alloc(self, nbytes: int) -> int | None:
        """A region of at least ``nbytes`` (its offset), or None when no free run is large enough."""
        size = -(-nbytes // REGION_ALIGN) * REGION_ALIGN
        self._drain(wait=False)
        found = self._first_fit(size)
        if found is None and self._draining:
            self._drain(wait=True)  # only copies still running stand between us and a region
            found = self._first_fit(size)
        return found

    def _first_fit(self, size: int) -> int | None:
        for i, (offset, run) in enumerate(self._free):
            if run >= size:
                self._free[i : i + 1] = [(offset + size, run - size)] if run > size else []
                self._used[offset] = size
                return offset
        return None

    def free_after(self, offset: int, event: Any) -> None:
        """Free the region at ``offset`` once ``event`` (a decode engine's copy out of it) has completed."""
        self._draining.append((offset, event))

    def _drain(self, *, wait: bool) -> None:
        """Free the draining regions whose copy has completed (``wait``: all of them, waiting)."""
        still: list[tuple[int, Any]] = []
        for offset, event in self._draining:
            if wait:
                event.synchronize()
            if wait or event.query():
                self.free(offset)
            else:
                still.append((offset, event))
        self._draining = still

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        i = bisect.bisect(self._free, (offset, size))
        self._free.insert(i, (offset, size))
        merged: list[tuple[int, int]] = []
        for start, run in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + run)
            else:
                merged.append((start, run))
        self._free = merged

    def view(self, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
        """The region at ``offset`` as a tensor (on the GPU thread: the buffer is made here once)."""
        if self._buffer is None:
            self._buffer = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return self._buffer[offset : offset + nbytes].view(dtype).view(shape)

    def describe(self, offset: int, shape: tuple[int, ...], dtype: Any) -> dict[str, Any]:
        """What a decode engine needs to copy the region: for ``encoded_opaque_state``."""
        if self._fields is None:
            self._fields = ipc_export(self._buffer)
        return {
            "id": self.id,
            "ipc": self._fields,
            "offset": offset,
            "shape": list(shape),
            "dtype": str(dtype).removeprefix("torch."),
            # this engine frees a region only once the copy named in the take is done: a decode
            # engine may send the take while its copy runs (one that does not see this waits first)
            COPY_EVENT_KEY: True,
        }

    def release(self) -> bool:
        """Free the buffer (sleep) when no region is in use; the next use makes a new arena."""
        self._drain(wait=True)
        if self._used:
            return False
        self._buffer, self._fields, self.id = None, None, uuid.uuid4().hex
        return True


class ArenaMaps:
    """Prefill engines' arenas mapped into this process, by arena id."""

    def __init__(self) -> None:
        self._maps: OrderedDict[str, Any] = OrderedDict()

    def get(self, arena: dict[str, Any], producer_device: int) -> Any:
        mapped = self._maps.get(arena["id"])
        if mapped is None:
            mapped = ipc_import(arena["ipc"], torch.uint8, producer_device).reshape(-1)
            self._maps[arena["id"]] = mapped
            while len(self._maps) > ARENAS_MAPPED:
                self._maps.popitem(last=False)
        self._maps.move_to_end(arena["id"])
        return mapped


@dataclass(slots=True)
class RegionCopy:
    """A copy out of a prefill engine's arena, enqueued and maybe still running."""

    kv: Any
    began: Any
    ended: Any
    #: interprocess event recorded after the copy (kept alive until the copy is done)
    done: Any
    #: its CUDA IPC handle: the take names it (``copy_event``)
    event_handle: str

    def finish(self) -> tuple[Any, float]:
        """The KV once the copy has completed, and the copy's seconds (CUDA events); GPU thread."""
        self.ended.synchronize()
        return self.kv, self.began.elapsed_time(self.ended) / 1000.0


def start_copy(
    maps: ArenaMaps, arena: dict[str, Any], producer_device: int, device: Any, dtype: Any, stream: Any
) -> RegionCopy:
    """The region's KV copied onto ``device`` (one bulk copy enqueued on ``stream``, not waited
    for). Runs on the GPU thread."""
    if arena.get("dtype") != str(dtype).removeprefix("torch."):
        raise KvTransferError(f"context KV dtype {arena.get('dtype')} differs from this engine's {dtype}")
    shape = tuple(int(d) for d in arena["shape"])
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    offset = int(arena["offset"])
    whole = maps.get(arena, producer_device)
    if offset + nbytes > whole.numel():
        raise KvTransferError("the context's KV region lies outside the prefill engine's arena")
    kv = torch.empty(shape, dtype=dtype, device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    done = torch.cuda.Event(interprocess=True)
    with torch.cuda.stream(stream):
        began.record(stream)
        kv.view(-1).view(torch.uint8).copy_(whole[offset : offset + nbytes], non_blocking=True)
        ended.record(stream)
        done.record(stream)
    kv.record_stream(stream)
    return RegionCopy(kv, began, ended, done, event_handle(done))
