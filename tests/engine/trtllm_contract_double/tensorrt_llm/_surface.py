"""The double's classes, generated from the recorded surface."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from drs_engine.backends.trtllm import surface as trtllm_surface

OLDER = os.environ.get("TRTLLM_DOUBLE_RELEASE") == "older"


def surface() -> dict[str, Any]:
    return trtllm_surface.surface()


def strict_class(name: str, fields: list[str] | frozenset[str], *, module: str) -> type[Any]:
    """A ``slots=True, kw_only=True`` dataclass with exactly ``fields`` (all defaulting to None)."""
    cls = dataclasses.make_dataclass(
        name, [(f, Any, dataclasses.field(default=None)) for f in sorted(fields)], slots=True, kw_only=True
    )
    cls.__module__ = module
    return cls


def class_fields(symbol: str) -> frozenset[str]:
    return trtllm_surface.class_fields(symbol, with_features=not OLDER)


def record(event: str, **data: Any) -> None:
    path = os.environ.get("TRTLLM_DOUBLE_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": event, "pid": os.getpid(), "t": time.time(), **data}, default=str) + "\n")
