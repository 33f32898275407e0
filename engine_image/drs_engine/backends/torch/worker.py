"""The ``torch`` backend's one GPU thread, and the device's memory as the control API reports it.

All device work runs on one worker thread (:class:`GpuWorker`), so the event loop never blocks on
the GPU and jobs never race on the weights: prefills, decode steps, KV exports and weight loads
queue in submission order.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")

#: Seconds the interpreter lets one thread hold the GIL while another waits (Python's default: 5 ms).
#: The GPU thread gives the GIL up around every torch call and at each host sync; while the event loop
#: is busy streaming a step's tokens to many clients, each taking it back could wait the whole
#: default interval (a convoy: ~10 ms between decode steps at 32 streams, against a ~4 ms step). A
#: short interval lets it launch the next step while the loop streams the last one's tokens.
GIL_SWITCH_S = 0.0002


def share_the_gil_finely() -> None:
    """Shorten the interpreter's switch interval to :data:`GIL_SWITCH_S` (the engine process's;
    a GPU engine only: it serves one backend)."""
    sys.setswitchinterval(GIL_SWITCH_S)


class GpuWorker:
    """A single thread that owns the device (its current device is set once)."""

    def __init__(self, device: Any) -> None:
        def init() -> None:
            if device.type == "cuda":
                torch.cuda.set_device(device)

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drs-gpu", initializer=init)
        self._count = threading.Lock()
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Jobs submitted that have not started: a run of decode steps ends for them
        (:class:`~drs_engine.backends.torch.batching.DecodeBatcher`)."""
        return self._waiting

    def _queued(self, fn: Callable[..., T], *args: Any) -> _Job[T]:
        with self._count:
            self._waiting += 1
        return _Job(self, fn, args)

    def _started(self) -> None:
        with self._count:
            self._waiting -= 1

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._queued(fn, *args))

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the GPU thread after the jobs queued so far, without waiting (from
        code that cannot await: a generator's ``finally``, a callback). Nothing once closed."""
        with contextlib.suppress(RuntimeError):  # shut down: the device's state went with it
            self._pool.submit(self._queued(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class _Job(Generic[T]):
    """``func(*args)`` queued on the GPU thread; counted as waiting until it starts."""

    __slots__ = ("_worker", "args", "func")

    def __init__(self, worker: GpuWorker, func: Callable[..., T], args: tuple[Any, ...]) -> None:
        self._worker, self.func, self.args = worker, func, args

    def __call__(self) -> T:
        self._worker._started()
        return self.func(*self.args)


def free_bytes(device: Any) -> int | None:
    """The device's free bytes (None on the CPU)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def memory(device: Any) -> dict[str, int | None]:
    """This engine's GPU memory: tensors it holds, and the device's free bytes."""
    held = int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
    return {"gpu_allocated_bytes": held, "gpu_free_bytes": free_bytes(device)}


def empty_cache(device: Any) -> int | None:
    """Give the allocator's cached blocks back to the device; the free bytes after.

    cuBLAS keeps a workspace per (handle, stream) it ran a matmul on, allocated through PyTorch's
    caching allocator and counted in ``memory_allocated`` (32 MiB each on Hopper): the GPU thread's
    stream, the CUDA graphs' warm-up and capture streams. Sleep drops them too (cuBLAS makes new
    ones on the next matmul)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
    return free_bytes(device)
