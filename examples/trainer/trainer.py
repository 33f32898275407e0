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

Prints one JSON line: bytes, batches, and the refit's seconds and GB/s (trainer side: the
broadcast; for ``ipc``, the whole call through the sidecar).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from drs_client import Sidecar, SidecarError
from drs_engine.backends.torch.ipc import gpu_uuid, ipc_export
from drs_engine.backends.torch.model import parse_dtype, random_state_dict, resolve_model
from drs_engine.backends.torch.weights.packed import pack, specs_of
from drs_engine.backends.torch.weights.refit import GROUP_TIMEOUT, make_group
from drs_engine.weights.digest import torch_weights_digest
from drs_protocol import env
from drs_protocol.weights_pack import (
    DEFAULT_TARGET_BYTES,
    STORE_KEY_BACKEND,
    STORE_KEY_TARGET_BYTES,
    STORE_KEY_WORLD_SIZE,
    batch_ranges,
)


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
    return p.parse_args(argv)


def save_checkpoint(directory: Path, shape_config: dict[str, Any], tensors: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(shape_config, indent=2))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))


def broadcast(group: Any, flat: Any, ranges: list[tuple[int, int, Any]], where: Any) -> float:
    """Broadcast every batch (a range of the packed buffer); the seconds from the first send to
    the last one's completion."""
    started = time.perf_counter()
    for start, end, _ in ranges:
        buffer = flat[start:end] if where.type == flat.device.type else flat[start:end].to(where)
        group.broadcast([buffer], dist.BroadcastOptions()).wait()
    if where.type == "cuda":
        torch.cuda.synchronize(where)
    return time.perf_counter() - started


def collective(
    args: argparse.Namespace, sidecar: Sidecar, flat: Any, info: dict[str, Any], body: dict[str, Any]
) -> dict[str, Any]:
    """The non-colocated refit: form the group, prepare, broadcast ``--updates`` times."""
    device = torch.device(args.device)
    store = dist.TCPStore(args.ip, 0, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
    store.set(STORE_KEY_BACKEND, args.backend)
    store.set(STORE_KEY_TARGET_BYTES, str(args.target_bytes))
    where = device if args.backend == "nccl" else torch.device("cpu")
    ranges = batch_ranges(list(specs_of_info(info)), args.target_bytes)
    with ThreadPoolExecutor(max_workers=1) as pool:
        joining = pool.submit(sidecar.collective_init, args.ip, store.port, 1)
        store.wait([STORE_KEY_WORLD_SIZE])
        world_size = int(store.get(STORE_KEY_WORLD_SIZE).decode())
        group = make_group(store, args.backend, 0, world_size, device)
        init = joining.result()
        sidecar.collective_prepare(info)
        seconds, update = 0.0, None
        for _ in range(args.updates):
            updating = pool.submit(
                sidecar.collective_update, body["version"], path=body.get("path"), digest=body.get("digest")
            )
            seconds = broadcast(group, flat, ranges, where)
            update = updating.result()
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
    digest = torch_weights_digest(
        weights.flat, weights.params
    )  # over what it sends: every engine must hold exactly this
    body: dict[str, Any] = {"version": version, "digest": digest}
    if args.save is not None:
        body["path"] = str(args.save)
    run = colocated if args.backend == "ipc" else collective
    try:
        with Sidecar(args.sidecar) as sidecar:
            done = run(args, sidecar, weights.flat, info, body)
    except SidecarError as exc:  # names each engine that failed, or the sidecar's refusal
        raise SystemExit(f"trainer: {exc}") from exc
    nbytes = weights.nbytes
    seconds = done["seconds"]
    print(
        json.dumps(
            {
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
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
