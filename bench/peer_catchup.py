"""Catching up from a serving peer over HTTP against loading the same bytes from a checkpoint on
disk (prints one JSON line).

Two real ``torch`` engines in this process on loopback: a peer that loaded a safetensors
checkpoint of ``--size`` (``random_state_dict``, seeded) and a receiver. Each round brings the
receiver to the peer's weights twice, by the engine's own code path for a catch-up
(:func:`drs_engine.weights.desired.reach`): once with the checkpoint path (safetensors read into
the packed weights, then the digest measured on the device), once without (the peer's
``GET /control/weights/stream``: its packed bytes over HTTP into a new buffer on the device, the
digest checked before the swap, then measured again). The order alternates between rounds; one
warm-up round of each is not counted. The checkpoint is read through the page cache after the
first round (a warm local disk: the fastest a disk load gets). ``ratio`` is the median peer time
over the median disk time (below 1: the peer is faster).

    python bench/peer_catchup.py [--size small] [--device cpu|cuda] [--precision float32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from drs_engine.config import build_config
from drs_engine.server.runner import start_engine
from drs_engine.weights.desired import reach
from drs_protocol import fields
from drs_protocol.routes import CONTROL_ROUTES, CONTROL_WEIGHTS, ControlOp
from drs_protocol.weights_state import DesiredWeights

TOKEN = "bench-peer-catchup"


def config(size: str, device: str, precision: str) -> Any:
    return build_config(
        {
            "backend": "torch",
            "role": "decode",
            "host": "127.0.0.1",
            "port": 0,
            "model": {"path": f"random:{size}", "precision": precision, "maxModelLen": 2048},
            "torch": {"device": device},
        }
    )


def write_checkpoint(root: Path, size: str, device: str, precision: str) -> int:
    import torch
    from drs_engine.backends.torch.model import SIZES, parse_dtype, random_state_dict
    from safetensors.torch import save_file

    params = random_state_dict(SIZES[size], seed=7, device="cpu", dtype=parse_dtype(precision))
    save_file({k: v.contiguous() for k, v in params.items()}, str(root / "model.safetensors"))
    del torch
    return sum(int(v.numel()) * int(v.element_size()) for v in params.values())


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median_s": round(statistics.median(values), 4),
        "min_s": round(min(values), 4),
        "max_s": round(max(values), 4),
    }


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="peer-catchup-") as tmp:
        root = Path(tmp)
        nbytes = write_checkpoint(root, args.size, args.device, args.precision)
        async with (
            start_engine(config(args.size, args.device, args.precision), control_token=TOKEN) as peer,
            start_engine(config(args.size, args.device, args.precision), control_token=TOKEN) as receiver,
            httpx.AsyncClient(timeout=600) as client,
        ):
            load = await client.post(
                peer.url + CONTROL_ROUTES[ControlOp.LOAD_WEIGHTS],
                json={"path": str(root), "version": "step-1"},
                headers=fields.control_auth(TOKEN),
            )
            load.raise_for_status()
            digest = (await client.get(peer.url + CONTROL_WEIGHTS, headers=fields.control_auth(TOKEN))).json()[
                "weights_digest"
            ]
            backend = receiver.server.state.require_backend()
            from_disk = DesiredWeights(version="step-1", path=str(root), digest=digest)
            from_peer = DesiredWeights(version="step-1", digest=digest)
            times: dict[str, list[float]] = {"disk": [], "peer": []}
            for round_ in range(args.rounds + 1):
                order = [("disk", from_disk), ("peer", from_peer)]
                for name, desired in order if round_ % 2 else order[::-1]:
                    started = time.perf_counter()
                    reached, _ = await reach(backend, desired, [peer.url], TOKEN)
                    elapsed = time.perf_counter() - started
                    assert reached == digest, f"{name}: reached {reached}, not {digest}"
                    if round_:  # round 0 warms up both
                        times[name].append(elapsed)
    disk, peer_ = statistics.median(times["disk"]), statistics.median(times["peer"])
    return {
        "bench": "peer_catchup",
        "size": args.size,
        "precision": args.precision,
        "device": args.device,
        "bytes": nbytes,
        "rounds": args.rounds,
        "disk": {**spread(times["disk"]), "gbps": round(nbytes / disk / 1e9, 3)},
        "peer_http": {**spread(times["peer"]), "gbps": round(nbytes / peer_ / 1e9, 3)},
        "ratio": round(peer_ / disk, 3),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
        "commit": commit(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "0.6b"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
