"""What a sleeping ``torch`` engine still holds on its GPU, and where it was allocated (one JSON line).

A ``random:0.6b`` bf16 backend in this process is started (weights, warm-up: prefill, the decode
pool, its CUDA graphs, the compiled chains), then put to sleep through ``release_memory`` as
``POST /control/memory/release`` does, twice over: first with cuBLAS's per-stream workspaces kept
(as before the fix), then as the engine does now. Each time: ``torch.cuda.memory_allocated`` and
the live blocks by the allocation's innermost frames (``torch.cuda.memory._record_memory_history``),
largest first. Needs a CUDA GPU.

    python3 bench/gpu_sleep_memory.py [--out DIR]
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drs_engine.backends.torch.engine import TorchBackend
from drs_engine.config import build_config

CLEAR = "_cuda_clearCublasWorkspaces"


def live_blocks(top: int = 8) -> list[dict[str, Any]]:
    """Live allocations grouped by their innermost frames, largest total first."""
    groups: collections.Counter[str] = collections.Counter()
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = block.get("frames") or []
            where = " < ".join(f"{f['name']}@{Path(f['filename']).name}:{f['line']}" for f in frames[:6])
            groups[where or "(no frames)"] += block["size"]
    return [{"bytes": n, "frames": where} for where, n in groups.most_common(top)]


async def main() -> dict[str, Any]:
    torch.cuda.memory._record_memory_history(max_entries=200000, context="all", stacks="all")
    config = build_config(
        {
            "backend": "torch",
            "role": "decode",
            "host": "127.0.0.1",
            "port": 0,
            "model": {"path": "random:0.6b", "precision": "bfloat16", "maxModelLen": 40000},
            "torch": {"device": "cuda:0"},
        }
    )
    backend = TorchBackend(config, vocab_size=151936, eos_token_id=151645)
    await backend.start()
    awake = torch.cuda.memory_allocated()
    real = getattr(torch._C, CLEAR)
    setattr(torch._C, CLEAR, lambda: None)  # as before: the workspaces stay
    try:
        kept = await backend.release_memory([])
    finally:
        setattr(torch._C, CLEAR, real)
    before_fix = {"gpu_allocated_bytes": kept["gpu_allocated_bytes"], "live": live_blocks()}
    fixed = await backend.release_memory([])
    after_fix = {"gpu_allocated_bytes": fixed["gpu_allocated_bytes"], "live": live_blocks()}
    await backend.resume_memory([])
    await backend.close()
    return {
        "bench": "gpu_sleep_memory",
        "gpu": torch.cuda.get_device_name(0),
        "awake_allocated_bytes": awake,
        "asleep_workspaces_kept": before_fix,
        "asleep_now": after_fix,
    }


if __name__ == "__main__":
    result = asyncio.run(main())
    out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else None
    line = json.dumps(result)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_sleep_memory.json").write_text(line + "\n")
    print(line, flush=True)
