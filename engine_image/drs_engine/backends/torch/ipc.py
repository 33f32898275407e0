"""CUDA IPC in plain fields (base64 and ints, never a pickle): how one process on a host maps
another's GPU tensor. The KV handoff (:mod:`.handoff`), the handoff arena (:mod:`.kv.arena`), the
colocated refit (:mod:`.weights.refit`) and the example trainer all use it."""

from __future__ import annotations

import base64
import socket
from functools import cache
from typing import Any

from drs_engine.errors import KvTransferError


@cache
def host_id() -> str:
    """This host, as two engines on it see it alike (hostname and kernel boot id)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot = fh.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


def ipc_export(tensor: Any) -> dict[str, Any]:
    """The fields a process on this host needs to map ``tensor`` (a CUDA tensor) into its own space."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    (_, size, stride, offset, _, _, device, handle, size_bytes, offset_bytes, _, rc_handle, rc_offset, ev, ev_sync) = (
        args
    )
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "device": int(device),
        "handle": _b64(handle),
        "storage_size_bytes": int(size_bytes),
        "storage_offset_bytes": int(offset_bytes),
        "ref_counter_handle": _b64(rc_handle),
        "ref_counter_offset": int(rc_offset),
        "event_handle": _b64(ev),
        "event_sync_required": bool(ev_sync),
    }


def ipc_import(fields: dict[str, Any], dtype: Any, local_device: int) -> Any:
    """The producer's tensor, mapped into this process on ``local_device`` (the same GPU under this
    process's numbering)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(fields["size"]),
            tuple(fields["stride"]),
            int(fields["offset"]),
            torch.storage.TypedStorage,
            dtype,
            local_device,
            _unb64(fields["handle"]),
            int(fields["storage_size_bytes"]),
            int(fields["storage_offset_bytes"]),
            False,
            _unb64(fields["ref_counter_handle"]),
            int(fields["ref_counter_offset"]),
            _unb64(fields["event_handle"]),
            bool(fields["event_sync_required"]),
        )
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise KvTransferError(f"cannot map the prefill engine's KV by CUDA IPC: {exc}") from exc


def event_handle(event: Any) -> str:
    """A recorded interprocess CUDA event's IPC handle, base64 (URL-safe: it travels in a query)."""
    return base64.urlsafe_b64encode(event.ipc_handle()).decode("ascii")


def open_event(handle: str, device: Any) -> Any:
    """The event :func:`event_handle` named, opened in this process (on the same host)."""
    import torch

    try:
        return torch.cuda.Event.from_ipc_handle(device, base64.urlsafe_b64decode(handle))
    except (ValueError, TypeError, RuntimeError) as exc:
        raise KvTransferError(f"cannot open the decode engine's copy event by CUDA IPC: {exc}") from exc


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode("ascii")


def _unb64(value: str | None) -> bytes | None:
    return None if value is None else base64.b64decode(value)


@cache
def local_gpu_uuids() -> dict[str, int]:
    """UUID → device index of every GPU this process sees."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}


def gpu_uuid(device: Any) -> str | None:
    import torch

    if getattr(device, "type", None) != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)
