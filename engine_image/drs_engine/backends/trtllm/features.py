"""What the installed TensorRT-LLM offers beyond the names every supported release has.

The image pins one release (``trtllm/surface.json``); names newer than some releases are
*features*: detected once at start from the imported classes, and when one is missing the engine
drops it with a logged, named reason (shown in ``/server_info``) instead of failing on every
request. Detection only inspects classes and signatures, so it runs against the contract double
in CI exactly as against the real package.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

log = logging.getLogger("drs_engine.trtllm")

#: Reason names (also in trtllm/surface.json).
CONVERSATION_PARAMS_UNSUPPORTED: Final = "conversation_params_unsupported"
CTX_USAGE_UNSUPPORTED: Final = "ctx_usage_unsupported"
SCHEDULE_STYLE_UNSUPPORTED: Final = "schedule_style_unsupported"
SLEEP_CONFIG_UNAVAILABLE: Final = "sleep_config_unavailable"


@dataclass(frozen=True, slots=True)
class Features:
    """The optional parts of the API the installed TensorRT-LLM has."""

    conversation_params: bool
    ctx_usage: bool
    schedule_style: bool
    sleep: bool
    memory_tags: tuple[str, ...]
    #: reason name -> what is degraded, for every missing feature.
    degraded: dict[str, str] = field(default_factory=dict)


def parameter_names(func: Callable[..., Any]) -> frozenset[str]:
    """Names a callable accepts (``**kwargs`` is not a name)."""
    params = inspect.signature(func).parameters.values()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def constructor_fields(cls: type[Any]) -> frozenset[str]:
    """Init fields of a dataclass, else the parameters of its ``__init__``."""
    if dataclasses.is_dataclass(cls):
        return frozenset(f.name for f in dataclasses.fields(cls) if f.init)
    return parameter_names(cls.__init__) - {"self"}


def sleep_tags(memory_type: Iterable[Any] | None) -> tuple[str, ...]:
    """The releasable tags of ``ExecutorMemoryType`` (values starting with ``_`` are internal),
    weights before ``kv_cache``, as NeMo RL releases them."""
    if memory_type is None:
        return ()
    values = [str(m.value if isinstance(m, enum.Enum) else m) for m in memory_type]
    public = [v for v in values if not v.startswith("_")]
    return tuple([v for v in public if v != "kv_cache"] + [v for v in public if v == "kv_cache"])


def detect_features(
    *,
    generate_async: Callable[..., Any],
    disaggregated_params: type[Any],
    conversation_params: type[Any] | None,
    sleep_config: type[Any] | None,
    memory_type: Iterable[Any] | None,
) -> Features:
    """Compare the installed classes with the recorded surface; log each missing feature once."""
    degraded: dict[str, str] = {}
    has_conversation = conversation_params is not None and "conversation_params" in parameter_names(generate_async)
    if not has_conversation:
        degraded[CONVERSATION_PARAMS_UNSUPPORTED] = (
            "generate_async takes no conversation_params: conversation ids are not passed to the engine "
            "(attention-DP rank affinity is lost; routing by the frontend is unaffected)"
        )
    dp_fields = constructor_fields(disaggregated_params)
    if "ctx_usage" not in dp_fields:
        degraded[CTX_USAGE_UNSUPPORTED] = "DisaggregatedParams has no ctx_usage: it is not passed on"
    if "schedule_style" not in dp_fields:
        degraded[SCHEDULE_STYLE_UNSUPPORTED] = "DisaggregatedParams has no schedule_style: it is not passed on"
    tags = sleep_tags(memory_type)
    has_sleep = sleep_config is not None and bool(tags)
    if not has_sleep:
        degraded[SLEEP_CONFIG_UNAVAILABLE] = "no SleepConfig/ExecutorMemoryType: memory release/resume answer 501"
    for reason, what in degraded.items():
        log.warning("TensorRT-LLM feature missing (%s): %s", reason, what)
    return Features(
        conversation_params=has_conversation,
        ctx_usage=CTX_USAGE_UNSUPPORTED not in degraded,
        schedule_style=SCHEDULE_STYLE_UNSUPPORTED not in degraded,
        sleep=has_sleep,
        memory_tags=tags,
        degraded=degraded,
    )
