"""CONTRACT TEST DOUBLE: ``tensorrt_llm.llmapi`` classes generated from the recorded surface."""

from __future__ import annotations

import enum

from tensorrt_llm._surface import OLDER, class_fields, strict_class, surface

_M = "tensorrt_llm.llmapi"
SamplingParams = strict_class("SamplingParams", class_fields("tensorrt_llm.llmapi.SamplingParams"), module=_M)
DisaggregatedParams = strict_class(
    "DisaggregatedParams", class_fields("tensorrt_llm.llmapi.DisaggregatedParams"), module=_M
)
DisaggScheduleStyle = enum.IntEnum(  # type: ignore[misc]
    "DisaggScheduleStyle", surface()["classes"]["tensorrt_llm.llmapi.DisaggScheduleStyle"]["members"]
)
if not OLDER:
    ConversationParams = strict_class(
        "ConversationParams", class_fields("tensorrt_llm.llmapi.ConversationParams"), module=_M
    )
