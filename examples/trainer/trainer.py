"""An example trainer process: broadcast new weights into every ``torch`` engine through ``drs sidecar``.

What a NeMo RL trainer does at a non-colocated refit, in one script (rank 0 of the refit group):

1. host a TCPStore at ``--ip``/a free port and write the group's backend and bucket size into it
   (:mod:`drs_protocol.weights_pack`);
2. ``POST /v1/collective/init`` to the sidecar (which gives every engine its ranks) while joining
   the group as rank 0 — the group's size is the one the engines write into the store;
3. ``POST /v1/collective/prepare`` with every tensor's name, shape and dtype;
4. ``POST /v1/collective/update`` while broadcasting the tensors packed into large buckets.

The "new weights" are a seeded random Qwen3 model (``--model random:<size> --seed N``); ``--save
DIR`` also writes them as a Hugging Face checkpoint (``config.json`` + ``model.safetensors``), so
engines that come back later, or a test, can load the same weights from disk.

    python examples/trainer/trainer.py --sidecar http://127.0.0.1:8400 --model random:0.6b \\
        --seed 7 --version step-7 --device cuda:0 --backend nccl

Prints one JSON line: bytes, buckets, and the broadcast's seconds and GB/s (trainer side).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist
from drs_engine.backends.torch_model import parse_dtype, random_state_dict, resolve_model
from drs_engine.backends.torch_refit import GROUP_TIMEOUT, make_group, pack_bucket
from drs_protocol.routes import TrainerRoute
from drs_protocol.weights_pack import (
    DEFAULT_BUCKET_BYTES,
    STORE_KEY_BACKEND,
    STORE_KEY_BUCKET_BYTES,
    STORE_KEY_WORLD_SIZE,
    parse_state_dict_info,
    plan_buckets,
)

#: Seconds for the sidecar's answer to each step (a step waits for every engine).
STEP_TIMEOUT_S = 600.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sidecar", required=True, help="the sidecar's URL (http://127.0.0.1:8400)")
    p.add_argument("--model", default="random:tiny", help="random:<size> (the engines' architecture)")
    p.add_argument("--seed", type=int, required=True, help="seed of the new weights")
    p.add_argument("--version", default=None, help="version the engines serve them as (default step-SEED)")
    p.add_argument("--precision", default="bfloat16")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl" if torch.cuda.is_available() else "gloo")
    p.add_argument("--ip", default="127.0.0.1", help="address the engines reach this trainer's store at")
    p.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    p.add_argument("--save", type=Path, default=None, help="also write the weights as an HF checkpoint here")
    p.add_argument("--updates", type=int, default=1, help="broadcast this many times (the last one is timed)")
    return p.parse_args(argv)


def save_checkpoint(directory: Path, shape_config: dict[str, Any], tensors: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(shape_config, indent=2))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))


def post(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(url, json=body, timeout=STEP_TIMEOUT_S)
    if response.status_code != 200:
        raise SystemExit(f"trainer: {url} answered {response.status_code}: {response.text[:2000]}")
    data: dict[str, Any] = response.json()
    return data


def broadcast(group: Any, tensors: dict[str, Any], info: dict[str, Any], bucket_bytes: int, where: Any) -> float:
    """Pack and broadcast every bucket; returns the seconds from the first pack to the last send."""
    buckets = plan_buckets(parse_state_dict_info(info), bucket_bytes)
    started = time.perf_counter()
    for bucket in buckets:
        group.broadcast([pack_bucket(bucket, tensors, where)], dist.BroadcastOptions()).wait()
    if where.type == "cuda":
        torch.cuda.synchronize(where)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source = resolve_model(args.model)
    device = torch.device(args.device)
    tensors = random_state_dict(source.shape, seed=args.seed, device=device, dtype=parse_dtype(args.precision))
    version = args.version or f"step-{args.seed}"
    if args.save is not None:
        save_checkpoint(args.save, source.shape.to_hf_config(), tensors)
    info = {name: [list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in tensors.items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    store = dist.TCPStore(args.ip, 0, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
    store.set(STORE_KEY_BACKEND, args.backend)
    store.set(STORE_KEY_BUCKET_BYTES, str(args.bucket_bytes))
    sidecar = args.sidecar.rstrip("/")
    where = device if args.backend == "nccl" else torch.device("cpu")
    with httpx.Client() as client, ThreadPoolExecutor(max_workers=1) as pool:
        joining = pool.submit(
            post,
            client,
            sidecar + TrainerRoute.COLLECTIVE_INIT,
            {"ip": args.ip, "port": store.port, "train_world_size": 1},
        )
        store.wait([STORE_KEY_WORLD_SIZE])
        world_size = int(store.get(STORE_KEY_WORLD_SIZE).decode())
        group = make_group(store, args.backend, 0, world_size, device)
        init = joining.result()
        post(client, sidecar + TrainerRoute.COLLECTIVE_PREPARE, {"state_dict_info": info})
        body: dict[str, Any] = {"version": version}
        if args.save is not None:
            body["path"] = str(args.save)
        seconds = 0.0
        for _ in range(args.updates):
            updating = pool.submit(post, client, sidecar + TrainerRoute.COLLECTIVE_UPDATE, body)
            seconds = broadcast(group, tensors, info, args.bucket_bytes, where)
            update = updating.result()
    print(
        json.dumps(
            {
                "version": version,
                "world_size": world_size,
                "backend": args.backend,
                "bytes": nbytes,
                "buckets": len(plan_buckets(parse_state_dict_info(info), args.bucket_bytes)),
                "broadcast_s": round(seconds, 6),
                "broadcast_gb_per_s": round(nbytes / seconds / 1e9, 3) if seconds else None,
                "group": init.get("group"),
                "engines_ok": update.get("ok"),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
