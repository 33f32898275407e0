"""Fixtures, and the one skip rule, of the ``torch`` backend's tests.

Skips live here, not in each module: every test in this folder needs PyTorch (the ``gpu`` extra,
never a default dependency), and a test marked ``@pytest.mark.gpu(n)`` needs ``n`` CUDA GPUs
(``gpu`` alone: one). Without them the test is skipped, saying what is missing; the modules import
torch only inside their tests, so they collect anywhere. Engines run ``random:tiny`` in float32 on
the CPU unless a test says otherwise, so greedy tokens are exact to compare.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from typing import TYPE_CHECKING, Any

import pytest
from drs_engine.config import EngineConfig, build_config

from .procs import NO_MULTICAST

if TYPE_CHECKING:
    from drs_engine.backends.torch.engine import TorchBackend
    from drs_engine.server.runner import RunningEngine

CONTROL_TOKEN = "torch-test-token"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
os.environ.update(NO_MULTICAST)  # NVLink multicast stays off in every process these tests start


@cache
def cuda_devices() -> int:
    """CUDA GPUs this machine has (0 without PyTorch or CUDA)."""
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def decode_gpu() -> int:
    """The decode engine's GPU: the second where there are two (KV crosses the link), else the one."""
    return 1 if cuda_devices() >= 2 else 0


def pytest_runtest_setup(item: pytest.Item) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs PyTorch, the torch backend's optional extra (pip install '.[gpu]')")
    marker = item.get_closest_marker("gpu")
    if marker is not None:
        need = int(marker.args[0]) if marker.args else 1
        if cuda_devices() < need:
            pytest.skip(f"needs {need} CUDA GPU(s), this machine has {cuda_devices()}")


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


def torch_backend(engine: RunningEngine) -> TorchBackend:
    """``engine``'s ``torch`` backend, for a test that reads or holds its internals (its GPU thread, its batcher)."""
    from drs_engine.backends.torch.engine import TorchBackend

    backend = engine.server.state.require_backend()
    assert isinstance(backend, TorchBackend)
    return backend


def auth() -> dict[str, str]:
    return {"authorization": f"Bearer {CONTROL_TOKEN}"}


def prompt_ids(n: int, offset: int = 1000) -> list[int]:
    """A prompt of ``n`` ordinary token ids."""
    return [offset + (i * 7919) % 50000 for i in range(n)]


def completion_body(ids: list[int], max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def save_random_hf_qwen3(size: str, directory: Any, *, seed: int = 0) -> Any:
    """A randomly initialised transformers ``Qwen3ForCausalLM`` of a :data:`SIZES` shape, saved with
    ``save_pretrained`` (safetensors) into ``directory``, as a new user would make one; returns the model."""
    import torch
    import transformers
    from drs_engine.backends.torch.model import SIZES

    hf = {k: v for k, v in SIZES[size].to_hf_config().items() if k not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**hf)).eval()
    model.save_pretrained(str(directory))
    return model


def transformers_greedy(model: Any, ids: list[int], new_tokens: int, device: str) -> list[int]:
    """transformers' own greedy ``generate``, never stopping on EOS (as ``ignore_eos`` decodes)."""
    import torch

    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.to(device).generate(
            torch.tensor([ids], device=device), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
        )
    return [int(t) for t in out[0, len(ids) :].tolist()]
