"""The recorded TensorRT-LLM API surface (``trtllm/surface.json``), loaded once.

The JSON lists exactly the TensorRT-LLM names this engine depends on, each with the repository,
path and commit it was read from (see engine_image/README.md). The backend, its feature
detection, strict mode and the contract double in the tests all read their name sets from here,
so a name is written down once.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any, Final

SURFACE_FILE: Final = "surface.json"


@cache
def surface() -> dict[str, Any]:
    """The parsed surface file (shipped inside the ``drs_engine.backends.trtllm`` package)."""
    text = resources.files("drs_engine.backends.trtllm").joinpath(SURFACE_FILE).read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def release() -> dict[str, Any]:
    """The pinned release: version, image, commit, and why."""
    value: dict[str, Any] = surface()["release"]
    return value


def llm_kwarg_names() -> frozenset[str]:
    """``AsyncLLM(...)`` keyword arguments this engine passes (derived or defaulted)."""
    return frozenset(surface()["llm"]["kwargs"])


def class_fields(symbol: str, *, with_features: bool = True) -> frozenset[str]:
    """Constructor fields of a recorded class; ``with_features`` adds the feature-detected ones."""
    entry = surface()["classes"][symbol]
    fields = set(entry.get("fields", ()))
    if with_features:
        fields.update(entry.get("feature_fields", {}))
    return frozenset(fields)


def openai_model_fields(model: str) -> frozenset[str]:
    """Fields of one of TensorRT-LLM's OpenAI response models (``extra="forbid"`` there)."""
    return frozenset(surface()["openai_models"]["models"][model])


def worker_extension_class() -> str:
    """Dotted path of this project's worker extension (``ray_worker_extension_cls`` default)."""
    value: str = surface()["worker_extension"]["ours"]
    return value
