"""CONTRACT TEST DOUBLE: ``ExecutorMemoryType`` and ``SleepConfig`` from the recorded surface."""

from __future__ import annotations

import enum

from tensorrt_llm._surface import OLDER, class_fields, strict_class, surface

_values = surface()["classes"]["tensorrt_llm.llmapi.llm_args.ExecutorMemoryType"]["known_values"]
ExecutorMemoryType = enum.StrEnum("ExecutorMemoryType", {v.strip("_").upper(): v for v in _values})  # type: ignore[misc]
if not OLDER:
    SleepConfig = strict_class(
        "SleepConfig", class_fields("tensorrt_llm.llmapi.SleepConfig"), module="tensorrt_llm.llmapi.llm_args"
    )
