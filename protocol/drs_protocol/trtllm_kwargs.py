"""How TensorRT-LLM keyword arguments are merged, the one rule the operator and the engine share.

The operator merges ``spec.trtllm.kwargs`` with a role's ``trtllmKwargs`` and renders the result
as the engine config's ``trtllmKwargs``; the engine lays those over what it derives from the typed
fields (``drs_engine.backends.trtllm.translate.build_llm_kwargs``, the one derivation of
``LLM(...)`` kwargs). Both merges are :func:`deep_merge`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Final

#: ``kv_cache_config.tokens_per_block`` when the kwargs leave it unset (TensorRT-LLM's own default).
TRTLLM_DEFAULT_TOKENS_PER_BLOCK: Final = 32


def deep_merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """``overlay`` laid over ``base``: nested mappings merge key by key; anything else is replaced.
    Neither input is modified."""
    out: dict[str, Any] = copy.deepcopy(dict(base))
    for key, value in overlay.items():
        current = out.get(key)
        if isinstance(value, Mapping) and isinstance(current, Mapping):
            out[key] = deep_merge(current, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def tokens_per_block_of(llm_kwargs: Mapping[str, Any]) -> int:
    """``kv_cache_config.tokens_per_block`` of the LLM kwargs, else TensorRT-LLM's default."""
    kv = llm_kwargs.get("kv_cache_config")
    if isinstance(kv, Mapping) and isinstance(kv.get("tokens_per_block"), int):
        return int(kv["tokens_per_block"])
    return TRTLLM_DEFAULT_TOKENS_PER_BLOCK
