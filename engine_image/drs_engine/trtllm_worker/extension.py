"""``DrsWorkerExtension``: the methods the engine calls on every TensorRT-LLM GPU worker.

Configured as ``ray_worker_extension_cls`` (the default in ``build_llm_kwargs``), TensorRT-LLM
mixes it into each Ray GPU worker, where ``self.engine`` is the PyExecutor and ``self.device_id``
the GPU. It extends TensorRT-LLM's own ``rlhf_utils.WorkerExtension`` (``update_weights`` over
IPC, ``reset_prefix_cache``, ``start_profile``/``stop_profile``) with:

* ``load_weights_from_path(path)``: read a safetensors checkpoint file by file and hand each file's
  tensors to the engine's own weight-update API (``model_loader.reload(model, weights,
  allow_partial_loading=True)``, the call TensorRT-LLM's ``update_weights`` makes), then the
  post-load hooks and a prefix-cache reset;
* NeMo RL's collective refit, by the same names and arguments as NeMo RL's ``NcclExtension``
  (``init_collective``, ``prepare_refit_info``, ``update_weights_from_collective``), receiving
  NeMo RL's packed broadcast (layout in :mod:`drs_protocol.nemo_rl_refit`) without importing ``nemo_rl``;
* ``load_weights_from_packed(path, state_dict_info)``: the same packed layout read from a file (a
  peer's weights stream, written there by the engine: the peer catch-up), batch by batch;
* keeping what a collective update received (``retain_to``): the first worker writes each batch it
  received, as it received it, to ``retain_to`` (``.part`` until whole, then renamed), so the
  engine can stream the weights it holds to a peer that catches up; a failure to write is logged
  and leaves no file, never fails the update;
* ``weights_digest()``: the :mod:`drs_protocol.weights_digest` of the bytes this worker handed to
  the engine's weight-update API in its last completed update, in the order it handed them (a
  collective update: the trainer's packed layout, so it equals the trainer's digest; a path: each
  file's tensors in the file's order); None before any update, or after a failed one. It proves
  what was transferred to the engine, not the engine's own (fused, re-laid) parameters.

Every step returns ``True`` on success and ``False`` on failure (logged with the traceback); the
engine treats a ``False`` from any worker as a failed operation. ``torch``, ``safetensors`` and
``nccl`` (nccl4py) are imported inside the methods: this module imports without them, so the
contract tests can check the method names against the strict TensorRT-LLM double.
NOT RUN on a GPU in this repository.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from drs_protocol.nemo_rl_refit import (
    Slot,
    TensorSpec,
    batch_bytes,
    checkpoint_files,
    packed_batches,
    parse_state_dict_info,
    target_packed_bytes,
    worker_rank,
)
from drs_protocol.weights_digest import TorchDigester
from tensorrt_llm._ray_utils import control_action_decorator
from tensorrt_llm.llmapi.rlhf_utils import WorkerExtension

log = logging.getLogger("drs_engine.trtllm_worker")

#: TCPStore key under which NeMo RL's rank 0 publishes the 128-byte NCCL unique id.
NCCL_UNIQUE_ID_KEY = "nccl_unique_id"


class DrsWorkerExtension(WorkerExtension):  # type: ignore[misc]
    """Weight loading and NeMo RL's collective refit on one TensorRT-LLM GPU worker."""

    engine: Any
    device_id: int
    _drs_digest: str | None
    _drs_digester: TorchDigester

    # -- load from a checkpoint path -------------------------------------------------------------

    @control_action_decorator  # type: ignore[untyped-decorator]
    def load_weights_from_path(self, path: str) -> bool:
        """Load every ``*.safetensors`` file under ``path`` into the running model."""
        try:
            from safetensors.torch import load_file

            files = checkpoint_files(path)
            self._begin_update()
            for file in files:
                weights = load_file(str(file), device=f"cuda:{self.device_id}")
                for tensor in weights.values():
                    self._drs_digester.update(tensor.contiguous())
                self._reload(weights)
                del weights
            self._finish_update()
            return True
        except Exception:
            log.exception("load_weights_from_path(%r) failed on device %s", path, self.device_id)
            self._abort_update()
            return False

    # -- NeMo RL's collective refit ----------------------------------------------------------------

    def init_collective(self, rank_prefix: int, ip: str, port: int, world_size: int, train_world_size: int) -> bool:
        """Join the trainer's NCCL group as rank ``train_world_size + rank_prefix + local_rank``."""
        try:
            import torch
            from nccl.core import Communicator, UniqueId

            rank = worker_rank(train_world_size, rank_prefix, torch.distributed.get_rank())
            store = torch.distributed.TCPStore(
                host_name=ip, port=port, world_size=world_size, is_master=False, timeout=_timeout()
            )
            store.wait([NCCL_UNIQUE_ID_KEY])
            unique_id = UniqueId.from_bytes(store.get(NCCL_UNIQUE_ID_KEY))
            with torch.cuda.device(self.device_id):
                comm = Communicator.init(nranks=world_size, rank=rank, unique_id=unique_id)
                warmup = torch.zeros(1, device=f"cuda:{self.device_id}")
                stream = torch.cuda.current_stream()
                comm.broadcast(sendbuf=warmup, recvbuf=warmup, root=0, stream=int(stream.cuda_stream))
                stream.synchronize()
            if float(warmup.item()) != 1.0:
                raise RuntimeError(f"NCCL warm-up broadcast from rank 0 gave {warmup.item()}, expected 1.0")
            self._drs_group = comm
            self._drs_rank = rank
            return True
        except Exception:
            log.exception("init_collective(rank_prefix=%s, %s:%s) failed", rank_prefix, ip, port)
            return False

    def prepare_refit_info(self, state_dict_info: dict[str, Any]) -> bool:
        """Remember the tensors to come (``{name: [shape, dtype]}``; dtypes become ``torch.dtype``)."""
        try:
            import torch

            specs = parse_state_dict_info(state_dict_info)
            self._drs_specs = specs
            self._drs_dtypes = {s.dtype: getattr(torch, s.dtype) for s in specs}
            return True
        except Exception:
            log.exception("prepare_refit_info failed")
            return False

    def update_weights_from_collective(
        self, drain: bool = True, recompute_kv: bool = False, retain_to: str | None = None
    ) -> bool:
        """Receive NeMo RL's packed broadcast and load it (``recompute_kv`` is accepted as NeMo RL's
        signature has it; the prefix cache is reset after every update either way); the first
        worker keeps the bytes at ``retain_to`` when given (see the module)."""
        specs: list[TensorSpec] | None = getattr(self, "_drs_specs", None)
        group = getattr(self, "_drs_group", None)
        if specs is None or group is None:
            log.error("update_weights_from_collective before init_collective/prepare_refit_info")
            return False
        keep: _Retained | None = None
        with self.engine.control_action(drain=drain):
            try:
                import torch

                torch.cuda.synchronize()
                self._begin_update()
                total = torch.cuda.get_device_properties(self.device_id).total_memory
                if retain_to and torch.distributed.get_rank() == 0:
                    keep = _Retained.open(retain_to)
                for batch in packed_batches(specs, target_packed_bytes(total)):
                    buffer = self._receive(group, batch)
                    if keep is not None:
                        keep.write(buffer)
                    self._reload(dict(self._tensors(buffer, batch)))
                self._finish_update()
                torch.cuda.current_stream().synchronize()
                if keep is not None:
                    keep.commit()
                return True
            except Exception:
                log.exception("update_weights_from_collective failed")
                self._abort_update()
                if keep is not None:
                    keep.drop()
                return False

    # -- a peer's weights, from a file ------------------------------------------------------------

    def load_weights_from_packed(self, path: str, state_dict_info: dict[str, Any]) -> bool:
        """Load the packed layout ``state_dict_info`` from the file at ``path`` (exactly its bytes)."""
        try:
            import torch

            specs = parse_state_dict_info(state_dict_info)
            self._drs_dtypes = {s.dtype: getattr(torch, s.dtype) for s in specs}
            total = torch.cuda.get_device_properties(self.device_id).total_memory
            self._begin_update()
            with open(path, "rb") as fh:
                for batch in packed_batches(specs, target_packed_bytes(total)):
                    size = batch_bytes(batch)
                    raw = bytearray(fh.read(size))
                    if len(raw) != size:
                        raise ValueError(f"{path}: {len(raw)} bytes where the layout needs {size}")
                    buffer = torch.frombuffer(raw, dtype=torch.uint8).to(f"cuda:{self.device_id}")
                    self._drs_digester.update(buffer)
                    self._reload(dict(self._tensors(buffer, batch)))
                if fh.read(1):
                    raise ValueError(f"{path}: longer than the layout")
            self._finish_update()
            return True
        except Exception:
            log.exception("load_weights_from_packed(%r) failed on device %s", path, self.device_id)
            self._abort_update()
            return False

    # -- shared steps ----------------------------------------------------------------------------

    def weights_digest(self) -> str | None:
        """The digest of what the last completed update handed to the engine (see the module)."""
        return getattr(self, "_drs_digest", None)

    def _receive(self, group: Any, batch: list[Slot]) -> Any:
        """One packed batch of the broadcast, on this GPU (counted into the digest)."""
        import torch

        buffer = torch.empty(batch_bytes(batch), dtype=torch.uint8, device=f"cuda:{self.device_id}")
        stream = torch.cuda.current_stream()
        group.broadcast(sendbuf=buffer, recvbuf=buffer, root=0, stream=int(stream.cuda_stream))
        self._drs_digester.update(buffer)
        return buffer

    def _tensors(self, buffer: Any, batch: list[Slot]) -> Iterator[tuple[str, Any]]:
        """The batch's tensors, as views of ``buffer`` (its packed bytes)."""
        for slot in batch:
            dtype = self._drs_dtypes[slot.spec.dtype]
            piece = buffer[slot.offset : slot.offset + slot.spec.nbytes]
            if slot.offset % dtype.itemsize:
                piece = piece.clone()  # unaligned slice (no padding between tensors)
            yield slot.spec.name, piece.view(dtype).reshape(slot.spec.shape)

    def _modules(self) -> Iterator[Any]:
        for module in self.engine.model_engine.model.modules():
            if not getattr(module, "_weights_removed", False):
                yield module

    def _begin_update(self) -> None:
        self._drs_digest = None
        self._drs_digester = TorchDigester()
        loader = self.engine.model_engine.model_loader
        if hasattr(loader, "begin_update_weights"):
            loader.begin_update_weights()
        for module in self._modules():
            if hasattr(module, "pre_reload_weights"):
                module.pre_reload_weights()

    def _reload(self, weights: dict[str, Any]) -> None:
        engine = self.engine.model_engine
        engine.model_loader.reload(engine.model, weights, allow_partial_loading=True)

    def _finish_update(self) -> None:
        finalize = getattr(WorkerExtension, "finalize_weight_update", None)
        if finalize is not None:  # newer TensorRT-LLM: its own CUDA-graph-safe finalize
            finalize(self)
        else:
            loader = self.engine.model_engine.model_loader
            if hasattr(loader, "finalize_update_weights"):
                loader.finalize_update_weights()
            for module in self._modules():
                if hasattr(module, "process_weights_after_loading"):
                    module.process_weights_after_loading()
                if hasattr(module, "post_load_weights"):
                    module.post_load_weights()
        self.engine.reset_prefix_cache()
        self._drs_digest = self._drs_digester.hexdigest()

    def _abort_update(self) -> None:
        self._drs_digest = None
        loader = getattr(getattr(self.engine, "model_engine", None), "model_loader", None)
        if loader is not None and hasattr(loader, "abort_update_weights"):
            try:
                loader.abort_update_weights()
            except Exception:
                log.exception("abort_update_weights failed")


class _Retained:
    """The file a collective update's bytes are kept in, written batch by batch."""

    def __init__(self, path: str, fh: Any) -> None:
        self.path = path
        self._fh: Any = fh

    @classmethod
    def open(cls, path: str) -> _Retained | None:
        try:
            return cls(path, open(path + ".part", "wb"))
        except OSError:
            log.exception("cannot keep the update's weights at %s: peers cannot catch up from this engine", path)
            return None

    def write(self, buffer: Any) -> None:
        if self._fh is None:
            return
        try:
            self._fh.write(buffer.cpu().numpy().tobytes())
        except OSError:
            log.exception(
                "keeping the update's weights at %s failed: peers cannot catch up from this engine", self.path
            )
            self.drop()

    def commit(self) -> None:
        if self._fh is None:
            return
        try:
            self._fh.close()
            os.replace(self.path + ".part", self.path)
        except OSError:
            log.exception(
                "keeping the update's weights at %s failed: peers cannot catch up from this engine", self.path
            )
            self.drop()

    def drop(self) -> None:
        """Leave no file (the update failed, or writing it did)."""
        fh, self._fh = self._fh, None
        if fh is None:
            return
        try:
            fh.close()
            os.unlink(self.path + ".part")
        except OSError:
            pass


def _timeout() -> Any:
    import datetime

    return datetime.timedelta(seconds=float(os.environ.get("DRS_REFIT_GROUP_TIMEOUT_S", "600")))
