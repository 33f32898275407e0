"""An example trainer process: refit every ``torch`` engine with new weights through ``drs sidecar``.

Its weights live packed in one buffer, in the one refit layout (:mod:`drs_protocol.weights_pack`:
``state_dict_info`` order, no padding; the parameters are views of it, as a Megatron-style trainer
keeps its parameters in contiguous buffers), so a refit sends the buffer itself, cut into batches.

``--backend nccl|gloo``: what a NeMo RL trainer does at a non-colocated refit (rank 0 of the group):

1. host a TCPStore at ``--ip``/a free port and write the group's backend and batch target into it;
2. ``POST /v1/collective/init`` to the sidecar (which gives every engine its ranks) while joining
   the group as rank 0 — the group's size is the one the engines write into the store;
3. ``POST /v1/collective/prepare`` with every tensor's name, shape and dtype;
4. ``POST /v1/collective/update`` while broadcasting each batch (one range of the packed buffer).

``--backend ipc``: the colocated refit (trainer and engines on the same host, sharing GPUs):
``POST /v1/weights/ipc`` with ``state_dict_info`` and the batches as CUDA IPC handles of the packed
buffer; every engine copies them into its weights while the trainer keeps the buffer unchanged.

The "new weights" are a seeded random Qwen3 model (``--model random:<size> --seed N``); ``--save
DIR`` also writes them as a Hugging Face checkpoint (``config.json`` + ``model.safetensors``), so
engines that come back later, or a test, can load the same weights from disk.

    python examples/trainer/trainer.py --sidecar http://127.0.0.1:8400 --model random:0.6b \\
        --seed 7 --version step-7 --device cuda:0 --backend nccl

A collective step that fails (a member hung, died or answered an error: the sidecar's 502 with
``group_abort`` naming the culprit, within its ``--collective-timeout``) is retried once with a new
group, formed from the fleet as it is then; the trainer's own broadcasts wait at most
``--collective-timeout`` each step, so it never hangs on a member either.

Prints one JSON line: bytes, batches, and the refit's seconds and GB/s (trainer side: the
broadcast; for ``ipc``, the whole call through the sidecar), and ``retried`` with the first
attempt's culprit when it had to.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from drs_client import Sidecar, SidecarError
from drs_client.errors import EnginesFailed
from drs_engine.backends.torch.ipc import gpu_uuid, ipc_export
from drs_engine.backends.torch.model import parse_dtype, random_state_dict, resolve_model
from drs_engine.backends.torch.weights.packed import pack, specs_of
from drs_engine.backends.torch.weights.refit import broadcast_within, make_group
from drs_engine.weights.digest import torch_weights_digest
from drs_protocol import env
from drs_protocol.limits import DEFAULT_COLLECTIVE_TIMEOUT_S
from drs_protocol.weights_pack import (
    DEFAULT_TARGET_BYTES,
    STORE_KEY_BACKEND,
    STORE_KEY_TARGET_BYTES,
    STORE_KEY_WORLD_SIZE,
    batch_ranges,
)

#: Seconds between looks at the store while the sidecar's collective/init is in flight.
STORE_LOOK_S = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sidecar = os.environ.get(env.SIDECAR_URL)
    p.add_argument(
        "--sidecar",
        default=sidecar,
        required=sidecar is None,
        help=f"the sidecar's URL (http://127.0.0.1:8400); default: ${env.SIDECAR_URL}",
    )
    p.add_argument("--model", default="random:tiny", help="random:<size> (the engines' architecture)")
    p.add_argument("--seed", type=int, required=True, help="seed of the new weights")
    p.add_argument("--version", default=None, help="version the engines serve them as (default step-SEED)")
    p.add_argument("--precision", default="bfloat16")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--backend", choices=["nccl", "gloo", "ipc"], default="nccl" if torch.cuda.is_available() else "gloo"
    )
    p.add_argument("--ip", default="127.0.0.1", help="address the engines reach this trainer's store at")
    p.add_argument("--target-bytes", type=int, default=DEFAULT_TARGET_BYTES, help="batch target of the packing")
    p.add_argument("--save", type=Path, default=None, help="also write the weights as an HF checkpoint here")
    p.add_argument("--updates", type=int, default=1, help="broadcast this many times (the last one is timed)")
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=DEFAULT_COLLECTIVE_TIMEOUT_S,
        help="seconds this trainer's part of one collective step may wait (as the sidecar's flag)",
    )
    return p.parse_args(argv)


def save_checkpoint(directory: Path, shape_config: dict[str, Any], tensors: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(shape_config, indent=2))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))


def broadcast(
    group: Any, flat: Any, ranges: list[tuple[int, int, Any]], where: Any, timeout_s: float, on_batch: Any = None
) -> float:
    """Broadcast every batch (a range of the packed buffer), all within ``timeout_s``; the seconds
    from the first send to the last one's completion. ``on_batch(i)`` after batch ``i`` (tests)."""
    started = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    for i, (start, end, _) in enumerate(ranges):
        buffer = flat[start:end] if where.type == flat.device.type else flat[start:end].to(where)
        broadcast_within(group, buffer, deadline)
        if on_batch is not None:
            on_batch(i)
    if where.type == "cuda":
        torch.cuda.synchronize(where)
    return time.perf_counter() - started


def collective(
    args: argparse.Namespace,
    sidecar: Sidecar,
    flat: Any,
    info: dict[str, Any],
    body: dict[str, Any],
    on_batch: Any = None,
    on_retry: Any = None,
) -> dict[str, Any]:
    """The non-colocated refit; when the sidecar aborted the group (its 502 names the culprit), a
    new group is formed from the fleet as it is now and the refit tried once more (``on_batch``,
    ``on_retry(error)``: hooks for tests)."""
    try:
        return collective_once(args, sidecar, flat, info, body, on_batch)
    except EnginesFailed as exc:
        if exc.report.group_abort is None:
            raise
        print(f"trainer: {exc}; forming a new group and trying once more", file=sys.stderr, flush=True)
        if on_retry is not None:
            on_retry(exc)
        done = collective_once(args, sidecar, flat, info, body, None)
        return {**done, "retried": {"culprits": exc.report.group_abort.culprits, "why": exc.report.group_abort.message}}


def wait_for_engines(store: Any, joining: Any, timeout_s: float) -> None:
    """Until the engines wrote the group's size into the store, or the sidecar answered first (it
    refused the group: its error is raised), at most ``timeout_s``: waits on the sidecar's answer,
    looking at the store between waits of :data:`STORE_LOOK_S`."""
    deadline = time.monotonic() + timeout_s
    while not store.check([STORE_KEY_WORLD_SIZE]):
        if joining.done():
            joining.result()  # the sidecar's refusal, answered before the engines joined
            raise RuntimeError("the sidecar formed the group without this trainer")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engines did not join the group within {timeout_s:g}s")
        futures.wait([joining], timeout=STORE_LOOK_S)


def collective_once(
    args: argparse.Namespace, sidecar: Sidecar, flat: Any, info: dict[str, Any], body: dict[str, Any], on_batch: Any
) -> dict[str, Any]:
    """Form the group, prepare, broadcast ``--updates`` times. A failure of this side (a member
    gone: the broadcast raises by its deadline) waits for the sidecar's answer, which names the
    culprit."""
    from datetime import timedelta

    device = torch.device(args.device)
    timeout = timedelta(seconds=args.collective_timeout)
    store = dist.TCPStore(args.ip, 0, is_master=True, timeout=timeout, wait_for_workers=False)
    store.set(STORE_KEY_BACKEND, args.backend)
    store.set(STORE_KEY_TARGET_BYTES, str(args.target_bytes))
    where = device if args.backend == "nccl" else torch.device("cpu")
    ranges = batch_ranges(list(specs_of_info(info)), args.target_bytes)
    group = None
    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            joining = pool.submit(sidecar.collective_init, args.ip, store.port, 1)
            try:
                wait_for_engines(store, joining, args.collective_timeout)
                world_size = int(store.get(STORE_KEY_WORLD_SIZE).decode())
                group = make_group(store, args.backend, 0, world_size, device, timeout)
            except RuntimeError:
                joining.result()  # the sidecar's 502 names who did not join
                raise
            init = joining.result()
            sidecar.collective_prepare(info)
            seconds, update = 0.0, None
            for _ in range(args.updates):
                updating = pool.submit(
                    sidecar.collective_update, body["version"], path=body.get("path"), digest=body.get("digest")
                )
                try:
                    seconds = broadcast(group, flat, ranges, where, args.collective_timeout, on_batch)
                except RuntimeError:
                    updating.result()  # the sidecar's 502 names the member that failed
                    raise
                update = updating.result()
        finally:
            if group is not None:
                group.abort()  # this group is done with (a new refit forms its own)
    return {
        "world_size": world_size,
        "batches": len(ranges),
        "seconds": seconds,
        "group": init.group.model_dump(mode="json"),
        "engines_ok": None if update is None else update.ok,
    }


def colocated(
    args: argparse.Namespace, sidecar: Sidecar, flat: Any, info: dict[str, Any], body: dict[str, Any]
) -> dict[str, Any]:
    """The colocated refit: the batches as CUDA IPC handles of the packed buffer, ``--updates`` times."""
    ranges = batch_ranges(list(specs_of_info(info)), args.target_bytes)
    uuid = gpu_uuid(flat.device)
    buffers = [{"gpu_uuid": uuid, "offset": a, "nbytes": b - a, "ipc": ipc_export(flat[a:b])} for a, b, _ in ranges]
    torch.cuda.synchronize(flat.device)  # the buffer is complete before any engine reads it
    seconds, update = 0.0, None
    for _ in range(args.updates):
        started = time.perf_counter()
        update = sidecar.ipc_update(body["version"], info, buffers, path=body.get("path"), digest=body.get("digest"))
        seconds = time.perf_counter() - started
    engines_ok = None if update is None else update.ok
    return {"world_size": None, "batches": len(ranges), "seconds": seconds, "group": None, "engines_ok": engines_ok}


def specs_of_info(info: dict[str, Any]) -> Any:
    from drs_protocol.nemo_rl_refit import parse_state_dict_info

    return parse_state_dict_info(info)


def refit(args: argparse.Namespace, on_batch: Any = None, on_retry: Any = None) -> dict[str, Any]:
    """One refit as ``args`` say; its report (``on_batch``, ``on_retry``: hooks of :func:`collective`).
    Raises :class:`SidecarError` naming each engine that failed, or the sidecar's refusal."""
    source = resolve_model(args.model)
    device = torch.device(args.device)
    if args.backend == "ipc" and device.type != "cuda":
        raise SystemExit("trainer: --backend ipc shares GPU buffers: --device must be a CUDA device")
    weights = pack(
        random_state_dict(source.shape, seed=args.seed, device=device, dtype=parse_dtype(args.precision)), device
    )
    version = args.version or f"step-{args.seed}"
    if args.save is not None:
        save_checkpoint(args.save, source.shape.to_hf_config(), weights.params)
    info = {s.name: [list(s.shape), s.dtype] for s in specs_of(weights.params)}
    digest = torch_weights_digest(weights.flat, weights.params)  # over what it sends: every engine must hold it
    body: dict[str, Any] = {"version": version, "digest": digest}
    if args.save is not None:
        body["path"] = str(args.save)
    with Sidecar(args.sidecar) as sidecar:
        if args.backend == "ipc":
            done = colocated(args, sidecar, weights.flat, info, body)
        else:
            done = collective(args, sidecar, weights.flat, info, body, on_batch, on_retry)
    nbytes = weights.nbytes
    seconds = done["seconds"]
    return {
        "version": version,
        "digest": digest,
        "world_size": done["world_size"],
        "backend": args.backend,
        "bytes": nbytes,
        "buckets": done["batches"],
        "broadcast_s": round(seconds, 6),
        "broadcast_gb_per_s": round(nbytes / seconds / 1e9, 3) if seconds else None,
        "group": done["group"],
        "engines_ok": done["engines_ok"],
        "retried": done.get("retried"),
    }


def main(argv: list[str] | None = None) -> int:
    try:
        report = refit(parse_args(argv))
    except SidecarError as exc:  # names each engine that failed, or the sidecar's refusal
        raise SystemExit(f"trainer: {exc}") from exc
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
