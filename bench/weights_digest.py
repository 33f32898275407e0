"""The weights digest's speed against a copy of the same bytes (prints one JSON line).

``numpy``: :func:`drs_protocol.weights_digest.digest_numpy` over host bytes (the sim engine and
checkpoint files) against ``numpy.copyto``. ``torch``: the torch engine's digest
(:func:`drs_engine.weights.digest.fused_digest`: one fused multiply-reduce, compiled on CUDA) on
the device (``cuda`` when there is one, else ``cpu``; torch needed) against ``Tensor.copy_`` of
the same buffer on the same device: the issue's target is a GPU digest at >= 0.5x the device copy,
so that a digest on every load is never the slow part of a refit. ``torch_protocol_helper``: the
same for ``drs_protocol``'s :func:`~drs_protocol.weights_digest.digest_torch` (the trainer-side
helper, 16 MiB steps through a temporary). Copy GB/s count the bytes once (a copy reads and writes
them). Best of ``--repeats`` runs each.

    python bench/weights_digest.py [--mib 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any

from drs_protocol import weights_digest as wd


def best_seconds(fn: Callable[[], Any], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()  # warm-up (lane weights on the device, allocator)
    sync()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


def bench_numpy(nbytes: int, repeats: int) -> dict[str, Any]:
    import numpy as np

    raw = bytearray(os.urandom(nbytes))
    data = np.frombuffer(raw, dtype=np.uint8)
    target = np.empty_like(data)
    digest_s = best_seconds(lambda: wd.digest_numpy(raw), repeats)
    copy_s = best_seconds(lambda: np.copyto(target, data), repeats)
    return _figures(nbytes, digest_s, copy_s, "numpy.copyto on the host")


def bench_torch(nbytes: int, repeats: int, *, fused: bool = True) -> dict[str, Any]:
    import torch
    from drs_engine.weights.digest import fused_digest

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    target = torch.empty_like(flat)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    reference = wd.digest_numpy(flat[: 8 * wd.CHUNK_BYTES + 3].cpu().numpy().tobytes())
    digest = fused_digest if fused else wd.digest_torch
    assert digest(flat[: 8 * wd.CHUNK_BYTES + 3]) == reference, "torch and the reference disagree"
    digest_s = best_seconds(lambda: digest(flat), repeats, sync)
    copy_s = best_seconds(lambda: target.copy_(flat), repeats, sync)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "device": f"{device.type} ({name})",
        "torch": torch.__version__,
        **_figures(nbytes, digest_s, copy_s, f"Tensor.copy_ on {device.type}"),
    }


def _figures(nbytes: int, digest_s: float, copy_s: float, baseline: str) -> dict[str, Any]:
    digest_gbps = nbytes / digest_s / 1e9
    copy_gbps = nbytes / copy_s / 1e9
    return {
        "digest_gbps": round(digest_gbps, 3),
        "copy_gbps": round(copy_gbps, 3),
        "ratio": round(digest_gbps / copy_gbps, 3),
        "baseline": baseline,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="bytes digested, in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-numpy", action="store_true")
    args = parser.parse_args()
    nbytes = args.mib * 1024 * 1024
    out: dict[str, Any] = {"bench": "weights_digest", "machine": f"{platform.machine()} {os.cpu_count()} cores"}
    out["bytes"] = nbytes
    if not args.skip_numpy:
        out["numpy"] = bench_numpy(min(nbytes, 256 * 1024 * 1024), args.repeats)
    if importlib.util.find_spec("torch") is not None:
        out["torch"] = bench_torch(nbytes, args.repeats)
        out["torch_protocol_helper"] = bench_torch(nbytes, args.repeats, fused=False)
        out["target_torch_cuda_ge_0.5x_copy"] = (
            out["torch"]["ratio"] >= 0.5 if out["torch"]["device"].startswith("cuda") else None
        )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
