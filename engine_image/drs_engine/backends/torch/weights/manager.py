"""The ``torch`` backend's weights: where they are swapped.

:class:`WeightsManager` owns the served weights (packed in one buffer, :mod:`.packed`), their
version, and a generation counter bumped on the GPU thread whenever the tensors change (a decoding
sequence compares it with its KV's, and recomputes its KV under the new weights: refit safety), and
the prefix-hash seed derived from both (a prefill's cache keys, taken on the GPU thread when it
runs, name the weights it runs under: :mod:`drs_engine.backends.torch.runner`). It swaps them four
ways: from safetensors (:meth:`load`), by collective broadcast (:meth:`update_from_collective`,
after :meth:`init_collective` and :meth:`prepare`), by CUDA IPC from a colocated trainer
(:meth:`update_from_ipc`; both in :mod:`.refit`), and out to host memory and back for sleep
(:meth:`offload`, :meth:`restore`). Each swap answers the fields of the control op's result that
the weights know; the engine adds what else changed (the prefix cache it reset).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any, Final

from drs_protocol.control import CollectiveInit, CollectiveUpdate, IpcBuffer, IpcUpdate, PrepareRefitInfo
from drs_protocol.nemo_rl_refit import TensorSpec
from drs_protocol.routes import CONTROL_ROUTES, ControlOp
from drs_protocol.weights_stream import WeightsStreamHeader

from drs_engine.backends.torch.model import ModelSource, random_state_dict, read_safetensors
from drs_engine.backends.torch.weights import refit, stream
from drs_engine.backends.torch.weights.packed import PackedWeights, pack
from drs_engine.backends.torch.worker import GpuWorker
from drs_engine.errors import BadRequestError, CollectiveError, WeightsIncompleteError
from drs_engine.weights import digest as weights_digest
from drs_engine.weights.digest import torch_weights_digest
from drs_engine.weights.stream import WeightsExport

#: Seconds past a collective step's ``timeout_s`` before the engine stops waiting for its thread and
#: aborts the group (a backstop: the step's own operations are bounded by ``timeout_s`` already).
BACKSTOP_S: Final = 5.0
#: generations whose version :meth:`WeightsManager.version_of` still answers (a prefill queued
#: across more swaps than that is refused, not mislabelled)
KEPT_VERSIONS: Final = 4


class WeightsManager:
    """The served weights, their version and generation, and every way to swap them."""

    def __init__(self, source: ModelSource, *, version: str, device: Any, dtype: Any, worker: GpuWorker) -> None:
        self._source = source
        self._shape = source.shape
        self._device = device
        self._dtype = dtype
        self._worker = worker
        self._version = version
        self._seed = self._seed_of(version)
        self._weights = PackedWeights({})
        self._ipc_maps = refit.IpcMaps()
        self._host: dict[str, Any] | None = None
        self._group: refit.RefitGroup | None = None
        #: bumped on the GPU thread whenever the weights change (a sequence's KV records its own)
        self._gen = 0
        #: the version of each recent generation, set on the GPU thread in the job that swaps the
        #: tensors (a prefill is labelled with the weights it ran under: :meth:`version_of`)
        self._versions: dict[int, str] = {0: version}
        #: ``(gen, digest)`` a stream load proved of the weights it swapped in
        self._verified: tuple[int, str] | None = None
        self.last_refit: dict[str, Any] | None = None
        #: why the weights hold part of an update that failed (set on the GPU thread; None: whole)
        self.incomplete: str | None = None

    @property
    def params(self) -> dict[str, Any]:
        """The model's parameters (views of the packed weights)."""
        return self._weights.params

    @property
    def packed(self) -> PackedWeights:
        """The weights as packed now (``flat`` None: kept as separate tensors)."""
        return self._weights

    @property
    def version(self) -> str:
        return self._version

    async def measure_digest(self) -> str:
        """The :mod:`drs_protocol.weights_digest` of the weights held now, on their device (or the
        digest a peer stream's load proved of these very bytes, while they have not changed since)."""
        if self._verified is not None and self._verified[0] == self._gen:
            return self._verified[1]
        return await self._worker.run(torch_weights_digest, self._weights.flat, self._weights.params)

    @property
    def seed(self) -> bytes:
        """The prefix-hash seed of the served weights (:meth:`seed_at` their generation)."""
        return self.seed_at(self._gen)

    def seed_at(self, gen: int) -> bytes:
        """The prefix-hash seed of KV computed under weights generation ``gen``: the version's seed
        chained with the generation. The GPU thread bumps the generation in the job that swaps the
        tensors, so a block cached under other weights never matches, even while the version (set on
        the event loop after the swap) still names the old ones."""
        return hashlib.blake2b(self._seed + gen.to_bytes(8, "little", signed=True), digest_size=16).digest()

    def version_of(self, gen: int) -> str | None:
        """The version of weights generation ``gen`` (known from the job that swapped them in, before
        the event loop declares it); None for a swap that failed part way (its weights are
        incomplete: nothing is computed with them) or a generation older than the last few."""
        return self._versions.get(gen)

    @property
    def gen(self) -> int:
        """The weights generation (read on the GPU thread, between steps)."""
        return self._gen

    def _seed_of(self, version: str) -> bytes:
        return hashlib.blake2b(f"{version}\0{self._source.label}".encode(), digest_size=16).digest()

    async def start(self) -> None:
        self._weights = pack(await self._worker.run(self._initial_params), self._device)
        await self._worker.run(weights_digest.warm_up, self._device)  # no load pays for the compile

    def _initial_params(self) -> dict[str, Any]:
        if self._source.directory is not None:
            return read_safetensors(self._source.directory, self._shape, self._device, self._dtype)
        seed = self._source.random_seed or 0
        return random_state_dict(self._shape, seed=seed, device=self._device, dtype=self._dtype)

    def close(self) -> None:
        refit.leave_group(self._group)
        self._group = None

    def group_info(self) -> dict[str, Any] | None:
        if self._group is None:
            return None
        return {"backend": self._group.backend, "rank": self._group.rank, "world_size": self._group.world_size}

    def _install(self, params: dict[str, Any] | None, version: str | None, incomplete: str | None = None) -> None:
        """New weights (or the same tensors, changed in place; ``incomplete``: only part of them):
        on the GPU thread, between steps."""
        if params is not None:
            self._weights = pack(params, self._device)
        self._new_gen(version)
        self.incomplete = incomplete

    def _new_gen(self, version: str | None) -> None:
        """The tensors changed (on the GPU thread): a new generation, of ``version`` (None: a swap
        that failed part way)."""
        self._gen += 1
        self._versions = {g: v for g, v in self._versions.items() if g > self._gen - KEPT_VERSIONS}
        if version is not None:
            self._versions[self._gen] = version

    def check_complete(self) -> None:
        """On the GPU thread, before a prefill or a decode step: :class:`WeightsIncompleteError`
        while the weights hold part of a failed update (no token from half-loaded weights)."""
        if self.incomplete is not None:
            raise WeightsIncompleteError(f"the engine holds part of a failed weights update: {self.incomplete}")

    def _switched(self, version: str, result: dict[str, Any]) -> str:
        """The served version is now ``version``; returns the previous one."""
        previous = self._version
        self._version = version
        self._seed = self._seed_of(version)
        self.last_refit = {"version": version, **result}
        return previous

    async def load(self, path: str, version: str) -> tuple[str, dict[str, Any]]:
        """Weights from safetensors at ``path``: ``(previous version, result)``."""
        started = time.perf_counter()
        params = await self._worker.run(read_safetensors, path, self._shape, self._device, self._dtype)
        nbytes = sum(int(t.numel()) * int(t.element_size()) for t in params.values())
        await self._worker.run(self._install, params, version)
        result = {"source": path, "bytes": nbytes, "seconds": round(time.perf_counter() - started, 6)}
        return self._switched(version, result), result

    def export(self) -> WeightsExport:
        """The weights held now, to stream to a peer (:mod:`.stream`)."""
        return stream.export(self._weights, self._worker)

    async def load_stream(
        self, header: WeightsStreamHeader, pieces: AsyncIterator[bytes], version: str
    ) -> tuple[str, dict[str, Any]]:
        """A peer's weights, swapped in only once whole and at the announced digest: ``(previous version, result)``."""
        started = time.perf_counter()
        specs = stream.check_layout(header, self.params)
        received = await stream.receive(header, pieces, specs, self._device, self._worker)
        await self._worker.run(self._adopt, received, stream.verified_digest(header), version)
        result = {"source": "peer stream", "bytes": header.nbytes, "seconds": round(time.perf_counter() - started, 6)}
        return self._switched(version, result), result

    def _adopt(self, received: PackedWeights, digest: str, version: str) -> None:
        self._weights = received
        self._new_gen(version)
        self._verified = (self._gen, digest)

    async def init_collective(self, params: CollectiveInit) -> dict[str, Any]:
        rank = refit.engine_rank(params)
        refit.leave_group(self._group)
        self._group = None
        self._group = await refit.join_within(params, self._device)
        return {"rank": rank, "world_size": params.world_size, "backend": self._group.backend}

    async def prepare(self, params: PrepareRefitInfo) -> dict[str, Any]:
        group = self._require_group()
        group.specs = refit.check_specs(params.state_dict_info, self.params)
        return {"tensors": len(group.specs), "bytes": sum(s.nbytes for s in group.specs)}

    async def update_from_collective(self, params: CollectiveUpdate) -> tuple[str, dict[str, Any]]:
        """Receive the trainer's broadcast within ``params.timeout_s``; on any failure the group is
        left (the next update needs a new ``init``) and, when bytes had landed, the weights are
        marked incomplete until a good load."""
        group = self._require_group()
        deadline = time.monotonic() + params.timeout_s
        receiving = asyncio.ensure_future(self._worker.run(self._receive, group, deadline, params.version))
        try:
            result = await asyncio.wait_for(asyncio.shield(receiving), params.timeout_s + BACKSTOP_S)
        except TimeoutError:  # the GPU thread is stuck in the collective (NCCL): abort it
            self.abort_group()
            self.incomplete = f"rank {group.rank}: the update's broadcast did not end within {params.timeout_s:g}s"
            raise CollectiveError(self.incomplete, weights_changed=True) from None
        except CollectiveError:
            if self._group is group:
                refit.leave_group(group)
                self._group = None
            raise
        result["recompute_kv"] = "not done: in-flight sequences keep their KV" if params.recompute_kv else False
        return self._switched(params.version, result), result

    def abort_group(self) -> bool:
        """Abort and forget the group (from the event loop, even while an update runs on the GPU
        thread); whether there was one."""
        group, self._group = self._group, None
        if group is not None:
            refit.abort_group(group)
        return group is not None

    def _receive(self, group: refit.RefitGroup, deadline: float, version: str) -> dict[str, Any]:
        try:
            result = refit.receive_update(group, self._weights, self._device, deadline)
        except CollectiveError as exc:
            self._install(None, None, str(exc) if exc.weights_changed else self.incomplete)
            raise
        except BadRequestError:  # refused before any batch (no prepare_refit_info)
            raise
        except BaseException as exc:
            self._install(None, None, f"the update failed part way: {type(exc).__name__}: {exc}")
            raise
        self._install(None, version)  # tensors changed in place
        return result

    async def update_from_ipc(self, params: IpcUpdate) -> tuple[str, dict[str, Any]]:
        specs = refit.check_specs(params.state_dict_info, self.params)
        result = await self._worker.run(self._receive_ipc, specs, params.buffers, params.version)
        return self._switched(params.version, result), result

    def _receive_ipc(self, specs: list[TensorSpec], buffers: list[IpcBuffer], version: str) -> dict[str, Any]:
        try:
            result = refit.receive_ipc(self._ipc_maps, self._weights, specs, buffers, self._device)
        except BaseException:
            self._install(None, self._version)  # a partial copy, served as before (the server sees another digest)
            raise
        self._install(None, version)  # changed in place
        return result

    def _require_group(self) -> refit.RefitGroup:
        if self._group is None:
            raise BadRequestError(f"no refit group: POST {CONTROL_ROUTES[ControlOp.INIT_COLLECTIVE]} first")
        return self._group

    async def offload(self) -> None:
        """Sleep: the weights to host memory, the device's copy freed (idempotent)."""
        if self._host is None:
            self._host = await self._worker.run(_to_host, self.params)
            self._weights = PackedWeights({})
            self._ipc_maps.clear()
            self._verified = None

    async def restore(self) -> None:
        """Wake: the same values back on the device (KV computed before stays valid)."""
        if self._host is not None:
            host, self._host = self._host, None
            await self._worker.run(self._restore, host)

    def _restore(self, host: dict[str, Any]) -> None:
        self._weights = pack(host, self._device)


def _to_host(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to("cpu") for k, v in params.items()}
