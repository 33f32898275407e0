"""CUDA graphs of the pooled decode step, one per bucket, captured on first use and replayed.

A decode step of a 0.6B model is ~900 small kernel launches; launched one by one from Python they
cost far more than the GPU's work (weights read once per step: under a millisecond on an H200).
:class:`DecodeGraphs` captures :func:`~drs_engine.backends.torch.pooled.pooled_logits` once per
``(rows, tokens)`` bucket (all graphs share one memory pool: they never run at once) and replays
it; every input lives in the decode pool's static buffers, so a replay reads the step's tokens and
positions from there. A graph holds the addresses of the weights and the pool: :meth:`clear`
drops them all when either is replaced (a refit that repacks the weights, sleep). On the CPU, or
with graphs off, the step runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: Eager runs before a capture (kernels chosen, lazy init done, outside the graph).
WARM_RUNS = 2


class DecodeGraphs:
    """Captured decode steps by bucket key, on one device."""

    def __init__(self, device: Any, *, enabled: bool) -> None:
        self.enabled = enabled and device.type == "cuda"
        self._graphs: dict[Any, tuple[Any, Any]] = {}
        self._mempool: Any = None
        #: the one side stream every capture warms up on (cuBLAS keeps a workspace per stream)
        self._side: Any = None
        #: what the graphs were captured against (identity: the packed weights object)
        self.captured_for: Any = None
        self.captures = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._mempool = None
        self.captured_for = None

    def run(self, key: Any, fn: Callable[[], Any]) -> Any:
        """``fn()``'s result: from the graph captured for ``key`` (captured now if new), or eager."""
        if not self.enabled:
            return fn()
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(fn)
            self._graphs[key] = entry
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """Warm ``fn`` up on a side stream, then capture it. Its writes must be idempotent for the
        inputs in the static buffers (a decode step writes the same K/V at the same positions)."""
        if self._side is None:
            self._side = torch.cuda.Stream()
        side = self._side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARM_RUNS):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            out = fn()
        self._mempool = graph.pool()
        self.captures += 1
        return graph, out
