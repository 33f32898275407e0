"""Engine backends behind one interface (:class:`~drs_engine.backends.base.EngineBackend`).

``trtllm`` (TensorRT-LLM on GPUs), ``torch`` (a reference engine in PyTorch, one GPU per engine)
and ``sim`` (a CPU test double). :func:`create_backend` imports a backend's module only when that
backend is chosen, so ``sim`` never imports ``tensorrt_llm`` or ``torch`` (a test asserts it).
"""

from __future__ import annotations

from drs_engine.backends.base import EngineBackend
from drs_engine.config import BackendName, EngineConfig


def create_backend(config: EngineConfig, *, vocab_size: int, eos_token_id: int) -> EngineBackend:
    """The backend ``config.backend`` names (tokenizer facts seed the sim's vocabulary)."""
    if config.backend is BackendName.SIM:
        from drs_engine.backends.sim import SimBackend

        return SimBackend(config, vocab_size=vocab_size, eos_token_id=eos_token_id)
    if config.backend is BackendName.TORCH:
        from drs_engine.backends.torch_backend import TorchBackend

        return TorchBackend(config, vocab_size=vocab_size, eos_token_id=eos_token_id)
    from drs_engine.backends.trtllm import TrtllmBackend

    return TrtllmBackend(config)
