"""The ``torch`` backend's control API: refit (safetensors and collective), prefix-cache reset,
sleep/wake and profiling. A mixin of :class:`~drs_engine.backends.torch_backend.TorchBackend`
(its state is declared here and set there); device work runs on the backend's GPU thread.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final

import torch
from drs_protocol.control import CollectiveInit, CollectiveUpdate, IpcBuffer, IpcUpdate, PrepareRefitInfo
from drs_protocol.nemo_rl_refit import TensorSpec
from drs_protocol.routes import CONTROL_ROUTES, ControlOp

from drs_engine.backends import torch_refit
from drs_engine.backends.torch_arena import KvArena
from drs_engine.backends.torch_batch import DecodeBatcher, GpuWorker
from drs_engine.backends.torch_model import ModelShape, read_safetensors
from drs_engine.backends.torch_weights import PackedWeights, pack
from drs_engine.errors import BadRequestError, EngineError
from drs_engine.kv_store import ContextStore
from drs_engine.prefix_cache import PrefixCache
from drs_engine.weights.digest import torch_weights_digest

ALL_MEMORY_TAGS: Final = ("model", "kv_cache")


class TorchControl:
    """Control operations over the backend's weights, caches and refit group."""

    _worker: GpuWorker
    _batcher: DecodeBatcher
    _cache: PrefixCache
    _contexts: ContextStore[Any]
    _lent: list[tuple[float, Any]]
    _weights: PackedWeights
    _ipc_maps: torch_refit.IpcMaps
    _arena: KvArena | None
    _host_params: dict[str, Any] | None
    _group: torch_refit.RefitGroup | None
    _device: Any
    _dtype: Any
    _shape: ModelShape
    _version: str
    _seed: bytes
    _last_refit: dict[str, Any] | None
    _profile_started: float | None

    @property
    def _params(self) -> dict[str, Any]:
        """The model's parameters (views of the packed weights)."""
        return self._weights.params

    def _weights_seed(self) -> bytes:
        raise NotImplementedError

    def _install(self, params: dict[str, Any] | None) -> None:
        raise NotImplementedError

    def _new_weights(self, version: str, result: dict[str, Any]) -> dict[str, Any]:
        previous = self._version
        self._version = version
        self._seed = self._weights_seed()
        evicted = self._cache.reset()
        self._last_refit = {"version": version, **result}
        return {"version": version, "previous_version": previous, "prefix_cache_blocks_evicted": evicted, **result}

    async def measure_digest(self) -> str | None:
        return await self._worker.run(torch_weights_digest, self._weights.flat, self._weights.params)

    async def load_weights(self, path: str, version: str) -> dict[str, Any]:
        started = time.perf_counter()
        params = await self._worker.run(read_safetensors, path, self._shape, self._device, self._dtype)
        nbytes = sum(int(t.numel()) * int(t.element_size()) for t in params.values())
        await self._worker.run(self._install, params)
        seconds = time.perf_counter() - started
        return self._new_weights(version, {"source": path, "bytes": nbytes, "seconds": round(seconds, 6)})

    async def init_collective(self, params: CollectiveInit) -> dict[str, Any]:
        rank = params.train_world_size + params.rank_prefix
        if rank >= params.world_size:
            raise BadRequestError(
                f"rank_prefix: rank {rank} (train_world_size + rank_prefix) is outside world_size {params.world_size}",
                param="rank_prefix",
            )
        torch_refit.leave_group(self._group)
        self._group = None
        self._group = await asyncio.to_thread(
            torch_refit.join_group,
            ip=params.ip,
            port=params.port,
            rank=rank,
            world_size=params.world_size,
            device=self._device,
        )
        return {"rank": rank, "world_size": params.world_size, "backend": self._group.backend}

    async def prepare_refit_info(self, params: PrepareRefitInfo) -> dict[str, Any]:
        group = self._require_group()
        group.specs = torch_refit.check_specs(params.state_dict_info, self._params)
        return {"tensors": len(group.specs), "bytes": sum(s.nbytes for s in group.specs)}

    async def update_weights_from_collective(self, params: CollectiveUpdate) -> dict[str, Any]:
        group = self._require_group()
        result = await self._worker.run(self._receive, group)
        result["recompute_kv"] = "not done: in-flight sequences keep their KV" if params.recompute_kv else False
        return self._new_weights(params.version, result)

    def _receive(self, group: torch_refit.RefitGroup) -> dict[str, Any]:
        try:
            return torch_refit.receive_update(group, self._weights, self._device)
        finally:
            self._install(None)  # tensors changed in place (even a partial update)

    async def update_weights_from_ipc(self, params: IpcUpdate) -> dict[str, Any]:
        specs = torch_refit.check_specs(params.state_dict_info, self._params)
        result = await self._worker.run(self._receive_ipc, specs, params.buffers)
        return self._new_weights(params.version, result)

    def _receive_ipc(self, specs: list[TensorSpec], buffers: list[IpcBuffer]) -> dict[str, Any]:
        try:
            return torch_refit.receive_ipc(self._ipc_maps, self._weights, specs, buffers, self._device)
        finally:
            self._install(None)  # tensors changed in place (even a partial copy)

    def _require_group(self) -> torch_refit.RefitGroup:
        if self._group is None:
            raise BadRequestError(f"no refit group: POST {CONTROL_ROUTES[ControlOp.INIT_COLLECTIVE]} first")
        return self._group

    async def reset_prefix_cache(self) -> dict[str, Any]:
        return {"prefix_cache_blocks_evicted": self._cache.reset()}

    async def release_memory(self, tags: list[str]) -> dict[str, Any]:
        released = list(tags) or list(ALL_MEMORY_TAGS)
        before = await self._worker.run(self._free_bytes)
        dropped_blocks = dropped_states = 0
        if "kv_cache" in released:
            dropped_blocks = self._cache.reset()
            dropped_states = self._contexts.clear()  # frees their arena regions
            self._lent.clear()
            if self._arena is not None:
                await self._worker.run(self._arena.release)
            self._batcher.fail_all(EngineError("the engine released its KV cache (sleep)"))
        if "model" in released and self._host_params is None:
            self._host_params = await self._worker.run(self._to_host, self._params)
            self._weights = PackedWeights({})
            self._ipc_maps.clear()
        after = await self._worker.run(self._empty_cache)
        return {
            "released": released,
            "prefix_cache_blocks_evicted": dropped_blocks,
            "context_states_dropped": dropped_states,
            "gpu_free_bytes_before": before,
            "gpu_free_bytes_after": after,
            "gpu_allocated_bytes": (await self._worker.run(self._memory))["gpu_allocated_bytes"],
        }

    async def resume_memory(self, tags: list[str]) -> dict[str, Any]:
        resumed = list(tags) or list(ALL_MEMORY_TAGS)
        if "model" in resumed and self._host_params is not None:
            host, self._host_params = self._host_params, None
            await self._worker.run(self._restore, host)
        return {"resumed": resumed, **(await self._worker.run(self._memory))}

    def _to_host(self, params: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to("cpu") for k, v in params.items()}

    def _restore(self, host: dict[str, Any]) -> None:
        self._weights = pack(host, self._device)  # the same values: KV stays valid

    def _memory(self) -> dict[str, int | None]:
        """This engine's GPU memory: tensors it holds, and the device's free bytes."""
        held = int(torch.cuda.memory_allocated(self._device)) if self._device.type == "cuda" else None
        return {"gpu_allocated_bytes": held, "gpu_free_bytes": self._free_bytes()}

    def _free_bytes(self) -> int | None:
        if self._device.type != "cuda":
            return None
        return int(torch.cuda.mem_get_info(self._device)[0])

    def _empty_cache(self) -> int | None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            torch.cuda.empty_cache()
        return self._free_bytes()

    async def start_profile(self) -> dict[str, Any]:
        if self._profile_started is not None:
            raise BadRequestError("a profile is already running")
        self._profile_started = time.monotonic()
        return {"profiling": True, "kind": "wall clock only"}

    async def stop_profile(self) -> dict[str, Any]:
        if self._profile_started is None:
            raise BadRequestError("no profile is running")
        elapsed = time.monotonic() - self._profile_started
        self._profile_started = None
        return {"profiling": False, "duration_s": round(elapsed, 6)}
