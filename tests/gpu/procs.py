"""``drs engine`` and ``drs sidecar`` as real processes, for the GPU tests and ``bench/gpu_disagg.py``.

Each engine is its own process (CUDA IPC maps memory of another process, never of itself), sees
every GPU and runs on the one its config names. NVLink multicast is off in each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

TOKEN = "gpu-test-token"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DRS = [sys.executable, "-c", "import sys; from drs_cli.main import main; sys.argv[0] = 'drs'; main()"]
ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "examples" / "trainer" / "trainer.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env() -> dict[str, str]:
    env = {**os.environ, **NO_MULTICAST, "DRS_CONTROL_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
    return env


def engine_config(role: str, device: str, model: str, precision: str = "bfloat16", **torch_spec: Any) -> dict[str, Any]:
    return {
        "backend": "torch",
        "role": role,
        "host": "127.0.0.1",
        "model": {"path": model, "precision": precision, "maxModelLen": 40000},
        "torch": {"device": device, **torch_spec},
    }


async def _wait_healthy(url: str, proc: asyncio.subprocess.Process, path: str, seconds: float) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        deadline = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < deadline:
            if proc.returncode is not None:
                raise RuntimeError(f"{url} exited with {proc.returncode} before it was healthy")
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(url + path)).status_code == 200:
                    return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} was not healthy within {seconds:g}s")


@contextlib.asynccontextmanager
async def process(args: list[str], url: str, health: str, seconds: float = 300.0) -> AsyncIterator[str]:
    proc = await asyncio.create_subprocess_exec(*args, env=child_env())
    try:
        await _wait_healthy(url, proc, health, seconds)
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()


@contextlib.asynccontextmanager
async def engine(config: dict[str, Any]) -> AsyncIterator[str]:
    """A ``drs engine`` process serving ``config``; yields its URL once healthy."""
    port = free_port()
    args = [*DRS, "engine", "--config-json", json.dumps({**config, "port": port}), "--log-level", "warning"]
    async with process(args, f"http://127.0.0.1:{port}", "/health") as url:
        yield url


@contextlib.asynccontextmanager
async def sidecar(*engine_urls: str) -> AsyncIterator[str]:
    """A ``drs sidecar`` process over these engines; yields its URL once healthy."""
    port = free_port()
    args = [*DRS, "sidecar", "--port", str(port), "--reconcile-interval", "3600", "--log-level", "warning"]
    for url in engine_urls:
        args += ["--engine", url]
    async with process(args, f"http://127.0.0.1:{port}", "/healthz", 60.0) as url:
        yield url


async def run_trainer(sidecar_url: str, *args: str) -> dict[str, Any]:
    """The example trainer against a sidecar; its JSON report."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(TRAINER), "--sidecar", sidecar_url, *args, env=child_env(), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 600)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer exited with {proc.returncode}")
    report: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return report


def auth() -> dict[str, str]:
    return {"authorization": f"Bearer {TOKEN}"}
