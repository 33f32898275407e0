"""CONTRACT TEST DOUBLE: TensorRT-LLM's ``WorkerExtension`` base methods (names only; the double
runs its own behaviour for them in ``_torch/async_llm.py``)."""

from __future__ import annotations

from typing import Any


class WorkerExtension:
    def update_weights(self, ipc_handles: dict[str, Any] | None = None) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def start_profile(self) -> None: ...

    def stop_profile(self) -> None: ...
