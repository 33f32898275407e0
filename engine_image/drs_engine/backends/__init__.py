"""Engine backends behind one interface (:class:`~drs_engine.backends.base.EngineBackend`).

``trtllm`` (TensorRT-LLM on GPUs), ``torch`` (a reference engine in PyTorch, one GPU per engine)
and ``sim`` (a CPU test double), one package each (``sim/``, ``torch/``, ``trtllm/``). :func:`create_backend`
imports a backend's package only when that backend is chosen, so ``sim`` never imports
``tensorrt_llm`` or ``torch`` (a test asserts it).

Written once for all of them: the interface and leg types (:mod:`.base`), the order of a leg's
steps (:mod:`.leg`), the backend-neutral handoff steps (:mod:`.handoff`) and the wall-clock
profile (:mod:`.profile`); prefix block hashing is :mod:`drs_engine.prefix_hash`.
"""

from __future__ import annotations

from collections.abc import Mapping

from drs_protocol.token_source import TokenSource

from drs_engine.backends.base import EngineBackend
from drs_engine.config import BackendName, EngineConfig


def create_backend(
    config: EngineConfig,
    *,
    vocab_size: int,
    eos_token_id: int,
    peer_headers: TokenSource | Mapping[str, str] | None = None,
) -> EngineBackend:
    """The backend ``config.backend`` names (tokenizer facts seed the sim's vocabulary).
    ``peer_headers``: what its KV fetch presents to a prefill engine (the serving token's
    ``authorization``, or the live token source); TensorRT-LLM moves KV with its own transceiver and takes none."""
    peer = peer_headers
    if config.backend is BackendName.SIM:
        from drs_engine.backends.sim.engine import SimBackend

        return SimBackend(config, vocab_size=vocab_size, eos_token_id=eos_token_id, peer_headers=peer)
    if config.backend is BackendName.TORCH:
        from drs_engine.backends.torch.engine import TorchBackend

        return TorchBackend(config, vocab_size=vocab_size, eos_token_id=eos_token_id, peer_headers=peer)
    from drs_engine.backends.trtllm.engine import TrtllmBackend

    return TrtllmBackend(config)
