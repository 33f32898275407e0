"""Fixtures for the ``torch`` backend's tests.

The modules here import PyTorch with ``pytest.importorskip`` (it is the ``gpu`` extra, not a
default dependency), so without it they are skipped, saying why. Tests that need GPUs carry
``@pytest.mark.gpu`` and skip without enough CUDA devices. Engines run ``random:tiny`` in float32
on the CPU unless a test says otherwise, so greedy tokens are exact to compare.
"""

from __future__ import annotations

import os
from typing import Any

from drs_engine.config import EngineConfig, build_config

CONTROL_TOKEN = "torch-test-token"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
#: NVLink multicast stays off in every process these tests start (a shared host's GPUs).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)


def torch_config(
    role: str = "prefill", *, model: str = "random:tiny", precision: str = "float32", **torch_spec: Any
) -> EngineConfig:
    spec = {"device": "cpu", **torch_spec}
    return build_config(
        {
            "backend": "torch",
            "role": role,
            "host": "127.0.0.1",
            "port": 0,
            "model": {"path": model, "precision": precision, "maxModelLen": 4096},
            "torch": spec,
        }
    )


def auth() -> dict[str, str]:
    return {"authorization": f"Bearer {CONTROL_TOKEN}"}


def prompt_ids(n: int, offset: int = 1000) -> list[int]:
    """A prompt of ``n`` ordinary token ids."""
    return [offset + (i * 7919) % 50000 for i in range(n)]


def completion_body(ids: list[int], max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
